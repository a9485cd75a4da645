"""SM use from NVML's per-process samples, weighted by the time each covers (``SmMeter``)."""

from __future__ import annotations

from gpuslice_enforcer.watchdog import SmMeter
from gpuslice_nvml import ProcessUtilization

S = 1_000_000  # microseconds


def sample(pid: int, at_s: float, sm: int) -> ProcessUtilization:
    return ProcessUtilization(pid=pid, timestamp_us=int(at_s * S), sm_percent=sm, memory_percent=0)


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
    busy = meter.add(0, [sample(1, 0.2, 100), sample(1, 0.3, 0)], 0, 0.1)
    assert abs(busy[1] - 20.0) < 1e-9  # 100 % for 0.2 s, 0 % for 0.1 s
    assert abs(meter.rate(0, 1) - 100 * 0.2 / 0.3) < 1e-9


def test_a_long_gap_is_capped_and_gone_processes_are_forgotten() -> None:
    meter = SmMeter()
    meter.add(0, [sample(1, 0.0, 50), sample(2, 0.0, 50)], None, 0.1)
    busy = meter.add(0, [sample(1, 10.0, 50)], 0, 0.1)
    assert busy[1] == 50 * SmMeter.MAX_SPAN_US / S
    meter.retain(0, {1})
    assert meter.rate(0, 2) == 0.0 and meter.rate(0, 1) == 50


def test_a_new_process_is_charged_at_most_one_period_for_its_first_sample() -> None:
    """The GPU's previous sample may be seconds old (nothing ran); a process that just started
    must not be charged for that whole gap."""
    meter = SmMeter()
    meter.add(0, [sample(1, 0.0, 50)], None, 0.1)
    busy = meter.add(0, [sample(2, 5.0, 100)], 0, 0.1)
    assert abs(busy[2] - 100 * 0.1) < 1e-9
