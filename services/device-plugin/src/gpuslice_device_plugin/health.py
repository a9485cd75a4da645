"""Device health from NVML events, with the recovery NVIDIA's plugin lacks.

- A critical XID on a GPU makes every device of it Unhealthy (an XID on one MIG GPU instance only
  the devices of that instance); the application XIDs 13, 31, 43, 45, 68, 109 are ignored
  (``--ignored-xids``). A double-bit ECC error and a lost GPU count like a critical XID.
- Recovery: every ``--health-check-interval`` a problem whose GPU answers NVML again and that has
  not repeated for ``--xid-quiet-period`` (a lost GPU: as soon as it answers) is cleared, and the
  devices are Healthy again in ListAndWatch. ``--no-health-recovery`` keeps them Unhealthy until
  the plugin restarts, as NVIDIA's does.
- When NVML cannot watch events the devices stay Healthy and a warning says health is
  unmonitored (NVIDIA's behaviour too: "continuing with health checks disabled").

Every change bumps :attr:`HealthTracker.generation` and wakes the waiters in :meth:`wait_change`,
which is how the ListAndWatch streams learn about it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.devices import Device
from gpuslice_nvml import HealthEvent, HealthEventKind, Nvml, NvmlError
from gpuslice_nvml.health import APP_XIDS, recovered, watch_health

log = get_logger(__name__)


@dataclass
class Problem:
    gpu: int
    gpu_instance_id: int | None  # None: the whole GPU
    reason: str
    last: float

    def applies(self, device: Device) -> bool:
        if device.gpu_index != self.gpu:
            return False
        return self.gpu_instance_id is None or device.gpu_instance_id == self.gpu_instance_id


class HealthTracker:
    def __init__(
        self,
        nvml: Nvml,
        *,
        ignored_xids: Iterable[int] = APP_XIDS,
        quiet_period: float = 300.0,
        check_interval: float = 10.0,
        recovery: bool = True,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.nvml = nvml
        self.ignored_xids = frozenset(ignored_xids)
        self.quiet_period = quiet_period
        self.check_interval = check_interval
        self.recovery = recovery
        self.clock = clock
        self.on_event = on_event
        self.generation = 0
        self._problems: dict[tuple[int, int | None, str], Problem] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watching = threading.Event()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 5.0) -> None:
        """Start watching; returns once the event watch exists (events from then on count)."""
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()
        self._watching.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        try:
            watch_health(
                self.nvml,
                self._stop,
                check_interval=self.check_interval,
                on_event=self.handle,
                on_check=self.check_recovery,
                on_watching=self._watching.set,
                poll=0.5,
            )
        except NvmlError as exc:
            log.warning("NVML cannot watch health events; health unmonitored", error=str(exc))
        finally:
            self._watching.set()

    # ---- events ----------------------------------------------------------------------------
    def handle(self, event: HealthEvent) -> bool:
        """Record one event; True when device health changed."""
        if self.on_event is not None:
            self.on_event(event.kind.value)
        if event.kind is HealthEventKind.XID:
            if event.xid is None or event.xid in self.ignored_xids:
                log.info("application XID ignored", gpu=event.gpu_index, xid=event.xid)
                return False
            reason = f"XID {event.xid}"
        elif event.kind is HealthEventKind.ECC_DOUBLE_BIT:
            reason = "ECC double-bit error"
        elif event.kind is HealthEventKind.GPU_LOST:
            reason = "GPU lost"
        else:
            return False
        instance = None if event.kind is HealthEventKind.GPU_LOST else event.gpu_instance_id
        key = (event.gpu_index, instance, reason)
        now = self.clock()
        with self._cond:
            old = self._problems.get(key)
            if old is not None:
                old.last = now
                return False
            self._problems[key] = Problem(event.gpu_index, instance, reason, now)
            self._changed()
        log.warning(
            "devices unhealthy",
            gpu=event.gpu_index,
            gpu_instance=instance,
            reason=reason,
        )
        return True

    def check_recovery(self) -> bool:
        """Clear the problems that recovered; True when device health changed."""
        if not self.recovery:
            return False
        with self._cond:
            problems = dict(self._problems)
        faults = [(key, p.gpu, p.last, p.reason == "GPU lost") for key, p in problems.items()]
        cleared = recovered(faults, self.nvml, now=self.clock(), quiet_period=self.quiet_period)
        if not cleared:
            return False
        for key in cleared:
            log.info("devices healthy again", gpu=problems[key].gpu, reason=problems[key].reason)
        with self._cond:
            for key in cleared:
                self._problems.pop(key, None)
            self._changed()
        return True

    def _changed(self) -> None:  # called with the condition held
        self.generation += 1
        self._cond.notify_all()

    # ---- views -----------------------------------------------------------------------------
    def healthy(self, device: Device) -> bool:
        with self._cond:
            return not any(p.applies(device) for p in self._problems.values())

    def reasons(self, device: Device) -> list[str]:
        with self._cond:
            return [p.reason for p in self._problems.values() if p.applies(device)]

    def wait_change(
        self, generation: int, timeout: float, until: threading.Event | None = None
    ) -> int:
        """Block until the generation differs from ``generation``, a stop (ours or ``until``,
        with :meth:`wake`), or ``timeout``."""

        def done() -> bool:
            stopped = until is not None and until.is_set()
            return self.generation != generation or self._stop.is_set() or stopped

        with self._cond:
            self._cond.wait_for(done, timeout)
            return self.generation

    def wake(self) -> None:
        """Wake every waiter (a server stopping ends its streams)."""
        with self._cond:
            self._cond.notify_all()
