"""Assembly of the MIG manager, and its start and stop order.

``MigManagerApp(settings, nvml)`` builds every part (checkpoint store, manager, Kubernetes
reporter, reconciler, layout controller and its watches, the gRPC server) or raises; ``start``
and ``stop`` only start and stop them. Order matters: the checkpoint is read and every
interrupted MIG change settled (``recover``) and the GPUs reconciled *before* the socket
opens, so the kubelet plugin never sees a half-made instance. Then the gRPC API, the layout
controller (when a node name is given) and the periodic reconciler run until SIGTERM/SIGINT.
"""

from __future__ import annotations

import sys

from prometheus_client import REGISTRY

from gpuslice_core import logging as gslog
from gpuslice_core import metrics as gsmetrics
from gpuslice_core.errors import GpusliceError
from gpuslice_core.grpcserver import StopSignals
from gpuslice_core.health import GrpcServing, HealthServer, threads_alive
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import RawApi
from gpuslice_kube.reflector import Reflector
from gpuslice_mig_manager import __version__
from gpuslice_mig_manager.cli import Settings
from gpuslice_mig_manager.controller import Backoff, LayoutController
from gpuslice_mig_manager.kube import (
    WARNING,
    KubeNode,
    NodeReporter,
    NullReporter,
    watch_config_map,
    watch_node,
)
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.metrics import Metrics
from gpuslice_mig_manager.reconcile import Reconciler, recover
from gpuslice_mig_manager.server import grpc_server
from gpuslice_mig_manager.servicer import MigManagerServicer
from gpuslice_mig_manager.sources import (
    ConfigMapLayouts,
    FileLayouts,
    LayoutSource,
    parse_config_map_ref,
)
from gpuslice_mig_manager.state import open_store
from gpuslice_nvml import Nvml, open_nvml

log = gslog.get_logger(__name__)

CONFIG_MAP_SYNC_TIMEOUT = 30.0


def layout_source(settings: Settings) -> LayoutSource | None:
    """Where layouts come from; a malformed file stops start-up, naming the key."""
    if settings.config_file:
        source = FileLayouts(settings.config_file)
        source.load()
        return source
    if settings.config_map:
        return ConfigMapLayouts(*parse_config_map_ref(settings.config_map))
    return None


class MigManagerApp:
    """The whole MIG manager of one node, built and ready to start."""

    def __init__(self, settings: Settings, nvml: Nvml, source: LayoutSource | None) -> None:
        self.settings = settings
        self.store = open_store(settings.state_dir)
        loaded = self.store.load()  # a corrupt checkpoint stops start-up here
        if loaded.stale_path is not None:
            log.warning("checkpoint from an earlier boot set aside", kept_at=str(loaded.stale_path))
        self.metrics = Metrics(REGISTRY)
        self.manager = MigManager(
            nvml, self.store, dynamic=settings.dynamic_mig, metrics=self.metrics
        )
        self.raw: RawApi | None = None
        self.reporter: NodeReporter = NullReporter()
        if settings.node_name:
            client = new_api_client(
                settings.kubeconfig, user_agent=f"gpuslice-mig-manager/{__version__}"
            )
            self.raw = RawApi(client)
            self.reporter = KubeNode(self.raw, settings.node_name)
        self.source = source
        self.reconciler = Reconciler(self.manager, self.reporter, settings.reconcile_interval)
        self.server = grpc_server(settings.socket, MigManagerServicer(self.manager, source))
        self.controller = LayoutController(
            self.manager,
            source,
            self.reporter,
            backoff=Backoff(settings.retry_initial, settings.retry_max),
        )
        self.reflectors: list[Reflector] = []
        self.health_server: HealthServer | None = None
        self._serving = GrpcServing(settings.socket)
        self._threads = threads_alive(lambda: [self.reconciler.thread])
        self._started = False
        self._stopping = False

    # ---- probes ----------------------------------------------------------------------------
    def live(self) -> list[str]:
        """``/healthz``: the gRPC socket answers its health check and the reconciler runs."""
        if not self._started or self._stopping:
            return []
        return self._serving() + self._threads()

    def ready(self) -> list[str]:
        """``/readyz``: what ``--probe`` checks, the socket's health service is SERVING."""
        if self._stopping:
            return ["stopping"]
        if not self._started:
            return ["starting"]
        return self._serving()

    def start(self) -> None:
        if self.settings.health_addr:  # first: 503 (not refused) while recovering
            self.health_server = HealthServer(
                self.settings.health_addr, live=self.live, ready=self.ready
            ).start()
        if self.settings.metrics_addr:
            metrics = gsmetrics.serve(self.settings.metrics_addr, REGISTRY)
            log.info("metrics served", addr=self.settings.metrics_addr, port=metrics.server_port)
        for line in recover(self.manager):
            self.reporter.event(
                WARNING, "MigRecovered", f"settled an interrupted MIG change: {line}"
            )
        self.reconciler.once()
        self.server.start()
        if self.raw is not None and isinstance(self.reporter, KubeNode):
            if isinstance(self.source, ConfigMapLayouts):
                config_map = watch_config_map(self.raw, self.source)
                config_map.start()
                self.reflectors.append(config_map)
                if not config_map.synced.wait(CONFIG_MAP_SYNC_TIMEOUT):
                    log.warning("layouts ConfigMap not listed yet; layouts follow when it is")
                self.source.on_change = self.controller.on_layouts_changed
            self.controller.start()
            node = watch_node(self.raw, self.reporter, self.controller.on_labels)
            node.start()
            self.reflectors.append(node)
        self.reconciler.start()
        self._started = True
        log.info("ready", socket=str(self.settings.socket))

    def stop(self) -> None:
        self._stopping = True
        for reflector in self.reflectors:
            reflector.stop()
        self.controller.stop()
        self.reconciler.stop()
        self.server.stop()
        self._serving.close()
        if self.health_server is not None:  # last: /readyz said "stopping" until now
            self.health_server.stop()


def _fail(message: str) -> int:
    log.error("start-up failed", error=message)
    print(f"gpuslice-mig-manager: {message}", file=sys.stderr)
    return 2


def run(settings: Settings) -> int:
    """The process: build, start, serve until SIGTERM/SIGINT, stop. 2 when start-up fails."""
    gslog.configure(
        component="mig-manager", level=settings.log_level, log_format=settings.log_format
    )
    signals = StopSignals()
    log.info(
        "starting", version=__version__, node=settings.node_name, dynamic_mig=settings.dynamic_mig
    )
    try:
        source = layout_source(settings)
        nvml = open_nvml(settings.nvml, settings.fake_nvml_config, settings.driver_root)
    except (GpusliceError, ValueError) as exc:
        return _fail(str(exc))
    with nvml:
        try:
            app = MigManagerApp(settings, nvml, source)
        except GpusliceError as exc:
            return _fail(str(exc))
        app.start()
        try:
            signum = signals.wait()
            log.info("stopping", signal=signum)
        finally:
            app.stop()
    return 0
