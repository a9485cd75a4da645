"""The enforcer process: shares, watchdog, MPS supervisor and the gRPC socket, started and
stopped in the right order.

Start: load the checkpoint (a corrupt one stops start-up), adopt or restart MPS daemons, thaw
any cgroup a killed predecessor left frozen, start the watchdog and the MPS supervisor, then
serve. Stop: stop serving (in-flight calls finish), stop the watchdog (which thaws everything it
froze), and leave MPS daemons running unless configured otherwise — an enforcer restart never
interrupts a workload.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry

from gpuslice_core.checkpoint import CheckpointStore
from gpuslice_core.files import make_dirs
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_core.logging import get_logger
from gpuslice_enforcer.attachsocket import AttachSocketServer, Throttled, attach_socket_for
from gpuslice_enforcer.cgroups import CgroupView
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.metrics import EnforcerMetrics
from gpuslice_enforcer.mps import MpsManager
from gpuslice_enforcer.servicer import ContainersServicer, EnforcerServicer
from gpuslice_enforcer.shares import ShareManager
from gpuslice_enforcer.state import CHECKPOINT_KIND, SCHEMA_VERSION, DaemonRecord, EnforcerState
from gpuslice_enforcer.violations import ViolationBus
from gpuslice_enforcer.watchdog import Watchdog
from gpuslice_nvml import Nvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc

log = get_logger(__name__)

SUPERVISE_INTERVAL_S = 1.0
#: How often containers that are gone without a poststop hook are forgotten.
PRUNE_INTERVAL_S = 5.0
#: Threads for unary calls, and for streams (WatchViolations, Health.Watch); a stream past
#: MAX_STREAMS is refused with RESOURCE_EXHAUSTED, so open streams never starve unary calls.
MAX_WORKERS, MAX_STREAMS = 8, 16


def checkpoint_store(state_dir: Path, boot_id: str | None = None) -> CheckpointStore[EnforcerState]:
    """The checkpoint in ``state_dir``: the directory 0700 and its lock file 0600, whatever the
    umask (the checkpoint itself is written 0600)."""
    make_dirs(state_dir, 0o700)
    state_dir.chmod(0o700)  # the enforcer's own, also when an earlier start made it looser
    path = state_dir / "enforcer.json"
    lock = os.open(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.fchmod(lock, 0o600)
    finally:
        os.close(lock)
    return CheckpointStore(
        path,
        kind=CHECKPOINT_KIND,
        model=EnforcerState,
        schema_version=SCHEMA_VERSION,
        boot_id=boot_id,
    )


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
            checkpoint_store(config.state_dir, boot_id),
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
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    def _mps_restarted(self, daemon: DaemonRecord) -> None:
        self.metrics.mps_restarts.labels(device=daemon.gpu_uuid).inc()

    def start(self) -> None:
        self.shares.start()
        _, shares = self.shares.snapshot()
        for share in shares:
            self.watchdog.thaw_share(share)
        self.watchdog.start()
        self._supervisor = threading.Thread(target=self._supervise, name="mps-supervisor")
        self._supervisor.daemon = True
        self._supervisor.start()
        self.attach_socket.start()
        self.server.start()
        log.info(
            "enforcer started",
            socket=str(self.config.socket),
            shares=len(shares),
            nvml=self.nvml.backend,
        )

    def _supervise(self) -> None:
        structlog.contextvars.bind_contextvars(thread="mps-supervisor")
        next_prune = time.monotonic() + PRUNE_INTERVAL_S
        # An OSError here (out of file descriptors, a full disk) recurs every second: one line
        # per 10 s, without a traceback; anything else is a bug and logged in full.
        supervise_failed = Throttled("mps supervision failed")
        prune_failed = Throttled("pruning gone containers failed")
        while not self._stop.wait(SUPERVISE_INTERVAL_S):
            try:
                self.shares.supervise()
            except OSError as exc:
                supervise_failed(error=str(exc))
            except Exception:
                log.exception("mps supervision failed")
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + PRUNE_INTERVAL_S
                try:
                    self.shares.prune()
                except OSError as exc:
                    prune_failed(error=str(exc))
                except Exception:
                    log.exception("pruning gone containers failed")

    def stop(self, grace: float = 5.0) -> None:
        self.server.stop(grace)
        self.attach_socket.stop()
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        self.watchdog.stop()
        if not self.config.keep_mps_on_exit:
            self.shares.stop_daemons()
        log.info("enforcer stopped")
