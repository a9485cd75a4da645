"""The enforcer process: shares, watchdog, MPS supervisor and the gRPC socket, started and
stopped in the right order.

Start: load the checkpoint (a corrupt one stops start-up), adopt or restart MPS daemons, thaw
any cgroup a killed predecessor left frozen, start the watchdog and the MPS supervisor, then
serve. Stop: stop serving (in-flight calls finish), stop the watchdog (which thaws everything it
froze), and leave MPS daemons running unless configured otherwise — an enforcer restart never
interrupts a workload.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_core.logging import get_logger
from gpuslice_enforcer.attachsocket import AttachSocketServer, attach_socket_for
from gpuslice_enforcer.cgroups import CgroupView
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.metrics import EnforcerMetrics
from gpuslice_enforcer.mps import MpsManager
from gpuslice_enforcer.servicer import ContainersServicer, EnforcerServicer
from gpuslice_enforcer.shares import ShareManager
from gpuslice_enforcer.state import DaemonRecord, open_store
from gpuslice_enforcer.supervisor import MpsSupervisor
from gpuslice_enforcer.violations import ViolationBus
from gpuslice_enforcer.watchdog import Watchdog
from gpuslice_nvml import Nvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc

log = get_logger(__name__)

#: Threads for unary calls, and for streams (WatchViolations, Health.Watch); a stream past
#: MAX_STREAMS is refused with RESOURCE_EXHAUSTED, so open streams never starve unary calls.
MAX_WORKERS, MAX_STREAMS = 8, 16


class Enforcer:
    def __init__(
        self,
        config: EnforcerConfig,
        nvml: Nvml,
        *,
        registry: CollectorRegistry | None = None,
        cgroups: CgroupView | None = None,
        boot_id: str | None = None,
    ) -> None:
        self.config = config
        self.nvml = nvml
        self.metrics = EnforcerMetrics(registry)
        self.cgroups = cgroups or CgroupView()
        self.bus = ViolationBus()
        self.mps = MpsManager(config)
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
        self.server = UnixGrpcServer(
            [config.socket],
            name="enforcer",
            max_workers=MAX_WORKERS,
            max_streams=MAX_STREAMS,
            socket_mode=0o600,
            dir_mode=0o755,
        )
        self.server.add(
            pb_grpc.add_EnforcerServicer_to_server,
            EnforcerServicer(self.shares, self.watchdog, self.bus, self.metrics),
            "gpuslice.v1.Enforcer",
        )
        containers = ContainersServicer(self.shares, self.metrics)
        self.server.add(
            pb_grpc.add_EnforcerContainersServicer_to_server,
            containers,
            "gpuslice.v1.EnforcerContainers",
        )
        # The hook's fast entry to the same servicer; it starts first and stops last, so a hook
        # that sees the gRPC socket finds this one too.
        self.attach_socket = AttachSocketServer(attach_socket_for(config.socket), containers)
        self.supervisor = MpsSupervisor(self.shares)

    def _mps_restarted(self, daemon: DaemonRecord) -> None:
        self.metrics.mps_restarts.labels(device=daemon.gpu_uuid).inc()

    def start(self) -> None:
        self.shares.start()
        _, shares = self.shares.snapshot()
        for share in shares:
            self.watchdog.thaw_share(share)
        self.watchdog.start()
        self.supervisor.start()
        self.attach_socket.start()
        self.server.start()
        log.info(
            "enforcer started",
            socket=str(self.config.socket),
            shares=len(shares),
            nvml=self.nvml.backend,
        )

    def stop(self, grace: float = 5.0) -> None:
        self.server.stop(grace)
        self.attach_socket.stop()
        self.supervisor.stop()
        self.watchdog.stop()
        if not self.config.keep_mps_on_exit:
            self.shares.stop_daemons()
        log.info("enforcer stopped")
