"""The plugin assembled: discovery, state, health, garbage collection, and the helper
(``gpuslice_draplugin``) that serves the kubelet and publishes the slices.

``Driver(settings, nvml, raw)`` builds every part or raises — nothing is half-built after the
constructor: detect the API (the helper) → check the node's mode → take the instance lock →
load the checkpoint (a previous boot's file is set aside) → discover the GPUs. ``start()``
recovers what a crash left, then serves the kubelet and publishes the slices (the helper),
watches health and collects garbage. Stop order is the reverse of what matters: the sockets
first (in-flight calls finish), then the background loops. Slices are left in place: the
kubelet deletes them 30 s after the driver is gone, and a restarted plugin takes them over.

The driver's side of the DRA calls is ``prepare``/``unprepare`` (the device state), its health
source the health monitor; everything else kubelet-facing is the helper's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from gpuslice_core.cdi import ClaimSpecs
from gpuslice_core.driverroot import DriverRoot
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_core.metrics import serve
from gpuslice_draplugin import ClaimRef, Helper, Sockets
from gpuslice_kube.raw import RawApi
from gpuslice_kubelet_plugin.cdispecs import CdiWriter
from gpuslice_kubelet_plugin.checkpoint import Committer, InstanceLock, open_store
from gpuslice_kubelet_plugin.claims import ClaimError
from gpuslice_kubelet_plugin.discovery import DRIVER, Inventory, discover
from gpuslice_kubelet_plugin.enforcer import Enforcer, GpuEnforcement, GrpcEnforcer, NoEnforcer
from gpuslice_kubelet_plugin.gc import ClaimCollector
from gpuslice_kubelet_plugin.health import HealthMonitor
from gpuslice_kubelet_plugin.metrics import PluginMetrics
from gpuslice_kubelet_plugin.migclient import GrpcMigManager, MigManager, NoMigManager
from gpuslice_kubelet_plugin.nodemode import check_node_mode
from gpuslice_kubelet_plugin.state import DeviceState, Outcome
from gpuslice_nvml import Nvml
from gpuslice_nvml.health import APP_XIDS

log = get_logger(__name__)
#: seconds between capability requests while the enforcer (a sidecar that may start after the
#: plugin) has not answered, instead of the whole --rescan-interval
ENFORCER_RETRY = 1.0


@dataclass(frozen=True)
class Settings:
    node_name: str
    state_dir: Path
    cdi_root: Path = Path("/var/run/cdi")
    registrar_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    metrics_addr: str = ""
    enforcer_socket: Path | None = None
    mig_manager_socket: Path | None = None
    dynamic_mig: bool = False
    pod_uid: str = ""
    health_streaming: bool = True
    health_recovery: bool = True
    xid_quiet_period: float = 300.0
    health_check_interval: float = 10.0
    ignored_xids: frozenset[int] = field(default=APP_XIDS)
    gc_interval: float = 60.0
    rescan_interval: float = 60.0
    driver_root: Path = Path("/")
    nvidia_cdi_kind: str = ""
    shutdown_grace: float = 10.0
    workers: int = 16
    claim_cache: bool = True  # prepare reads claims from a watch-fed cache when it can
    mode_check: bool = True  # refuse a node whose GPUs a device plugin serves
    orphan_grace: float = 30.0  # age before a CDI spec without a record is removed
    boot_id: str | None = None  # tests only

    @property
    def sockets(self) -> Sockets:
        return Sockets.for_driver(
            DRIVER,
            registrar_dir=self.registrar_dir,
            plugins_dir=self.plugins_dir,
            pod_uid=self.pod_uid,
        )


class Driver:
    def __init__(self, settings: Settings, nvml: Nvml, raw: RawApi) -> None:
        s = self.settings = settings
        self.nvml = nvml
        self.raw = raw
        self.metrics = PluginMetrics()
        self.inventory = Inventory()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._metrics_server: WSGIServer | None = None
        self._levels: dict[str, GpuEnforcement] = {}
        self._levels_pending = False
        self._publish_lock = threading.Lock()
        self.enforcer: Enforcer = (
            GrpcEnforcer(s.enforcer_socket) if s.enforcer_socket else NoEnforcer()
        )
        self.mig: MigManager = (
            GrpcMigManager(s.mig_manager_socket) if s.mig_manager_socket else NoMigManager()
        )
        self.health = HealthMonitor(
            nvml,
            lambda: self.inventory,
            self._publish,
            self.metrics,
            ignored_xids=s.ignored_xids,
            quiet_period=s.xid_quiet_period,
            check_interval=s.health_check_interval,
            recovery=s.health_recovery,
        )
        # Detects the resource.k8s.io version; serves and publishes nothing before start().
        self.helper = Helper(
            self,
            driver=DRIVER,
            node=s.node_name,
            raw=raw,
            sockets=s.sockets,
            health=self.health if s.health_streaming else None,
            claim_cache=s.claim_cache,
            metrics=self.metrics.helper,
            workers=s.workers,
        )
        if s.mode_check:
            check_node_mode(raw, s.node_name)
        s.state_dir.mkdir(parents=True, exist_ok=True)
        self.instance = InstanceLock(s.state_dir)
        try:
            store = open_store(s.state_dir, boot_id=s.boot_id)
            loaded = store.load()
            if loaded.stale_path is not None:
                log.warning(
                    "the node rebooted: prepared claims of the previous boot were discarded",
                    kept_at=str(loaded.stale_path),
                )
            self.rescan()
        except BaseException:
            self.instance.release()
            raise
        if s.dynamic_mig and not s.mig_manager_socket:
            log.warning("--dynamic-mig without --mig-manager-socket: MIG claims will fail")
        claims = self.helper.claims
        self.state = DeviceState(
            driver=DRIVER,
            pool=s.node_name,
            committer=Committer(store),
            instance=self.instance,
            inventory=lambda: self.inventory,
            read_claim=claims.read,
            cached_claim=claims.get,
            unprepared=claims.unprepared,
            cdi=CdiWriter(
                ClaimSpecs(s.cdi_root),
                driver=DriverRoot(s.driver_root),
                nvidia_cdi_kind=s.nvidia_cdi_kind,
            ),
            enforcer=self.enforcer,
            mig=self.mig,
            metrics=self.metrics,
            dynamic_mig=s.dynamic_mig,
            workers=s.workers,
            orphan_grace=s.orphan_grace,
        )
        self.collector = ClaimCollector(
            self.state, claims.read, self.metrics, interval=s.gc_interval
        )

    # ---- the DRA calls (gpuslice_draplugin.Plugin) --------------------------------------------
    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, Outcome]:
        return self.state.prepare(list(claims))

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimError | None]:
        return self.state.unprepare(list(claims))

    # ---- devices ---------------------------------------------------------------------------
    def _publish(self) -> None:
        """Hand the pool as it is now (devices, health taints, counter sets) to the helper.
        Rescans and health changes call it from their threads: under the lock, the last pool
        handed over is the one computed last."""
        with self._publish_lock:
            pool = self.inventory.pool(self.health.taints)
            self.helper.publish({self.settings.node_name: pool})

    def _enforcement_levels(self) -> dict[str, GpuEnforcement]:
        if not self.enforcer.present:
            return {}
        try:
            levels = self.enforcer.capabilities()
        except GpusliceError as exc:
            # the sidecar may start after the plugin: ask again soon (see _rescan_loop), or the
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

    def rescan(self) -> bool:
        """Discover again; True (and a republish) when the inventory changed."""
        self._levels = self._enforcement_levels()
        fresh = discover(
            self.nvml,
            dynamic_mig_enabled=self.settings.dynamic_mig,
            enforcement=self._levels,
            previous=self.inventory,
        )
        if fresh == self.inventory:
            return False
        self.inventory = fresh
        log.info("inventory", devices=len(fresh.devices), counter_sets=len(fresh.counter_sets))
        self._publish()
        return True

    def _next_rescan(self) -> float:
        """The rescan interval, or ENFORCER_RETRY while the enforcer has not answered yet."""
        interval = self.settings.rescan_interval
        return min(interval, ENFORCER_RETRY) if self._levels_pending else interval

    def _rescan_loop(self) -> None:
        while not self._stop.wait(self._next_rescan()):
            try:
                self.rescan()
            except Exception:
                log.exception("device rescan failed")

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        self.state.recover()
        if s.metrics_addr:
            self._metrics_server = serve(s.metrics_addr, self.metrics.registry)
            log.info("metrics served", addr=s.metrics_addr, port=self._metrics_server.server_port)
        self._publish()  # an empty pool is published too: the driver is up
        self.helper.start()  # the claim cache, the DRA and registration sockets, the slices
        self.health.start()
        self.collector.start()
        rescan = threading.Thread(target=self._rescan_loop, name="rescan", daemon=True)
        rescan.start()
        self._threads.append(rescan)
        log.info(
            "kubelet plugin started",
            node=s.node_name,
            api=self.helper.api.server.group_version,
            devices=len(self.inventory.devices),
            enforcer=self.enforcer.present,
            dynamic_mig=s.dynamic_mig,
            instance=self.instance.id,
            claim_cache=self.helper.claims.enabled,
        )

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_server.server_port if self._metrics_server else None

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self.helper.stop(grace=self.settings.shutdown_grace)
        self.collector.stop()
        self.health.stop()
        self.state.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        for closer in (self.enforcer, self.mig):
            close = getattr(closer, "close", None)
            if close is not None:
                close()
        self.instance.release()
        log.info("kubelet plugin stopped")
