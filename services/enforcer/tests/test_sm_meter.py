"""SM use from NVML's per-process samples, weighted by the time each covers (``SmMeter``)."""

from __future__ import annotations

from gpuslice_enforcer.smmeter import SmMeter
from gpuslice_nvml import ProcessUtilization

S = 1_000_000  # microseconds


def sample(pid: int, at_s: float, sm: int) -> ProcessUtilization:
    return ProcessUtilization(
        pid=pid, timestamp_us=round(at_s * S), sm_percent=sm, memory_percent=0
    )


def test_a_driver_cadence_slower_than_the_watchdog_loses_nothing() -> None:
    """A process at 90 % sampled every 0.3 s by the driver, read every 0.1 s: two reads of
    three bring nothing, the third a sample covering 0.3 s. Every percent-second is counted
    once; averaging per read (the old way) counted a third of them."""
    meter = SmMeter()
    meter.add(0, [sample(7, 0.0, 90)], None, 0.1)  # the first read: history, charges nothing
    total, last_ts = 0.0, 0
    for read in range(1, 31):  # 3 s of reads every 0.1 s
        now = read * 0.1
        due = [sample(7, now, 90)] if read % 3 == 0 else []
        busy = meter.add(0, due, last_ts, 0.1)
        last_ts = max([s.timestamp_us for s in due], default=last_ts)
        total += busy.get(7, 0.0)
    assert abs(total - 90 * 3.0) < 1e-6  # 270 percent-seconds in 3 s: 90 % on average
    assert meter.rate(0, 7) == 90


def test_samples_of_one_read_are_weighted_by_their_spans() -> None:
    meter = SmMeter()
    meter.add(0, [sample(1, 0.0, 0)], None, 0.1)
    busy = meter.add(0, [sample(1, 0.2, 100), sample(1, 0.4, 50)], 0, 0.1)
    assert abs(busy[1] - (100 * 0.2 + 50 * 0.2)) < 1e-9
    assert abs(meter.rate(0, 1) - 75) < 1e-9


def steady(meter: SmMeter, until_s: float, pid: int = 1, sm: int = 99) -> int:
    """Process ``pid`` sampled every 0.2 s from 0 to ``until_s`` (the driver's cadence)."""
    meter.add(0, [sample(pid, 0.0, sm)], None, 0.1)
    last, t = 0, 0.2
    while t <= until_s + 1e-9:
        meter.add(0, [sample(pid, t, sm)], last, 0.1)
        last, t = round(t * S), t + 0.2
    return last


def test_a_process_is_charged_one_driver_interval_at_most_per_sample() -> None:
    """Resuming after 3 s frozen (no samples meanwhile), a process is charged for the interval
    its sample covers, not for the gap; a new process likewise for its first sample."""
    meter = SmMeter()
    last = steady(meter, 2.0)  # learns the 200 ms cadence
    assert meter.interval_us(0, 100_000) == 200_000
    busy = meter.add(0, [sample(1, 5.0, 60), sample(2, 5.0, 30)], last, 0.1)
    cap = 0.2 * SmMeter.JITTER
    assert abs(busy[1] - 60 * cap) < 1e-6
    assert abs(busy[2] - 30 * cap) < 1e-6


def test_time_sliced_contexts_listed_in_turn_are_charged_their_ticks() -> None:
    """What an H100 (driver 580) gives for two busy contexts of their own: one process per
    200 ms tick at 99 %, in proportion to the time each got. Each is charged the ticks that
    list it, not the time since its own previous sample (which charged 1.5x here)."""
    meter = SmMeter()
    meter.add(0, [sample(1, 0.0, 99)], None, 0.1)
    charged = {1: 0.0, 2: 0.0}
    last = 0
    for tick in range(1, 31):  # 6 s: pid 1 in two ticks of five, pid 2 in the others
        pid = 1 if tick % 5 < 2 else 2
        busy = meter.add(0, [sample(pid, tick * 0.2, 99)], last, 0.1)
        last = round(tick * 0.2 * S)
        for p, used in busy.items():
            charged[p] += used
    assert abs(charged[1] / 6.0 - 39.6) < 1e-6 and abs(charged[2] / 6.0 - 59.4) < 1e-6
    assert abs(meter.rate(0, 1) - 39.6) < 1e-6 and abs(meter.rate(0, 2) - 59.4) < 1e-6


def test_contexts_listed_in_one_tick_add_up_to_one_gpu_at_most() -> None:
    """A driver that lists several time-sliced contexts in one tick, each at its own full use
    (the fake can): each is charged its proportion of the GPU; under 100 % as reported."""
    meter = SmMeter()
    last = steady(meter, 2.0)
    busy = meter.add(0, [sample(1, 2.2, 99), sample(2, 2.2, 99)], last, 0.1)
    assert abs(busy[1] - 50 * 0.2) < 1e-6 and abs(busy[2] - 50 * 0.2) < 1e-6
    busy = meter.add(0, [sample(1, 2.4, 40), sample(2, 2.4, 60)], 2_200_000, 0.1)
    assert abs(busy[1] - 40 * 0.2) < 1e-6 and abs(busy[2] - 60 * 0.2) < 1e-6


def test_the_first_read_charges_nothing_and_gone_processes_are_forgotten() -> None:
    meter = SmMeter()
    assert meter.add(0, [sample(1, 1.0, 50), sample(2, 1.0, 50)], None, 0.1) == {}
    meter.retain(0, {1})
    assert meter.rate(0, 2) == 0.0 and meter.rate(0, 1) == 50
