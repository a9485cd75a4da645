"""The plugin's two unix sockets, its registration with the kubelet, its probe and its stop.

- DRA socket ``<plugins-dir>/gpu.gpuslice.dev/dra.sock`` (``dra-<podUID>.sock`` with
  ``--pod-uid``): ``v1.DRAPlugin``, ``v1beta1.DRAPlugin``, ``v1alpha1.DRAResourceHealth`` when
  health streaming is on, and the standard ``grpc.health.v1.Health``. It starts first: the
  kubelet dials it as soon as it has read the registration.
- Registration socket ``<registrar-dir>/gpu.gpuslice.dev-reg.sock``
  (``gpu.gpuslice.dev-<podUID>-reg.sock``): ``pluginregistration.Registration``. The kubelet
  retries a registration only when the socket is created again, so a failed registration
  (``NotifyRegistrationStatus(false)``) makes the plugin re-create its socket after a backoff.
- ``stop()``: the registration socket goes first (no new kubelet connections), then the DRA
  server stops accepting calls, lets in-flight ones finish within the grace period and removes
  its socket.
- ``probe()``: what a liveness probe runs — GetInfo over the registration socket and an empty
  NodePrepareResources over the DRA socket, end to end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuslice_core.grpcserver import UnixGrpcServer, check_health
from gpuslice_core.logging import get_logger
from gpuslice_kubelet_plugin import servicer as svc
from gpuslice_kubelet_plugin.metrics import PluginMetrics
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as v1
from gpuslice_protos.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2_grpc as hpb_grpc
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2 as reg
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = get_logger(__name__)


@dataclass(frozen=True)
class Sockets:
    registration: Path
    dra: Path

    @classmethod
    def for_driver(
        cls, driver: str, *, registrar_dir: Path, plugins_dir: Path, pod_uid: str = ""
    ) -> Sockets:
        if pod_uid:
            return cls(
                registration=registrar_dir / f"{driver}-{pod_uid}-reg.sock",
                dra=plugins_dir / driver / f"dra-{pod_uid}.sock",
            )
        return cls(
            registration=registrar_dir / f"{driver}-reg.sock",
            dra=plugins_dir / driver / "dra.sock",
        )


class PluginServer:
    def __init__(
        self,
        *,
        driver: str,
        sockets: Sockets,
        claims: svc.Claims,
        metrics: PluginMetrics,
        health: svc.HealthStreamServicer | None = None,
        workers: int = 16,
        retry_initial: float = 1.0,
        retry_max: float = 60.0,
    ) -> None:
        self.driver = driver
        self.sockets = sockets
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.registered = threading.Event()
        self.failures = 0
        self.last_error = ""
        self._stopped = threading.Event()
        self._reg_lock = threading.Lock()
        versions = [svc.V1, svc.V1BETA1] + ([svc.HEALTH] if health else [])
        self.versions = versions
        self.dra = UnixGrpcServer([sockets.dra], name="dra", max_workers=workers)
        self.dra.add(
            v1_grpc.add_DRAPluginServicer_to_server, svc.DraV1Servicer(claims, metrics), svc.V1
        )
        self.dra.add(
            v1beta1_grpc.add_DRAPluginServicer_to_server,
            svc.DraV1beta1Servicer(claims, metrics),
            svc.V1BETA1,
        )
        if health is not None:
            self.dra.add(hpb_grpc.add_DRAResourceHealthServicer_to_server, health, svc.HEALTH)
        self._registration = svc.RegistrationServicer(
            driver=driver,
            endpoint=str(sockets.dra),
            versions=versions,
            on_status=self._on_status,
        )
        self.reg: UnixGrpcServer | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.dra.start()
        self._start_registration()
        log.info(
            "serving the kubelet",
            driver=self.driver,
            registration=str(self.sockets.registration),
            dra=str(self.sockets.dra),
            versions=self.versions,
        )

    def _start_registration(self) -> None:
        with self._reg_lock:
            if self._stopped.is_set():
                return
            server = UnixGrpcServer([self.sockets.registration], name="registration", max_workers=2)
            server.add(
                reg_grpc.add_RegistrationServicer_to_server,
                self._registration,
                "pluginregistration.Registration",
            )
            server.start()
            self.reg = server

    def _on_status(self, registered: bool, error: str) -> None:
        if registered:
            self.failures = 0
            self.registered.set()
            log.info("registered with the kubelet", driver=self.driver)
            return
        self.registered.clear()
        self.failures += 1
        self.last_error = error
        delay = min(self.retry_initial * 2 ** (self.failures - 1), self.retry_max)
        log.error(
            "the kubelet refused the registration; registering again",
            error=error,
            attempt=self.failures,
            retry_in_s=delay,
        )
        timer = threading.Timer(delay, self._reregister)
        timer.daemon = True
        timer.start()

    def _reregister(self) -> None:
        """A new socket (new inode) is what makes the kubelet's plugin watcher try again."""
        with self._reg_lock:
            old, self.reg = self.reg, None
        if old is not None:
            old.stop(grace=1.0)
        self._start_registration()

    def stop(self, grace: float = 10.0) -> None:
        self._stopped.set()
        with self._reg_lock:
            reg_server, self.reg = self.reg, None
        if reg_server is not None:
            reg_server.stop(grace=1.0)
        self.dra.stop(grace=grace)
        log.info("stopped serving the kubelet", driver=self.driver)


def probe(sockets: Sockets, *, timeout: float = 5.0) -> list[str]:
    """Problems found over both sockets, end to end; empty when all is well."""
    problems = []
    with grpc.insecure_channel(f"unix://{sockets.registration}") as channel:
        try:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=timeout)
            if info.endpoint != str(sockets.dra):
                problems.append(f"registration names endpoint {info.endpoint}, not {sockets.dra}")
        except grpc.RpcError as exc:
            problems.append(f"GetInfo on {sockets.registration}: {exc.code().name} {exc.details()}")
    with grpc.insecure_channel(f"unix://{sockets.dra}") as channel:
        try:
            v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                v1.NodePrepareResourcesRequest(), timeout=timeout
            )
        except grpc.RpcError as exc:
            problems.append(
                f"NodePrepareResources on {sockets.dra}: {exc.code().name} {exc.details()}"
            )
    if not problems and not check_health(sockets.dra, timeout=timeout):
        problems.append(f"grpc.health.v1 on {sockets.dra} is not SERVING")
    return problems
