"""Assembly of the enforcer, and its start and stop order.

``EnforcerApp(settings, nvml)`` builds every part or raises — nothing is half-built after the
constructor: the metrics, the cgroup view, the violation bus, the MPS manager, the shares (on
the checkpoint store), the watchdog, the MPS supervisor, the servicers and the two sockets
(``server``). ``start`` and ``stop`` only start and stop them.

Start: load the checkpoint (a corrupt one stops start-up), adopt or restart MPS daemons, thaw
any cgroup a killed predecessor left frozen, start the watchdog and the MPS supervisor, then
serve: the attach socket first, then the gRPC socket, so a hook that sees the gRPC socket finds
the attach socket too; the metrics endpoint last. Stop: stop serving (in-flight calls finish),
stop the watchdog (which thaws everything it froze), and leave MPS daemons running unless
configured otherwise — an enforcer restart never interrupts a workload.

``run(settings)`` is the process: NVML opened, the app built and started, SIGTERM/SIGINT
awaited, the app stopped. Exit status 1 when start-up fails (cli.py: 2 for a bad flag).
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry

from gpuslice_core.errors import GpusliceError
from gpuslice_core.grpcserver import StopSignals
from gpuslice_core.health import GrpcServing, HealthServer, threads_alive
from gpuslice_core.logging import get_logger
from gpuslice_core.metrics import serve
from gpuslice_enforcer.cgroups import CgroupView
from gpuslice_enforcer.cli import Settings, configure_logs
from gpuslice_enforcer.metrics import EnforcerMetrics
from gpuslice_enforcer.mps import MpsManager
from gpuslice_enforcer.server import AttachSocketServer, attach_socket_for, grpc_server
from gpuslice_enforcer.servicer import ContainersServicer, EnforcerServicer
from gpuslice_enforcer.shares import ShareManager
from gpuslice_enforcer.state import DaemonRecord, open_store
from gpuslice_enforcer.supervisor import MpsSupervisor
from gpuslice_enforcer.violations import ViolationBus
from gpuslice_enforcer.watchdog import Watchdog
from gpuslice_nvml import Nvml, open_nvml

log = get_logger(__name__)


class EnforcerApp:
    """The whole enforcer of one node, built and ready to start."""

    def __init__(
        self,
        settings: Settings,
        nvml: Nvml,
        *,
        registry: CollectorRegistry | None = None,
        cgroups: CgroupView | None = None,
        boot_id: str | None = None,
    ) -> None:
        config = settings.enforcement
        self.settings = settings
        self.nvml = nvml
        self.metrics = EnforcerMetrics(registry)
        self.cgroups = cgroups or CgroupView()
        self.bus = ViolationBus()
        self.mps = MpsManager(config)
        # The shares and the watchdog call each other: a released share is forgotten by the
        # watchdog, which samples the shares. The callback runs only once both are started.
        self.shares = ShareManager(
            nvml,
            config,
            open_store(config.state_dir, boot_id),
            self.cgroups,
            self.mps,
            on_release=lambda share: self.watchdog.forget(share.claim_uid),
            on_mps_restart=self._mps_restarted,
        )
        self.watchdog = Watchdog(
            nvml, config, self.cgroups, self.shares.snapshot, self.bus, self.metrics
        )
        self.supervisor = MpsSupervisor(self.shares)
        containers = ContainersServicer(self.shares, self.metrics)
        self.server = grpc_server(
            config.socket,
            EnforcerServicer(self.shares, self.watchdog, self.bus, self.metrics),
            containers,
        )
        # The hook's fast entry to the same servicer; it starts first and stops last, so a hook
        # that sees the gRPC socket finds this one too.
        self.attach_socket = AttachSocketServer(attach_socket_for(config.socket), containers)
        self._metrics_server: WSGIServer | None = None
        self._health_server: HealthServer | None = None
        self._serving = GrpcServing(config.socket)
        self._threads = threads_alive(lambda: [self.watchdog.thread])
        self._started = False
        self._stopping = False

    # ---- probes ----------------------------------------------------------------------------
    def live(self) -> list[str]:
        """``/healthz``: the gRPC socket answers its health check and the watchdog samples."""
        if not self._started or self._stopping:
            return []
        return self._serving() + self._threads()

    def ready(self) -> list[str]:
        """``/readyz``: the gRPC socket's health service is SERVING (what the chart's exec
        probe asked with ``check_health`` before)."""
        if self._stopping:
            return ["stopping"]
        if not self._started:
            return ["starting"]
        return self._serving()

    @property
    def health_port(self) -> int | None:
        return self._health_server.port if self._health_server else None

    def _mps_restarted(self, daemon: DaemonRecord) -> None:
        self.metrics.mps_restarts.labels(gpu=str(daemon.gpu_index), UUID=daemon.gpu_uuid).inc()

    def start(self) -> None:
        if self.settings.health_addr:  # first: the start-up probe answers 503, not refused
            self._health_server = HealthServer(
                self.settings.health_addr, live=self.live, ready=self.ready
            ).start()
        self.shares.start()
        _, shares = self.shares.snapshot()
        for share in shares:
            self.watchdog.thaw_share(share)
        self.watchdog.start()
        self.supervisor.start()
        self.attach_socket.start()
        self.server.start()
        self._started = True
        log.info(
            "enforcer started",
            socket=str(self.settings.enforcement.socket),
            shares=len(shares),
            nvml=self.nvml.backend,
        )
        if self.settings.metrics_addr:
            self._metrics_server = serve(self.settings.metrics_addr, self.metrics.registry)

    def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        self.server.stop(grace)
        self.attach_socket.stop()
        self.supervisor.stop()
        self.watchdog.stop()
        if not self.settings.enforcement.keep_mps_on_exit:
            self.shares.stop_daemons()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self._serving.close()
        if self._health_server is not None:  # last: /readyz said "stopping" until now
            self._health_server.stop()
        log.info("enforcer stopped")


def run(settings: Settings) -> int:
    """The process: build, start, serve until SIGTERM/SIGINT, stop. 1 when start-up fails."""
    configure_logs(settings.log_level, settings.node_name, settings.log_format)
    signals = StopSignals()  # before anything serves (gpuslice_core.grpcserver)
    try:
        nvml = open_nvml(settings.nvml, settings.fake_nvml_config, settings.driver_root)
        app = EnforcerApp(settings, nvml)
        app.start()
    except GpusliceError as exc:
        log.error("start-up failed", error=str(exc))
        return 1
    received = signals.wait()
    log.info("stopping", signal=received)
    app.stop()
    nvml.close()
    return 0
