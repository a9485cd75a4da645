"""SM use per process from NVML's utilization samples, as the driver takes them.

What a real driver gives (H100, driver 580, issue 26; the GPU stage keeps the raw samples):

* one sample per *tick* of its own cadence (200 ms), not of the watchdog's (100 ms), so some
  watchdog periods bring no sample and others one that covers two periods;
* in each tick, **one** process: the context the GPU ran then, at the tick's utilization (~99 %
  while busy). Two busy contexts of their own (time-sliced, not clients of one MPS server) are
  not both reported at 50 %: one is listed at 99 % in some ticks, the other in the rest, in
  proportion to the time each got;
* a process that was frozen, or had no work, is absent, or listed at 0 %.

So a sample accounts ``smUtil x tick`` percent-seconds, where the tick is the time since the
GPU's previous tick (whichever process it listed), at most the driver's interval: learned per
GPU as the shortest gap between its distinct tick timestamps (at least the watchdog's period;
x 1.5 for jitter). Charging instead the time since the *process's* previous sample overcharged
a process listed in every other tick by half again (the 30 % and 70 % shares side by side got
26 % and 52 %); counting a missing sample as 0 % and every sample as one watchdog period
undercounted a busy process (a 30 % share ran at ~70 %).

Should a driver list several processes in one tick at more than the whole GPU together (the
fake can, and so might other drivers for time-sliced contexts), each is scaled down in
proportion: one GPU's tick never accounts more than 100 %.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from gpuslice_nvml import ProcessUtilization


@dataclass
class _Tick:
    at_us: int
    span_us: int
    sm: dict[int, float] = field(default_factory=dict)  # pid -> percent over the tick


class SmMeter:
    """Percent-seconds per process and GPU from the samples of each read (``add``), and each
    process's recent rate (``rate``, over the last ``WINDOW_US``)."""

    #: The longest time one tick is taken to cover whatever is learned.
    MAX_SPAN_US = 2_000_000
    #: Distinct tick timestamps kept per GPU to learn the driver's interval from.
    TICKS = 64
    JITTER = 1.5
    #: The window a process's rate is averaged over.
    WINDOW_US = 1_000_000

    def __init__(self) -> None:
        self._last_tick: dict[int, int] = {}  # gpu -> timestamp of its latest tick
        self._stamps: dict[int, deque[int]] = {}  # gpu -> recent distinct tick timestamps
        self._recent: dict[int, deque[_Tick]] = {}  # gpu -> ticks of the rate window

    def interval_us(self, gpu: int, period_us: int) -> int:
        """The driver's sampling interval on ``gpu`` as seen so far (at least ``period_us``)."""
        stamps = list(self._stamps.get(gpu, ()))
        gaps = [b - a for a, b in itertools.pairwise(stamps) if b > a]
        return max(period_us, min(gaps, default=period_us))

    def add(
        self,
        gpu: int,
        samples: list[ProcessUtilization],
        previous_ts: int | None,
        period_s: float,
    ) -> dict[int, float]:
        """Account a read's samples; percent-seconds per pid. The first read of a GPU
        (``previous_ts`` None) may return the driver's whole sample buffer: it sets the rates
        and the timestamps, and charges nothing."""
        ticks = _ticks(samples, int(self.interval_us(gpu, int(period_s * 1e6)) // 2))
        stamps = self._stamps.setdefault(gpu, deque(maxlen=self.TICKS))
        for at, _ in ticks:
            if not stamps or at > stamps[-1]:
                stamps.append(at)
        cap = min(int(self.interval_us(gpu, int(period_s * 1e6)) * self.JITTER), self.MAX_SPAN_US)
        recent = self._recent.setdefault(gpu, deque())
        busy: dict[int, float] = {}
        for at, sm in ticks:
            last = self._last_tick.get(gpu, previous_ts or 0)
            if at <= last and previous_ts is not None:
                continue  # already accounted (a read that overlaps the previous one)
            span = min(max(at - last, 0), cap)
            self._last_tick[gpu] = max(at, last)
            recent.append(_Tick(at, span, sm))
            for pid, percent in sm.items():
                busy[pid] = busy.get(pid, 0.0) + percent * span / 1e6
        while recent and recent[-1].at_us - recent[0].at_us >= self.WINDOW_US:
            recent.popleft()
        return busy if previous_ts is not None else {}

    def rate(self, gpu: int, pid: int) -> float:
        """``pid``'s SM percent over the GPU's recent ticks (0 in a tick that lists others)."""
        recent = self._recent.get(gpu, ())
        covered = sum(t.span_us for t in recent)
        if covered <= 0:  # only the first read's ticks: their own average
            values = [t.sm[pid] for t in recent if pid in t.sm]
            return sum(values) / len(values) if values else 0.0
        return sum(t.sm.get(pid, 0.0) * t.span_us for t in recent) / covered

    def retain(self, gpu: int, pids: set[int]) -> None:
        """Forget what the GPU's recent ticks say about processes not in ``pids``."""
        for tick in self._recent.get(gpu, ()):
            for pid in [p for p in tick.sm if p not in pids]:
                del tick.sm[pid]


def _ticks(samples: list[ProcessUtilization], tick_us: int) -> list[tuple[int, dict[int, float]]]:
    """The samples grouped by driver tick (timestamps less than ``tick_us`` apart), in time
    order, each with its SM percent per pid scaled so that a tick adds up to 100 % at most."""
    out: list[tuple[int, dict[int, float]]] = []
    group: list[ProcessUtilization] = []

    def close() -> None:
        if not group:
            return
        sm: dict[int, float] = {}
        for s in group:
            sm[s.pid] = sm.get(s.pid, 0.0) + s.sm_percent
        total = sum(sm.values())
        scale = 100.0 / total if total > 100 else 1.0
        out.append((max(s.timestamp_us for s in group), {p: v * scale for p, v in sm.items()}))
        group.clear()

    for s in sorted(samples, key=lambda s: s.timestamp_us):
        if group and s.timestamp_us - group[0].timestamp_us >= max(tick_us, 1):
            close()
        group.append(s)
    close()
    return out
