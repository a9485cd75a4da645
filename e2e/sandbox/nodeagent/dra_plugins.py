"""The kubelet's DRA plugin handler: validated registrations, one gRPC client per endpoint,
and the ResourceSlice wiping that follows a driver's disappearance.

- ``supported_versions`` lists gRPC service names; the first of ``v1.DRAPlugin`` and
  ``v1beta1.DRAPlugin`` in the *plugin's* order is used for every call to that endpoint.
- Several endpoints per driver are allowed (rolling update); the same endpoint twice is an
  error. Calls go to the newest connected endpoint, else the newest one.
- When no endpoint of a driver is connected (deregistered, or its socket stopped answering),
  the driver's ResourceSlices on this node are deleted after ``slice_wipe_delay`` seconds; a
  reconnect or re-registration within that time cancels the wipe. The kubelet learns about
  connections from gRPC's stats handler; here a monitor thread connects to each endpoint's
  socket every ``plugin_poll`` seconds (a socket that accepts = connected), which avoids
  grpc-python's connectivity-polling threads (they fail loudly when a channel is closed).
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from e2e.sandbox.nodeagent.config import MAX_UNIX_SOCKET_PATH, Timings
from e2e.sandbox.nodeagent.registration import RegistrationError
from gpuslice_core.logging import get_logger
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as v1_pb2
from gpuslice_protos.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2 as v1beta1_pb2
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc

if TYPE_CHECKING:
    from e2e.sandbox.nodeagent.health import NodeHealth

log = get_logger(__name__)

V1 = "v1.DRAPlugin"
V1BETA1 = "v1beta1.DRAPlugin"
SUPPORTED = (V1, V1BETA1)
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources returned it."""

    pool_name: str
    device_name: str
    request_names: tuple[str, ...]
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


class DraCallError(Exception):
    """A DRA call failed as a whole (gRPC error, timeout, no such driver)."""


@dataclass
class Endpoint:
    driver: str
    path: str
    version: str
    channel: grpc.Channel
    connected: bool = False
    health_service: str | None = None  # the NodeWatchResources stream being watched

    def stub(self) -> Any:
        if self.version == V1:
            return v1_grpc.DRAPluginStub(self.channel)
        return v1beta1_grpc.DRAPluginStub(self.channel)


def choose_version(versions: list[str]) -> str:
    for version in versions:
        if version in SUPPORTED:
            return version
    if not versions:
        raise RegistrationError("empty list of supported versions")
    raise RegistrationError(
        f"none of the versions supported by the plugin {versions} are supported by kubelet "
        f"({list(SUPPORTED)})"
    )


class DraPlugins:
    """Registered DRA drivers of one node (the ``DRAPlugin`` handler of the plugin watcher)."""

    def __init__(
        self,
        root: Path,
        timings: Timings,
        wipe_slices: Callable[[str], None],
        node: str,
    ) -> None:
        self.root = root.resolve()
        self.timings = timings
        self.wipe_slices = wipe_slices
        self.node = node
        self._endpoints: dict[str, list[Endpoint]] = {}
        self._wipe_timers: dict[str, threading.Timer] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.wiped: list[str] = []  # drivers whose slices were wiped (for tests and logs)
        self.health: NodeHealth | None = None  # set with the ResourceHealthStatus gate on

    # ---- PluginHandler ---------------------------------------------------------------------
    def validate_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        if not name or len(name) > 63 or not _DNS_SUBDOMAIN.fullmatch(name):
            raise RegistrationError(
                f"invalid DRA driver name {name!r}: "
                "must be a DNS subdomain of at most 63 characters"
            )
        choose_version(versions)
        path = Path(endpoint)
        if not endpoint or not path.is_absolute():
            raise RegistrationError(
                f"endpoint {endpoint!r} of DRA driver {name} is not an absolute path"
            )
        if len(endpoint) > MAX_UNIX_SOCKET_PATH:
            raise RegistrationError(f"endpoint {endpoint!r} is too long for a unix socket")
        try:
            Path(endpoint).resolve().relative_to(self.root)
        except ValueError as exc:
            raise RegistrationError(
                f"endpoint {endpoint!r} of DRA driver {name} is not inside the kubelet root dir "
                f"{self.root}"
            ) from exc
        with self._lock:
            if any(e.path == endpoint for e in self._endpoints.get(name, [])):
                raise RegistrationError(
                    f"endpoint {endpoint} already registered for DRA driver {name}"
                )

    def register_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        version = choose_version(versions)
        channel = grpc.insecure_channel(
            f"unix://{endpoint}", options=[("grpc.client_idle_timeout_ms", 2**31 - 1)]
        )
        ep = Endpoint(driver=name, path=endpoint, version=version, channel=channel)
        with self._lock:
            self._endpoints.setdefault(name, []).append(ep)
            self._cancel_wipe(name)
        self._set_connected(ep, _listening(endpoint))
        self._ensure_monitor()
        if self.health is not None:
            ep.health_service = self.health.watch(name, endpoint, channel, versions)

    def deregister_plugin(self, name: str, endpoint: str) -> None:
        with self._lock:
            eps = self._endpoints.get(name, [])
            for ep in [e for e in eps if e.path == endpoint]:
                eps.remove(ep)
                if self.health is not None:
                    self.health.unwatch(endpoint)
                ep.channel.close()
            if not eps:
                self._endpoints.pop(name, None)
            self._maybe_schedule_wipe(name)

    # ---- connectivity and wiping ---------------------------------------------------------------
    def _ensure_monitor(self) -> None:
        with self._lock:
            if self._monitor is None:
                self._monitor = threading.Thread(
                    target=self._monitor_loop, name=f"{self.node}-dra-monitor", daemon=True
                )
                self._monitor.start()

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.timings.plugin_poll):
            with self._lock:
                endpoints = [e for eps in self._endpoints.values() for e in eps]
            for ep in endpoints:
                self._set_connected(ep, _listening(ep.path))

    def _set_connected(self, ep: Endpoint, connected: bool) -> None:
        with self._lock:
            was = ep.connected
            ep.connected = connected
            if ep.connected and not was:
                self._cancel_wipe(ep.driver)
            elif was and not ep.connected:
                log.info(
                    "DRA plugin disconnected", driver=ep.driver, endpoint=ep.path, node=self.node
                )
                self._maybe_schedule_wipe(ep.driver)

    def _maybe_schedule_wipe(self, driver: str) -> None:
        eps = self._endpoints.get(driver, [])
        if any(e.connected for e in eps) or driver in self._wipe_timers:
            return
        timer = threading.Timer(self.timings.slice_wipe_delay, self._wipe, args=(driver,))
        timer.daemon = True
        self._wipe_timers[driver] = timer
        timer.start()

    def _cancel_wipe(self, driver: str) -> None:
        timer = self._wipe_timers.pop(driver, None)
        if timer is not None:
            timer.cancel()

    def _wipe(self, driver: str) -> None:
        with self._lock:
            if self._wipe_timers.pop(driver, None) is None:
                return
            if any(e.connected for e in self._endpoints.get(driver, [])):
                return
        log.info(
            "DRA driver has no live endpoint; deleting its ResourceSlices",
            driver=driver,
            node=self.node,
        )
        try:
            self.wipe_slices(driver)
            self.wiped.append(driver)
        except Exception as exc:
            log.warning("ResourceSlice wipe failed", driver=driver, error=str(exc))

    # ---- calls ---------------------------------------------------------------------------------
    def registered(self, driver: str) -> bool:
        with self._lock:
            return bool(self._endpoints.get(driver))

    def drivers(self) -> list[str]:
        with self._lock:
            return sorted(self._endpoints)

    def endpoint(self, driver: str) -> Endpoint:
        with self._lock:
            eps = self._endpoints.get(driver) or []
            if not eps:
                raise DraCallError(f"DRA driver {driver} is not registered")
            connected = [e for e in eps if e.connected]
            return (connected or eps)[-1]

    def prepare(self, driver: str, claims: list[ClaimRef]) -> dict[str, list[PreparedDevice] | str]:
        """NodePrepareResources: claim UID → devices, or the per-claim error text."""
        ep = self.endpoint(driver)
        pb = v1_pb2 if ep.version == V1 else v1beta1_pb2
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        try:
            response = ep.stub().NodePrepareResources(
                request, timeout=self.timings.dra_call_timeout
            )
        except grpc.RpcError as exc:
            raise DraCallError(f"NodePrepareResources: {_rpc_text(exc)}") from exc
        out: dict[str, list[PreparedDevice] | str] = {}
        for uid, result in response.claims.items():
            if result.error:
                out[uid] = result.error
                continue
            out[uid] = [
                PreparedDevice(
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    request_names=tuple(d.request_names),
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=(d.share_id if ep.version == V1 and d.HasField("share_id") else None),
                )
                for d in result.devices
            ]
        return out

    def unprepare(self, driver: str, claims: list[ClaimRef]) -> dict[str, str]:
        """NodeUnprepareResources: claim UID → error text ('' on success)."""
        ep = self.endpoint(driver)
        pb = v1_pb2 if ep.version == V1 else v1beta1_pb2
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        try:
            response = ep.stub().NodeUnprepareResources(
                request, timeout=self.timings.dra_call_timeout
            )
        except grpc.RpcError as exc:
            raise DraCallError(f"NodeUnprepareResources: {_rpc_text(exc)}") from exc
        return {uid: result.error for uid, result in response.claims.items()}

    def stop(self) -> None:
        self._stop.set()
        if self.health is not None:
            self.health.stop()
        with self._lock:
            for timer in self._wipe_timers.values():
                timer.cancel()
            self._wipe_timers.clear()
            for eps in self._endpoints.values():
                for ep in eps:
                    ep.channel.close()
            self._endpoints.clear()
            monitor = self._monitor
        if monitor is not None:
            monitor.join(timeout=5)


def _listening(path: str) -> bool:
    """True when something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _rpc_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    return f"rpc error: code = {name} desc = {details}"
