"""Sockets, registration with the kubelet, kubelet restarts, graceful stop.

One gRPC server per resource on ``<device-plugins-dir>/gpuslice-<resource>.sock``. Each serves
before it calls ``Register`` on ``kubelet.sock`` (the kubelet dials back inside that call). A
watcher polls ``kubelet.sock`` every 100 ms: when it is re-created (inode or change time
differ: the kubelet restarted and removed every socket in the directory) every server is
started again on a fresh socket and registered again — well within a second. A socket of
ours that vanished is served and registered again too. A Register that fails is retried with
backoff up to 5 s. Stop ends the ListAndWatch streams and removes only our own sockets (an
inode check keeps a successor's socket in place). Streams (ListAndWatch, Health/Watch) are
capped per server and have threads of their own, so held streams never starve Allocate
(``UnixGrpcServer``'s per-method stream budget).

A new configuration (:meth:`PluginManager.update`, the live reload) restarts and registers
again only the resources whose device list changed, starts new ones and stops the ones that
are gone; a resource whose devices stay gets the new settings in place, without a restart.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.allocate import Topology
from gpuslice_device_plugin.config import Settings
from gpuslice_device_plugin.devices import Resource
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.mps import ReplicaShare
from gpuslice_device_plugin.servicer import OPTIONS, DevicePluginServicer
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

log = get_logger(__name__)

KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"
SERVICE = "v1beta1.DevicePlugin"
WATCH_INTERVAL = 0.1
RETRY_MAX = 5.0
STREAM_CAP = 4
"""Open streams per method and server (ListAndWatch, Health/Watch); the kubelet needs one."""
UNARY_WORKERS = 8
"""Threads left for unary calls (Allocate, GetPreferredAllocation, ...) when every stream is
open."""
STREAMING_METHODS = 2  # v1beta1.DevicePlugin/ListAndWatch, grpc.health.v1.Health/Watch


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Inode and change time: a re-created socket may get the old inode number back."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


@dataclass
class Endpoint:
    resource: Resource
    servicer: DevicePluginServicer
    server: UnixGrpcServer | None = None
    registered: bool = False
    next_try: float = 0.0
    delay: float = 0.2


@dataclass
class PluginManager:
    directory: Path
    resources: list[Resource]
    settings: Settings
    health: HealthTracker
    topology: Topology
    metrics: Metrics
    shared_policy: str = "distributed"
    shares: dict[str, ReplicaShare] = field(default_factory=dict)
    #: GPU/MIG UUID → the CDI ids Allocate names for it (None: the toolkit's names).
    cdi_ids: dict[str, list[str]] | None = None
    register_timeout: float = 10.0
    endpoints: list[Endpoint] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _kubelet_id: tuple[int, int, int] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def kubelet_socket(self) -> Path:
        return self.directory / KUBELET_SOCKET

    def socket(self, resource: Resource) -> Path:
        return self.directory / resource.socket_name

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for resource in self.resources:
            self.endpoints.append(Endpoint(resource, self._servicer(resource)))
        with self._lock:
            self._kubelet_id = _identity(self.kubelet_socket)
            for ep in self.endpoints:
                self._serve(ep)
            self._register_due()
        self._thread = threading.Thread(target=self._watch, name="kubelet-watch", daemon=True)
        self._thread.start()

    def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for ep in self.endpoints:
                self._stop_server(ep, grace)

    def _servicer(self, resource: Resource) -> DevicePluginServicer:
        """A fresh servicer: each (re)start of a resource's server gets one, so the streams of
        the previous one end with it."""
        return DevicePluginServicer(
            resource,
            self.settings,
            self.health,
            self.topology,
            self.metrics,
            shared_policy=self.shared_policy,
            shares=self.shares,
            cdi_ids=self.cdi_ids,
        )

    def _serve(self, ep: Endpoint) -> None:
        """(Re)start the resource's server on a fresh socket; it must serve before Register."""
        self._stop_server(ep, grace=0.5)
        servicer = self._servicer(ep.resource)
        server = UnixGrpcServer(
            [self.socket(ep.resource)],
            name=f"dp-{ep.resource.socket_name}",
            max_workers=UNARY_WORKERS,
            max_streams=STREAM_CAP,
            stream_methods=STREAMING_METHODS,
        )
        server.add(pb_grpc.add_DevicePluginServicer_to_server, servicer, SERVICE)
        server.start()
        ep.servicer, ep.server = servicer, server
        ep.registered, ep.next_try, ep.delay = False, 0.0, 0.2

    @staticmethod
    def _stop_server(ep: Endpoint, grace: float) -> None:
        ep.servicer.stop()
        if ep.server is not None:
            ep.server.stop(grace)
            ep.server = None

    def update(
        self,
        resources: list[Resource],
        settings: Settings,
        shares: dict[str, ReplicaShare],
        cdi_ids: dict[str, list[str]] | None,
    ) -> list[str]:
        """Switch to a new configuration; returns the resources that were (re)started or
        stopped. Unchanged resources keep serving (their servicer takes the new settings)."""
        changed: list[str] = []
        with self._lock:
            self.settings, self.shares, self.cdi_ids = settings, shares, cdi_ids
            wanted = {r.name: r for r in resources}
            for gone in [ep for ep in self.endpoints if ep.resource.name not in wanted]:
                log.info("resource no longer offered; stopping it", resource=gone.resource.name)
                self._stop_server(gone, grace=2.0)
                self.endpoints.remove(gone)
                changed.append(gone.resource.name)
            have = {ep.resource.name: ep for ep in self.endpoints}
            for resource in resources:
                found = have.get(resource.name)
                if found is not None and found.resource == resource:
                    found.servicer.settings, found.servicer.shares = settings, shares
                    found.servicer.cdi_ids = cdi_ids
                    continue
                ep = found or Endpoint(resource, self._servicer(resource))
                if found is None:
                    self.endpoints.append(ep)
                ep.resource = resource
                self._serve(ep)  # a fresh socket; the kubelet sees the new devices at Register
                changed.append(resource.name)
            self.resources = list(resources)
            self._register_due()
        return changed

    # ---- registration ----------------------------------------------------------------------
    def register(self, ep: Endpoint) -> None:
        """One ``Register`` call; raises ``grpc.RpcError`` when the kubelet refuses or is gone."""
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=ep.resource.socket_name,
            resource_name=ep.resource.name,
            options=OPTIONS,
        )
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            pb_grpc.RegistrationStub(channel).Register(request, timeout=self.register_timeout)

    def _register_due(self) -> None:  # called with the lock held
        now = time.monotonic()
        for ep in self.endpoints:
            if ep.registered or now < ep.next_try or self._kubelet_id is None:
                continue
            try:
                self.register(ep)
            except grpc.RpcError as exc:
                self.metrics.register.labels(result="error").inc()
                ep.next_try = time.monotonic() + ep.delay
                ep.delay = min(ep.delay * 2, RETRY_MAX)
                log.warning(
                    "Register with the kubelet failed; retrying",
                    resource=ep.resource.name,
                    error=str(exc.details() if hasattr(exc, "details") else exc),
                    retry_in=round(ep.next_try - time.monotonic(), 2),
                )
                continue
            self.metrics.register.labels(result="success").inc()
            ep.registered = True
            log.info(
                "registered with the kubelet",
                resource=ep.resource.name,
                endpoint=ep.resource.socket_name,
                devices=len(ep.resource.devices),
            )

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            current = _identity(self.kubelet_socket)
            with self._lock:
                if self._stop.is_set():
                    return
                if current != self._kubelet_id:
                    self._kubelet_id = current
                    if current is None:
                        log.info("kubelet.sock is gone; waiting for the kubelet")
                        for ep in self.endpoints:
                            ep.registered = False
                        continue
                    log.info("kubelet.sock re-created (kubelet restart); registering again")
                    for ep in self.endpoints:
                        self._serve(ep)
                for ep in self.endpoints:
                    if ep.server is not None and not self.socket(ep.resource).exists():
                        log.warning(
                            "our socket was removed; serving again", resource=ep.resource.name
                        )
                        self._serve(ep)
                self._register_due()

    @property
    def thread(self) -> threading.Thread | None:
        """The kubelet watch once started (a liveness check asks whether it still runs)."""
        return self._thread

    def all_registered(self) -> bool:
        with self._lock:
            return all(ep.registered for ep in self.endpoints)
