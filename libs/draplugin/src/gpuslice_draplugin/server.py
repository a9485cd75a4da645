"""A driver's two unix sockets, its registration with the kubelet, its probe and its stop.

- DRA socket ``<plugins-dir>/<driver>/dra.sock`` (``dra-<podUID>.sock`` with a pod UID, for
  rolling updates): ``v1.DRAPlugin``, ``v1beta1.DRAPlugin`` (each can be switched off),
  ``v1alpha1.DRAResourceHealth`` with a health source, and the standard
  ``grpc.health.v1.Health``. It starts first: the kubelet dials it as soon as it has read the
  registration.
- Registration socket ``<registrar-dir>/<driver>-reg.sock`` (``<driver>-<podUID>-reg.sock``):
  ``pluginregistration.Registration`` (can be switched off). The kubelet retries a registration
  only when the socket is created again, so a failed registration
  (``NotifyRegistrationStatus(false)``) makes the helper re-create its socket after a backoff
  (1 s doubling to 60 s).
- ``stop()``: the registration socket goes first (no new kubelet connections), then the DRA
  server stops accepting calls, lets in-flight ones finish within the grace period and removes
  its socket.
- ``probe()``: what ``--probe`` runs — GetInfo over the registration socket and an empty
  NodePrepareResources over the DRA socket, end to end; ``Prober`` runs the same over channels
  it keeps open, for the plugin's own ``/readyz``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2 as ghealth_pb2
from grpc_health.v1 import health_pb2_grpc as ghealth_grpc

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_core.logging import get_logger
from gpuslice_draplugin import servicer as svc
from gpuslice_draplugin.metrics import HelperMetrics
from gpuslice_draplugin.plugin import Plugin
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


class KubeletServer:
    """The DRA socket and the registration socket, with the registration's retry."""

    def __init__(
        self,
        *,
        driver: str,
        sockets: Sockets,
        plugin: Plugin,
        metrics: HelperMetrics,
        health: svc.HealthStreamServicer | None = None,
        node_v1: bool = True,
        node_v1beta1: bool = True,
        registration: bool = True,
        versions: Sequence[str] | None = None,
        plugin_type: str = "DRAPlugin",
        workers: int = 16,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
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
        self._interceptors = tuple(interceptors)
        served = [svc.V1] if node_v1 else []
        served += [svc.V1BETA1] if node_v1beta1 else []
        served += [svc.HEALTH] if health else []
        self.versions = list(served if versions is None else versions)
        self.dra = UnixGrpcServer(
            [sockets.dra], name="dra", max_workers=workers, interceptors=self._interceptors
        )
        if node_v1:
            self.dra.add(
                v1_grpc.add_DRAPluginServicer_to_server, svc.DraV1Servicer(plugin, metrics), svc.V1
            )
        if node_v1beta1:
            self.dra.add(
                v1beta1_grpc.add_DRAPluginServicer_to_server,
                svc.DraV1beta1Servicer(plugin, metrics),
                svc.V1BETA1,
            )
        if health is not None:
            self.dra.add(hpb_grpc.add_DRAResourceHealthServicer_to_server, health, svc.HEALTH)
        self.registration = registration
        self._registration = svc.RegistrationServicer(
            driver=driver,
            endpoint=str(sockets.dra),
            versions=self.versions,
            on_status=self._on_status,
            plugin_type=plugin_type,
        )
        self.reg: UnixGrpcServer | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.dra.start()
        if self.registration:
            self.start_registration()
        log.info(
            "serving the kubelet",
            driver=self.driver,
            registration=str(self.sockets.registration) if self.registration else None,
            dra=str(self.sockets.dra),
            versions=self.versions,
        )

    def start_registration(self) -> None:
        """Open the registration socket (a new one: the kubelet's plugin watcher registers
        the plugin again)."""
        with self._reg_lock:
            if self._stopped.is_set() or self.reg is not None:
                return
            server = UnixGrpcServer(
                [self.sockets.registration],
                name="registration",
                max_workers=2,
                interceptors=self._interceptors,
            )
            server.add(
                reg_grpc.add_RegistrationServicer_to_server,
                self._registration,
                "pluginregistration.Registration",
            )
            server.start()
            self.reg = server

    def stop_registration(self) -> None:
        """Remove the registration socket (the kubelet deregisters the plugin); the DRA
        socket stays."""
        with self._reg_lock:
            old, self.reg = self.reg, None
        self.registered.clear()
        if old is not None:
            old.stop(grace=1.0)

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
        self.stop_registration()
        self.start_registration()

    def stop(self, grace: float = 10.0) -> None:
        self._stopped.set()
        self.stop_registration()
        self.dra.stop(grace=grace)
        log.info("stopped serving the kubelet", driver=self.driver)


class Prober:
    """The probe's three calls over channels kept open between probes: what a readiness check
    in the plugin's own process runs every few seconds (``gpuslice_core.health``) — one small
    call per socket instead of a new interpreter. A failed probe drops the channels, so the
    next one dials afresh rather than waiting out gRPC's reconnect backoff."""

    def __init__(self, sockets: Sockets, *, timeout: float = 5.0) -> None:
        self.sockets = sockets
        self.timeout = timeout
        self._lock = threading.Lock()
        self._channels: tuple[grpc.Channel, grpc.Channel] | None = None

    def _open(self) -> tuple[grpc.Channel, grpc.Channel]:
        with self._lock:
            if self._channels is None:
                self._channels = (
                    grpc.insecure_channel(f"unix://{self.sockets.registration}"),
                    grpc.insecure_channel(f"unix://{self.sockets.dra}"),
                )
            return self._channels

    def __call__(self) -> list[str]:
        """Problems found over both sockets, end to end; empty when all is well."""
        sockets, timeout = self.sockets, self.timeout
        registration, dra = self._open()
        problems = []
        try:
            info = reg_grpc.RegistrationStub(registration).GetInfo(
                reg.InfoRequest(), timeout=timeout
            )
            if info.endpoint != str(sockets.dra):
                problems.append(f"registration names endpoint {info.endpoint}, not {sockets.dra}")
        except grpc.RpcError as exc:
            problems.append(f"GetInfo on {sockets.registration}: {exc.code().name} {exc.details()}")
        try:
            v1_grpc.DRAPluginStub(dra).NodePrepareResources(
                v1.NodePrepareResourcesRequest(), timeout=timeout
            )
        except grpc.RpcError as exc:
            problems.append(
                f"NodePrepareResources on {sockets.dra}: {exc.code().name} {exc.details()}"
            )
        if not problems:
            try:
                status = ghealth_grpc.HealthStub(dra).Check(
                    ghealth_pb2.HealthCheckRequest(), timeout=timeout
                )
                if status.status != ghealth_pb2.HealthCheckResponse.SERVING:
                    problems.append(f"grpc.health.v1 on {sockets.dra} is not SERVING")
            except grpc.RpcError:
                problems.append(f"grpc.health.v1 on {sockets.dra} is not SERVING")
        if problems:
            self.close()
        return problems

    def close(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, None
        for channel in channels or ():
            channel.close()


def probe(sockets: Sockets, *, timeout: float = 5.0) -> list[str]:
    """Problems found over both sockets, end to end; empty when all is well."""
    prober = Prober(sockets, timeout=timeout)
    try:
        return prober()
    finally:
        prober.close()
