"""Assembly of the kubelet plugin, and its start and stop order.

``KubeletPluginApp(settings, nvml, raw)`` builds every part or raises — nothing is half-built
after the constructor: detect the resource.k8s.io version → check the node's mode → take the
instance lock → load the checkpoint (a previous boot's file is set aside) → discover the GPUs →
the health monitor, the claim cache, the device state, the servicer and the helper
(``gpuslice_draplugin``: the sockets, ``server.py``) that serves it, the garbage collector.
``start()`` recovers what a crash left, then publishes the pool and serves the kubelet (the
helper), watches health, collects garbage and rescans. Stop order is the reverse of what
matters: the sockets first (in-flight calls finish), then the background loops. Slices are
left in place: the kubelet deletes them 30 s after the driver is gone, and a restarted plugin
takes them over.

``run(settings)`` is the process: NVML and the API client opened, the app built and started,
SIGTERM/SIGINT awaited, the app stopped.
"""

from __future__ import annotations

import sys
import threading
from wsgiref.simple_server import WSGIServer

from gpuslice_api.names import DRIVER, NODE_LABEL, node_label_value
from gpuslice_api.nodemode import EXIT_REFUSED
from gpuslice_core import logging as gslog
from gpuslice_core.cdi import ClaimSpecs
from gpuslice_core.driverroot import DriverRoot
from gpuslice_core.errors import GpusliceError
from gpuslice_core.grpcserver import StopSignals
from gpuslice_core.health import GrpcServing, HealthServer
from gpuslice_core.metrics import serve
from gpuslice_draplugin import ClaimCache, Prober, ResourceApi, detect
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import RawApi
from gpuslice_kubelet_plugin import __version__
from gpuslice_kubelet_plugin.cdispecs import CdiWriter
from gpuslice_kubelet_plugin.checkpoint import Committer, InstanceLock, open_store
from gpuslice_kubelet_plugin.cli import PROG, Settings
from gpuslice_kubelet_plugin.coexist import check_coexistence
from gpuslice_kubelet_plugin.devices import Devices
from gpuslice_kubelet_plugin.enforcer import Enforcer, GrpcEnforcer, NoEnforcer
from gpuslice_kubelet_plugin.gc import ClaimCollector
from gpuslice_kubelet_plugin.health import HealthMonitor
from gpuslice_kubelet_plugin.metrics import PluginMetrics
from gpuslice_kubelet_plugin.migclient import GrpcMigManager, MigManager, NoMigManager
from gpuslice_kubelet_plugin.nodemode import NodeRefusedError, check_node_mode
from gpuslice_kubelet_plugin.server import kubelet_server
from gpuslice_kubelet_plugin.servicer import DraServicer
from gpuslice_kubelet_plugin.state import DeviceState
from gpuslice_kubelet_plugin.timeslice import TimeSlicer
from gpuslice_kubelet_plugin.violationevents import ClaimName, ViolationEvents
from gpuslice_nvml import Nvml, open_nvml

log = gslog.get_logger(__name__)


class KubeletPluginApp:
    """The whole kubelet plugin of one node, built and ready to start."""

    def __init__(self, settings: Settings, nvml: Nvml, raw: RawApi) -> None:
        s = self.settings = settings
        self.nvml = nvml
        self.raw = raw
        # device_info is read at scrape time, which comes after the state is built (start())
        self.metrics = PluginMetrics(devices=lambda: self.state.device_rows())
        self._stop = threading.Event()
        self._metrics_server: WSGIServer | None = None
        self._health_server: HealthServer | None = None
        self._started = False
        self._serving = GrpcServing(s.sockets.dra)
        self._prober = Prober(s.sockets, timeout=0.5)
        self._publish_lock = threading.Lock()
        self.enforcer: Enforcer = (
            GrpcEnforcer(s.enforcer_socket) if s.enforcer_socket else NoEnforcer()
        )
        self.mig: MigManager = (
            GrpcMigManager(s.mig_manager_socket) if s.mig_manager_socket else NoMigManager()
        )
        # resource.k8s.io as the API server serves it; nothing is served or published yet
        api = ResourceApi(raw, detect(raw))
        if s.mode_check:
            check_node_mode(raw, s.node_name)
            check_coexistence(raw, s.node_name, nvml, api.server.group_version)
        s.state_dir.mkdir(parents=True, exist_ok=True)
        self.instance = InstanceLock(s.state_dir)
        try:  # the lock is released when any part cannot be built
            store = open_store(s.state_dir, boot_id=s.boot_id)
            loaded = store.load()
            if loaded.stale_path is not None:
                log.warning(
                    "the node rebooted: prepared claims of the previous boot were discarded",
                    kept_at=str(loaded.stale_path),
                )
            self.devices = Devices(
                nvml,
                self.enforcer,
                self._publish,
                dynamic_mig=s.dynamic_mig,
                interval=s.rescan_interval,
            )
            if s.dynamic_mig and not s.mig_manager_socket:
                log.warning("--dynamic-mig without --mig-manager-socket: MIG claims will fail")
            self.health = HealthMonitor(
                nvml,
                lambda: self.devices.inventory,
                self._publish,
                self.metrics,
                ignored_xids=s.ignored_xids,
                quiet_period=s.xid_quiet_period,
                check_interval=s.health_check_interval,
                recovery=s.health_recovery,
            )
            claims = ClaimCache(
                api,
                driver=DRIVER,
                pool=s.node_name,
                label_selector=f"{NODE_LABEL}={node_label_value(s.node_name)}",
            )
            self.state = DeviceState(
                driver=DRIVER,
                pool=s.node_name,
                committer=Committer(store),
                instance=self.instance,
                inventory=lambda: self.devices.inventory,
                read_claim=claims.read,
                cached_claim=claims.get,
                unprepared=claims.unprepared,
                cdi=CdiWriter(
                    ClaimSpecs(s.cdi_root),
                    driver=DriverRoot(s.driver_root, proc=s.proc_root, host=s.driver_root_host),
                    nvidia_cdi_kind=s.nvidia_cdi_kind,
                ),
                enforcer=self.enforcer,
                mig=self.mig,
                time_slicer=TimeSlicer(nvml, self._gpu_index),
                metrics=self.metrics,
                dynamic_mig=s.dynamic_mig,
                workers=s.workers,
                orphan_grace=s.orphan_grace,
            )
            self.helper = kubelet_server(
                DraServicer(self.state),
                node=s.node_name,
                sockets=s.sockets,
                api=api,
                claims=claims,
                claim_cache=s.claim_cache,
                health=self.health if s.health_streaming else None,
                metrics=self.metrics.helper,
                workers=s.workers,
            )
            self.violations: ViolationEvents | None = None
            if isinstance(self.enforcer, GrpcEnforcer):
                self.violations = ViolationEvents(
                    raw, self.enforcer.violations, self._claim_name, node=s.node_name
                )
            self.collector = ClaimCollector(
                self.state, claims.read, self.metrics, interval=s.gc_interval
            )
        except BaseException:
            self.instance.release()
            raise

    def _gpu_index(self, gpu_uuid: str) -> int | None:
        """The NVML index of a GPU of the inventory; None when it is not there."""
        return next((g.index for g in self.devices.inventory.gpus if g.uuid == gpu_uuid), None)

    def _publish(self) -> None:
        """Hand the pool as it is now (devices, health taints, counter sets) to the helper.
        Rescans and health changes call it from their threads: under the lock, the last pool
        handed over is the one computed last."""
        with self._publish_lock:
            pool = self.devices.inventory.pool(self.health.taints)
            self.helper.publish({self.settings.node_name: pool})

    def _claim_name(self, uid: str) -> ClaimName | None:
        """Namespace and name of a claim prepared here (violations of shares with no pod)."""
        for record in self.state.completed():
            if record.uid == uid:
                return ClaimName(record.namespace, record.name)
        return None

    # ---- probes ----------------------------------------------------------------------------
    def live(self) -> list[str]:
        """``/healthz``: the DRA socket's gRPC server answers its own health check (nothing to
        ask while starting or stopping: the start-up probe covers the start)."""
        if not self._started or self._stop.is_set():
            return []
        return self._serving()

    def ready(self) -> list[str]:
        """``/readyz``: the kubelet has registered the plugin (its NotifyRegistrationStatus
        said so), and what ``--probe`` checks — GetInfo over the registration socket, an empty
        NodePrepareResources and grpc.health.v1 over the DRA socket — from this process.

        Until the kubelet has registered it, a pod prepared on the node fails with "DRA driver
        ... is not registered" and the kubelet retries it only after its back-off (77 s seen on
        the real-node tier, after a restart that answered ready 1 s before the registration):
        a plugin that is not registered yet is not ready, so a rolling update waits for it."""
        if self._stop.is_set():
            return ["stopping"]
        if not self._started:
            return ["starting"]
        problems = self._prober()
        if not self.helper.registered:
            problems.append("not registered by the kubelet yet")
        return problems

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if s.health_addr:  # first: the start-up probe answers 503 (not refused) while recovering
            self._health_server = HealthServer(s.health_addr, live=self.live, ready=self.ready)
            self._health_server.start()
        self.state.recover()
        if s.metrics_addr:
            self._metrics_server = serve(s.metrics_addr, self.metrics.registry)
            log.info("metrics served", addr=s.metrics_addr, port=self._metrics_server.server_port)
        self._publish()  # an empty pool is published too: the driver is up
        self.helper.start()  # the claim cache, the DRA and registration sockets, the slices
        self.health.start()
        self.collector.start()
        self.devices.start()
        if self.violations is not None:
            self.violations.start()
        self._started = True
        log.info(
            "kubelet plugin started",
            node=s.node_name,
            api=self.helper.api.server.group_version,
            devices=len(self.devices.inventory.devices),
            enforcer=self.enforcer.present,
            dynamic_mig=s.dynamic_mig,
            instance=self.instance.id,
            claim_cache=self.helper.claims.enabled,
        )

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_server.server_port if self._metrics_server else None

    @property
    def health_port(self) -> int | None:
        return self._health_server.port if self._health_server else None

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self.helper.stop(grace=self.settings.shutdown_grace)
        if self.violations is not None:
            self.violations.stop()
        self.devices.stop()
        self.collector.stop()
        self.health.stop()
        self.state.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.enforcer.close()
        self.mig.close()
        self.instance.release()
        self._prober.close()
        self._serving.close()
        if self._health_server is not None:  # last: /readyz said "stopping" until now
            self._health_server.stop()
        log.info("kubelet plugin stopped")


def run(settings: Settings) -> int:
    """The process: build, start, serve until SIGTERM/SIGINT, stop. 2 when start-up fails,
    3 (``EXIT_REFUSED``) on a node whose GPUs the device plugin serves."""
    gslog.configure(component=PROG, level=settings.log_level, log_format=settings.log_format)
    signals = StopSignals()  # before anything serves (gpuslice_core.grpcserver)
    try:
        nvml = open_nvml(settings.nvml, settings.fake_nvml_config, settings.driver_root)
    except GpusliceError as exc:
        log.error("cannot open NVML", error=str(exc))
        return 2
    try:
        api_client = new_api_client(
            settings.kubeconfig,
            user_agent=f"{PROG}/{__version__}",
            pool_size=settings.workers * 2,  # prepare reads claims from up to --workers threads
        )
        app = KubeletPluginApp(settings, nvml, RawApi(api_client))
        app.start()
    except NodeRefusedError as exc:
        print(f"{PROG}: refusing to start: {exc}", file=sys.stderr)
        nvml.close()
        return EXIT_REFUSED
    except GpusliceError as exc:
        log.error("start-up failed", error=str(exc))
        nvml.close()
        return 2
    signum = signals.wait()
    log.info("stopping", signal=signum)
    app.stop()
    nvml.close()
    return 0
