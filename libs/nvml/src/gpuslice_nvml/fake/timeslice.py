"""Contexts that share one GPU by time-slicing: what NVML lists, and what each really gets.

Contexts that are not clients of one MPS server do not run side by side on a GPU: the driver
gives each a time slice in turn. Two busy contexts each get half of the GPU, yet NVML's
per-process samples on an H100 (driver 580) reported ~99 % SM for each of them (issue 26), so
the sum of what NVML reports is no measure of what each got. The fake's samples do the same
(each runnable process reports its own SM demand, whoever else runs), and this meter is the
ground truth beside them: it polls each fake workload's runnable time (kernel ``schedstat``,
so a frozen process demands nothing) every few milliseconds and splits the GPU in every tick
in proportion to what the runnable contexts demand, never more than the whole GPU.

What NVML lists (:class:`TickListing`): the H100's driver lists **one** process per 200 ms
tick, at the tick's utilization, in proportion to the time each context got: two busy contexts
are not both reported at 50 %, nor both at 99 % in one tick. The fake does the same whenever
the contexts of a GPU ask for more than the whole GPU together.

The meter (:class:`TimeSlicedGpu`) is used by tests and the bench to measure throttling the way
a user's throughput would show it::

    with TimeSlicedGpu({hog.pid: 100, calm.pid: 100}) as gpu:
        time.sleep(5)
    gpu.share(hog.pid)  # fraction of the GPU the process got over the window
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType

from gpuslice_nvml.fake import procfs

TICK_S = 0.005


class TickListing:
    """Which process a driver tick lists when a GPU's contexts ask for more than all of it.

    Each tick, every runnable context earns its share of the GPU (its demand over the sum of
    all demands) as credit; the one with the most credit is listed, at the GPU's utilization
    (100 %), and pays one tick. Over ticks each is listed in proportion to its time slices,
    deterministically. A tick already decided (a second read of the same driver sample) lists
    the same process again.
    """

    def __init__(self) -> None:
        self._credit: dict[tuple[int, int], float] = {}  # (gpu, pid) -> ticks owed
        self._decided: dict[int, tuple[int, int]] = {}  # gpu -> (tick timestamp, pid listed)

    def pick(self, gpu: int, tick_us: int, demand: Mapping[int, int]) -> dict[int, int]:
        """pid -> SM percent to list for this tick: ``demand`` as it is when it fits the
        GPU, else the one process whose turn it is, at 100 %."""
        total = sum(demand.values())
        if total <= 100:
            return dict(demand)
        decided = self._decided.get(gpu)
        if decided is not None and decided[0] == tick_us and decided[1] in demand:
            return {decided[1]: 100}
        for key in [k for k in self._credit if k[0] == gpu and k[1] not in demand]:
            del self._credit[key]
        for pid, sm in demand.items():
            self._credit[(gpu, pid)] = self._credit.get((gpu, pid), 0.0) + sm / total
        listed = max(demand, key=lambda pid: (self._credit[(gpu, pid)], -pid))
        self._credit[(gpu, listed)] -= 1.0
        self._decided[gpu] = (tick_us, listed)
        return {listed: 100}


class TimeSlicedGpu:
    """Polls ``demand`` (pid → SM percent it asks for while runnable) on a thread until exit."""

    def __init__(
        self,
        demand: Mapping[int, int],
        *,
        tick_s: float = TICK_S,
        clock: Callable[[], float] = time.monotonic,
        runnable_ns: Callable[[int], int | None] = procfs.runnable_ns,
    ) -> None:
        self._demand = {pid: max(0, min(100, sm)) / 100 for pid, sm in demand.items()}
        self._tick_s = tick_s
        self._clock = clock
        self._runnable_ns = runnable_ns
        self._busy = dict.fromkeys(self._demand, 0.0)
        self._last: dict[int, int] = {}
        self._started = self._now = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> TimeSlicedGpu:
        self._started = self._now = self._clock()
        self._last = self._read()
        self._thread = threading.Thread(target=self._run, name="timesliced-gpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.tick()

    def share(self, pid: int) -> float:
        """The fraction of the GPU ``pid`` got over the window so far (0 to 1)."""
        with self._lock:
            wall = self._now - self._started
            return self._busy[pid] / wall if wall > 0 else 0.0

    def tick(self) -> None:
        """Account the time since the previous tick (called by the thread; public for tests)."""
        now, runnable = self._clock(), self._read()
        with self._lock:
            dt = now - self._now
            if dt <= 0:
                return
            wants: dict[int, float] = {}
            for pid, at in runnable.items():
                before = self._last.get(pid, at)
                # The kernel adds a running task's time at its scheduler ticks, so one poll
                # may see more than the wall time since the last and the next less: what is
                # over is carried to the next poll rather than lost.
                ran = min(max(at - before, 0), int(dt * 1e9))
                wants[pid] = self._demand[pid] * ran / 1e9 / dt
                self._last[pid] = before + ran
            total = sum(wants.values())
            scale = 1.0 / total if total > 1.0 else 1.0  # one GPU: time slices add up to it
            for pid, want in wants.items():
                self._busy[pid] += want * scale * dt
            self._now = now

    def _read(self) -> dict[int, int]:
        found = {pid: self._runnable_ns(pid) for pid in self._demand}
        return {pid: ns for pid, ns in found.items() if ns is not None}

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            self.tick()
