"""Device health from NVML events: taints in the ResourceSlice, the DRA health stream, recovery.

- An XID on a GPU taints every device of that GPU (an XID on a MIG instance only that MIG
  device) with ``gpu.gpuslice.dev/xid=<code>``: effect ``NoSchedule``, or ``None``
  (informational) for the application XIDs 13, 31, 43, 45, 68, 109 (``--ignored-xids``).
- A lost GPU taints its devices ``gpu.gpuslice.dev/gpu-lost`` (NoSchedule); a double-bit ECC
  error ``gpu.gpuslice.dev/ecc=double-bit`` (NoSchedule).
- When NVML cannot watch events the devices carry ``gpu.gpuslice.dev/unmonitored`` (None).
- Recovery (unlike NVIDIA's driver, whose taints stay until a restart): every
  ``--health-check-interval`` a lost GPU that answers NVML again is untainted, and an XID or ECC
  taint is cleared once ``--xid-quiet-period`` has passed without a repeat and the GPU answers.
  ``--no-health-recovery`` keeps taints until the plugin restarts.

Devices with a NoSchedule taint are UNHEALTHY in the DRA health stream, others HEALTHY.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from gpuslice_api.names import DRIVER
from gpuslice_core.logging import get_logger
from gpuslice_draplugin import DeviceHealth
from gpuslice_kubelet_plugin.discovery import Device, Inventory, dns_label
from gpuslice_kubelet_plugin.metrics import PluginMetrics
from gpuslice_nvml import HealthEvent, HealthEventKind, Nvml, NvmlError
from gpuslice_nvml.health import APP_XIDS, recovered, watch_health

log = get_logger(__name__)

KEY_XID = f"{DRIVER}/xid"
KEY_LOST = f"{DRIVER}/gpu-lost"
KEY_ECC = f"{DRIVER}/ecc"
KEY_UNMONITORED = f"{DRIVER}/unmonitored"
MAX_TAINTS = 16


@dataclass(frozen=True)
class Problem:
    key: str
    value: str
    effect: str  # NoSchedule | None
    since: float
    gpu: int
    devices: frozenset[str] | None = None  # None: every device of the GPU
    last: float = 0.0  # when it was last seen (a repeat restarts the quiet period)

    def applies(self, device: Device) -> bool:
        if device.gpu_index != self.gpu:
            return False
        return self.devices is None or device.name in self.devices

    def taint(self) -> dict[str, Any]:
        added = datetime.fromtimestamp(int(self.since), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        out = {"key": self.key, "effect": self.effect, "timeAdded": added}
        if self.value:
            out["value"] = self.value
        return out

    def describe(self) -> str:
        what = {KEY_XID: f"XID {self.value}", KEY_LOST: "GPU lost", KEY_ECC: "ECC double-bit"}
        return f"{what.get(self.key, self.key)} ({self.effect})"


class HealthMonitor:
    def __init__(
        self,
        nvml: Nvml,
        inventory: Callable[[], Inventory],
        on_change: Callable[[], None],
        metrics: PluginMetrics,
        *,
        ignored_xids: Iterable[int] = APP_XIDS,
        quiet_period: float = 300.0,
        check_interval: float = 10.0,
        recovery: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.nvml = nvml
        self.inventory = inventory
        self.on_change = on_change
        self.metrics = metrics
        self.ignored_xids = frozenset(ignored_xids)
        self.quiet_period = quiet_period
        self.check_interval = check_interval
        self.recovery = recovery
        self.clock = clock
        self._problems: dict[tuple[int, str, str, frozenset[str] | None], Problem] = {}
        self._lock = threading.Lock()
        self._subscribers: list[queue.Queue[list[DeviceHealth]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = clock()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            watch_health(
                self.nvml,
                self._stop,
                check_interval=self.check_interval,
                on_event=self._on_event,
                on_check=self._on_check,
            )
        except NvmlError as exc:
            log.warning(
                "NVML cannot watch health events; devices marked unmonitored", error=str(exc)
            )
            now = self.clock()
            for gpu in {d.gpu_index for d in self.inventory().devices}:
                self._add(Problem(KEY_UNMONITORED, "", "None", now, gpu, last=now))
            self._changed()

    def _on_event(self, event: HealthEvent) -> None:
        if self.handle(event):
            self._changed()

    def _on_check(self) -> None:
        if self.check_recovery():
            self._changed()

    # ---- events ----------------------------------------------------------------------------
    def _add(self, problem: Problem) -> bool:
        key = (problem.gpu, problem.key, problem.value, problem.devices)
        with self._lock:
            old = self._problems.get(key)
            self._problems[key] = problem if old is None else replace(old, last=problem.last)
            return old is None

    def _mig_devices(self, gpu: int, gpu_instance_id: int) -> frozenset[str]:
        static = {
            d.name
            for d in self.inventory().on_gpu(gpu)
            if d.mig is not None and d.mig.gpu_instance_id == gpu_instance_id
        }
        if static:
            return frozenset(static)
        with contextlib.suppress(NvmlError):  # dynamic MIG: name the placement of the instance
            for gi in self.nvml.gpu_instances(gpu):
                if gi.id == gpu_instance_id:
                    name = f"gpu-{gpu}-mig-{dns_label(gi.profile_name)}-{gi.placement.start}"
                    return frozenset({name})
        return frozenset({f"gpu-{gpu}-mig-gi{gpu_instance_id}"})

    def handle(self, event: HealthEvent) -> bool:
        """Record one event; True when the taints changed."""
        self.metrics.health_events.labels(kind=event.kind.value).inc()
        now = event.timestamp or self.clock()
        devices = None
        if event.gpu_instance_id is not None:
            devices = self._mig_devices(event.gpu_index, event.gpu_instance_id)
        if event.kind is HealthEventKind.XID and event.xid is not None:
            effect = "None" if event.xid in self.ignored_xids else "NoSchedule"
            problem = Problem(KEY_XID, str(event.xid), effect, now, event.gpu_index, devices, now)
        elif event.kind is HealthEventKind.GPU_LOST:
            problem = Problem(KEY_LOST, "", "NoSchedule", now, event.gpu_index, None, now)
        elif event.kind is HealthEventKind.ECC_DOUBLE_BIT:
            problem = Problem(
                KEY_ECC, "double-bit", "NoSchedule", now, event.gpu_index, devices, now
            )
        else:
            return False
        log.warning(
            "device health event",
            gpu=event.gpu_index,
            kind=event.kind.value,
            xid=event.xid,
            gpu_instance=event.gpu_instance_id,
            effect=problem.effect,
            devices=sorted(devices) if devices else "all devices of the GPU",
        )
        return self._add(problem)

    def check_recovery(self) -> bool:
        """Clear what has recovered; True when the taints changed."""
        if not self.recovery:
            return False
        with self._lock:
            problems = dict(self._problems)
        faults = [
            (key, p.gpu, p.last, p.key == KEY_LOST)
            for key, p in problems.items()
            if p.key != KEY_UNMONITORED
        ]
        cleared = recovered(faults, self.nvml, now=self.clock(), quiet_period=self.quiet_period)
        for key in cleared:
            p = problems[key]
            log.info("device recovered; taint cleared", gpu=p.gpu, taint=p.describe())
        with self._lock:
            for key in cleared:
                self._problems.pop(key, None)
        return bool(cleared)

    # ---- views -----------------------------------------------------------------------------
    def _applying(self, device: Device) -> list[Problem]:
        with self._lock:
            found = [p for p in self._problems.values() if p.applies(device)]
        return sorted(found, key=lambda p: p.since)[-MAX_TAINTS:]

    def taints(self, device: Device) -> list[dict[str, Any]]:
        return [p.taint() for p in self._applying(device)]

    def health(self) -> list[DeviceHealth]:
        out = []
        for device in self.inventory().devices:
            problems = self._applying(device)
            bad = [p for p in problems if p.effect == "NoSchedule"]
            updated = max([self._since, *(p.last for p in problems)])
            message = "; ".join(p.describe() for p in problems) or "healthy"
            out.append(DeviceHealth(device.name, not bad, message[:1024], updated))
        return out

    def _changed(self) -> None:
        inventory = self.inventory()
        effects = [p.effect for d in inventory.devices for p in self._applying(d)]
        self.metrics.observe_taints(effects)
        snapshot = self.health()
        with self._lock:
            subscribers = list(self._subscribers)
        for q in subscribers:
            q.put(snapshot)
        self.on_change()

    def subscribe(self) -> queue.Queue[list[DeviceHealth]]:
        """A queue that gets the health of every device now and after every change."""
        q: queue.Queue[list[DeviceHealth]] = queue.Queue()
        q.put(self.health())
        with self._lock:
            self._subscribers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[list[DeviceHealth]]) -> None:
        with self._lock:
            if q in self._subscribers:
                self._subscribers.remove(q)
