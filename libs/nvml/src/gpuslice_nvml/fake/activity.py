"""Processes backed by real OS processes: liveness and SM accounting that honours frozen time.

Three kinds of fake process (``ProcessState``):

* not real (the default, e.g. ``ctl process add --pid 4242``): reports its configured
  ``sm_percent`` on every sample, as before;
* real, accounting ``constant``: reports ``sm_percent`` unless its cgroup is frozen at the
  moment of the sample, then 0;
* real, accounting ``runnable`` (``python -m gpuslice_nvml.fake.workload --sm N``): the process
  spins, so it is runnable exactly while it is not frozen, and its SM use over any window is
  ``sm_percent`` x (runnable time / wall time). The cumulative figures (:class:`SmAccounting`)
  come from the kernel's ``schedstat``, so they measure throttling independently of whoever
  does the throttling.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import procfs
from gpuslice_nvml.fake.state import NodeState, ProcessState

ACCOUNTING_MODES = ("constant", "runnable")


def live(process: ProcessState) -> bool:
    """A real process counts only while its OS process lives; others always count."""
    return not process.real or procfs.alive(process.pid, process.start_time)


def live_processes(state: NodeState) -> list[ProcessState]:
    return [p for p in state.processes if live(p)]


def attach_real(process: ProcessState, accounting: str, now_ns: int, what: str) -> None:
    """Bind a new fake process to the live OS process with its pid."""
    if accounting not in ACCOUNTING_MODES:
        raise e.nvml_error(
            e.ERROR_INVALID_ARGUMENT, what, f"accounting must be one of {ACCOUNTING_MODES}"
        )
    started = procfs.start_time(process.pid)
    runnable = procfs.runnable_ns(process.pid)
    if started is None or runnable is None:
        raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"no live OS process has pid {process.pid}")
    process.real = True
    process.start_time = started
    process.accounting = accounting
    process.started_ns = now_ns
    process.runnable_start_ns = runnable
    process.fold_runnable_ns = runnable
    process.busy_before_fold_ns = 0.0


def carry_over(old: ProcessState, new: ProcessState) -> None:
    """Keep the accounting of a real process whose record is replaced (same pid, updated)."""
    if old.real and old.start_time == new.start_time:
        new.started_ns = old.started_ns
        new.runnable_start_ns = old.runnable_start_ns
        new.fold_runnable_ns = old.fold_runnable_ns
        new.busy_before_fold_ns = old.busy_before_fold_ns
        fold(new, old.sm_percent)


def fold(process: ProcessState, previous_sm_percent: int) -> None:
    """Close the accounting segment at the old SM percentage before it changes."""
    if not process.real or process.fold_runnable_ns is None:
        return
    now = procfs.runnable_ns(process.pid)
    if now is None:
        return
    process.busy_before_fold_ns += previous_sm_percent / 100 * (now - process.fold_runnable_ns)
    process.fold_runnable_ns = now


@dataclass(frozen=True, slots=True)
class SmAccounting:
    """What a runnable-accounted process got since it was registered, from the kernel's clock.

    ``busy_seconds / wall_seconds * 100`` is the SM share it achieved; ``frozen_seconds`` is the
    time it could not run (frozen by the cgroup freezer).
    """

    pid: int
    sm_percent: int
    wall_seconds: float
    active_seconds: float
    frozen_seconds: float
    #: SM-seconds: sum over its runnable time of its SM fraction.
    busy_seconds: float


def accounting(process: ProcessState, now_ns: int, what: str) -> SmAccounting:
    if process.accounting != "runnable" or process.started_ns is None:
        raise e.nvml_error(
            e.ERROR_NOT_SUPPORTED,
            what,
            f"process {process.pid} is not runnable-accounted (register it with "
            "accounting='runnable', e.g. through gpuslice_nvml.fake.workload)",
        )
    runnable = procfs.runnable_ns(process.pid)
    if runnable is None or process.runnable_start_ns is None or process.fold_runnable_ns is None:
        raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"process {process.pid} has exited")
    wall = (now_ns - process.started_ns) / 1e9
    active = (runnable - process.runnable_start_ns) / 1e9
    busy = (
        process.busy_before_fold_ns
        + process.sm_percent / 100 * (runnable - process.fold_runnable_ns)
    ) / 1e9
    return SmAccounting(
        pid=process.pid,
        sm_percent=process.sm_percent,
        wall_seconds=wall,
        active_seconds=min(active, wall),
        frozen_seconds=max(0.0, wall - active),
        busy_seconds=busy,
    )


class UtilizationWindows:
    """Per-reader memory of each process's runnable time, so that a sample reports the SM use
    over the window NVML averages: since the reader's previous sample of the process (NVML's
    ``lastSeenTimeStamp``; the default), or, with a driver sampling period, over the last
    period only, as a real driver does (a process idle for a while is not charged for the gap).
    """

    #: Points kept per process: enough to look one driver period back at any poll rate used.
    HISTORY = 64

    def __init__(self, wall_clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._clock = wall_clock_ns
        self._seen: dict[tuple[int, int], tuple[int, int]] = {}
        self._history: dict[tuple[int, int], deque[tuple[int, int]]] = {}

    def observe(self, process: ProcessState) -> None:
        """Note where a real process stands now (called on every poll, sample or not)."""
        if not process.real or process.accounting != "runnable":
            return
        runnable = procfs.runnable_ns(process.pid)
        if runnable is not None:
            key = (process.gpu, process.pid)
            points = self._history.setdefault(key, deque(maxlen=self.HISTORY))
            points.append((self._clock(), runnable))

    def sm_percent(self, process: ProcessState, period_ns: int = 0) -> int:
        if not process.real:
            return process.sm_percent
        if process.accounting == "constant":
            return 0 if procfs.frozen(process.pid) else process.sm_percent
        runnable = procfs.runnable_ns(process.pid)
        if runnable is None:
            return 0
        now = self._clock()
        key = (process.gpu, process.pid)
        prev = self._seen.get(key)
        if prev is None and process.started_ns is not None and process.runnable_start_ns:
            prev = (process.started_ns, process.runnable_start_ns)
        if period_ns:
            older = [p for p in self._history.get(key, ()) if p[0] <= now - period_ns]
            if older and (prev is None or older[-1][0] > prev[0]):
                prev = older[-1]
        self._seen[key] = (now, runnable)
        if prev is None or now <= prev[0]:
            return 0 if procfs.frozen(process.pid) else process.sm_percent
        fraction = min(1.0, max(0.0, (runnable - prev[1]) / (now - prev[0])))
        return round(process.sm_percent * fraction)

    def forget_except(self, alive: set[tuple[int, int]]) -> None:
        for key in list(self._seen):
            if key not in alive:
                del self._seen[key]
        for key in list(self._history):
            if key not in alive:
                del self._history[key]
