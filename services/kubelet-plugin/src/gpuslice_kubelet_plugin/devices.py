"""This node's devices as they are now: discovery with the enforcer's capabilities, and the
periodic rescan that finds MIG layout changes and an enforcer that answers late.

``Devices(nvml, enforcer, …)`` discovers once when built (no publication yet); ``rescan()``
discovers again and calls ``on_change`` when the inventory changed; ``start()`` runs the rescan
every ``interval`` seconds (every ``ENFORCER_RETRY`` while the enforcer has not answered) until
``stop()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kubelet_plugin.discovery import Inventory, discover
from gpuslice_kubelet_plugin.enforcer import Enforcer, GpuEnforcement
from gpuslice_nvml import Nvml

log = get_logger(__name__)
#: seconds between capability requests while the enforcer (a sidecar that may start after the
#: plugin) has not answered, instead of the whole --rescan-interval
ENFORCER_RETRY = 1.0


class Devices:
    def __init__(
        self,
        nvml: Nvml,
        enforcer: Enforcer,
        on_change: Callable[[], None],
        *,
        dynamic_mig: bool = False,
        interval: float = 60.0,
    ) -> None:
        self.nvml = nvml
        self.enforcer = enforcer
        self.on_change = on_change
        self.dynamic_mig = dynamic_mig
        self.interval = interval
        self.inventory = Inventory()
        self._levels: dict[str, GpuEnforcement] = {}
        self._levels_pending = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rescan", daemon=True)
        self._discover()

    def _enforcement_levels(self) -> dict[str, GpuEnforcement]:
        if not self.enforcer.present:
            return {}
        try:
            levels = self.enforcer.capabilities()
        except GpusliceError as exc:
            # the sidecar may start after the plugin: ask again soon (see _next), or the
            # slices would lack the enforcement attribute for a whole rescan interval
            if not self._levels_pending:
                log.warning("cannot ask the enforcer for its capabilities yet", error=str(exc))
            self._levels_pending = True
            return self._levels
        if self._levels_pending:
            log.info(
                "enforcer capabilities read", levels=sorted({e.level for e in levels.values()})
            )
        self._levels_pending = False
        return levels

    def _discover(self) -> bool:
        """Discover again; True when the inventory changed."""
        self._levels = self._enforcement_levels()
        fresh = discover(
            self.nvml,
            dynamic_mig_enabled=self.dynamic_mig,
            enforcement=self._levels,
            previous=self.inventory,
        )
        if fresh == self.inventory:
            return False
        self.inventory = fresh
        log.info("inventory", devices=len(fresh.devices), counter_sets=len(fresh.counter_sets))
        return True

    def rescan(self) -> bool:
        """Discover again; True (and ``on_change``) when the inventory changed."""
        changed = self._discover()
        if changed:
            self.on_change()
        return changed

    def _next(self) -> float:
        """The rescan interval, or ENFORCER_RETRY while the enforcer has not answered yet."""
        return min(self.interval, ENFORCER_RETRY) if self._levels_pending else self.interval

    def _loop(self) -> None:
        while not self._stop.wait(self._next()):
            try:
                self.rescan()
            except Exception:
                log.exception("device rescan failed")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
