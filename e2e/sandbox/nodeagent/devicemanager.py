"""The kubelet's device manager: the ``device-plugins/kubelet.sock`` Registration service,
one ListAndWatch stream per resource feeding node capacity (all devices) and allocatable
(healthy ones), and device allocation at pod admission (docs/node-agent.md, "What it
simulates": Device plugins).

- Start: every socket in ``device-plugins/`` is removed (checkpoint and dirs are kept), then
  ``kubelet.sock`` is served. ``Register`` accepts API version ``v1beta1`` and extended
  resource names only; inside the call it dials the plugin's socket and asks
  ``GetDevicePluginOptions`` (so the plugin must already serve); then ListAndWatch runs in the
  background. The newest registration of a resource replaces the previous one.
- A stream that ends marks every device of the resource unhealthy (allocatable 0, capacity kept).
- Allocation happens container by container, init containers first, from ``limits``;
  ``GetPreferredAllocation`` only when the plugin advertises it, its answer intersected with the
  available devices and the shortfall filled; one ``Allocate`` per container and resource; any
  failure rejects the pod (UnexpectedAdmissionError). ``PreStartContainer`` before each start
  when the plugin requires it. Allocations are checkpointed so a restarted agent keeps them.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from pydantic import BaseModel

from e2e.sandbox.nodeagent.config import NodeConfig
from gpuslice_core.checkpoint import CheckpointStore
from gpuslice_core.errors import GpusliceError
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc

log = get_logger(__name__)

VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
PRE_START_TIMEOUT = 30.0
_QUALIFIED = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


class AdmissionError(Exception):
    """Device allocation failed: the pod is rejected with UnexpectedAdmissionError."""


class _RejectedError(GpusliceError):
    """A refused Register call (the kubelet returns a plain error: gRPC Unknown)."""

    grpc_status = "UNKNOWN"


def is_extended_resource_name(name: str) -> bool:
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    return bool(_QUALIFIED.fullmatch(name)) and len(name.split("/", 1)[0]) <= 253


class Allocation(BaseModel):
    device_ids: list[str] = []
    response: dict[str, object] = {}  # ContainerAllocateResponse as JSON (proto field names)


class DeviceState(BaseModel):
    """Schema version 1: pod UID → container → resource → allocation."""

    pods: dict[str, dict[str, dict[str, Allocation]]] = {}


@dataclass(frozen=True)
class DeviceInstance:
    """One device-plugin device as the pod resources API reports it."""

    resource: str
    device_id: str
    numa_nodes: tuple[int, ...] = ()  # empty: the plugin gave no topology


@dataclass
class ResourceEndpoint:
    resource: str
    socket: Path
    channel: grpc.Channel
    options: dp_pb2.DevicePluginOptions
    devices: dict[str, str] = field(default_factory=dict)  # device ID → health
    numa: dict[str, tuple[int, ...]] = field(default_factory=dict)  # device ID → NUMA nodes
    stream: Any = None  # the ListAndWatch call (cancel() ends it)
    replaced: bool = False

    def stub(self) -> dp_grpc.DevicePluginStub:
        return dp_grpc.DevicePluginStub(self.channel)


class _RegistrationServicer(dp_grpc.RegistrationServicer):
    def __init__(self, manager: DeviceManager) -> None:
        self.manager = manager

    def Register(  # noqa: N802 - the gRPC method name
        self, request: dp_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> dp_pb2.Empty:
        self.manager.register(request)
        return dp_pb2.Empty()


class DeviceManager:
    def __init__(self, config: NodeConfig, on_change: Callable[[], None]) -> None:
        self.config = config
        self.dir = config.device_plugins_dir
        self.on_change = on_change
        self.endpoints: dict[str, ResourceEndpoint] = {}
        self._lock = threading.RLock()
        self._server: UnixGrpcServer | None = None
        self._readers: list[threading.Thread] = []  # ListAndWatch readers; stop() joins them
        self.store: CheckpointStore[DeviceState] = CheckpointStore(
            config.device_checkpoint,
            kind="gpuslice-nodeagent-devices",
            model=DeviceState,
            schema_version=1,
        )
        self.state = self.store.load().state

    # ---- server ------------------------------------------------------------------------------
    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for entry in self.dir.iterdir():
            if entry.is_socket():
                entry.unlink(missing_ok=True)
        server = UnixGrpcServer(
            [self.dir / KUBELET_SOCKET], name=f"{self.config.name}-devicemanager"
        )
        server.add(
            dp_grpc.add_RegistrationServicer_to_server,
            _RegistrationServicer(self),
            "v1beta1.Registration",
        )
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0)
        with self._lock:
            for ep in self.endpoints.values():
                ep.replaced = True
                if ep.stream is not None:
                    ep.stream.cancel()
                ep.channel.close()
            readers, self._readers = self._readers, []
        for reader in readers:  # each ends with its cancelled stream, quietly (replaced)
            reader.join(timeout=5)

    def register(self, request: dp_pb2.RegisterRequest) -> None:
        if request.version != VERSION:
            raise _RejectedError(
                f"requested API version {request.version!r} is not supported by kubelet. "
                f"Supported versions are [{VERSION!r}]"
            )
        if not is_extended_resource_name(request.resource_name):
            raise _RejectedError(f"the ResourceName {request.resource_name!r} is invalid")
        socket = self.dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{socket}")
        try:
            grpc.channel_ready_future(channel).result(
                timeout=self.config.timings.device_plugin_dial
            )
            options = dp_grpc.DevicePluginStub(channel).GetDevicePluginOptions(
                dp_pb2.Empty(), timeout=self.config.timings.device_plugin_dial
            )
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            channel.close()
            raise _RejectedError(f"failed to dial device plugin {socket}: {exc!r}") from exc
        ep = ResourceEndpoint(request.resource_name, socket, channel, options)
        with self._lock:
            old = self.endpoints.get(request.resource_name)
            if old is not None:
                old.replaced = True
                if old.stream is not None:
                    old.stream.cancel()
            self.endpoints[request.resource_name] = ep
        log.info(
            "device plugin registered",
            resource=request.resource_name,
            endpoint=str(socket),
            node=self.config.name,
        )
        reader = threading.Thread(
            target=self._list_and_watch,
            args=(ep,),
            name=f"{self.config.name}-law-{request.resource_name}",
            daemon=True,
        )
        with self._lock:
            self._readers = [t for t in self._readers if t.is_alive()] + [reader]
        reader.start()

    def _list_and_watch(self, ep: ResourceEndpoint) -> None:
        stream = ep.stub().ListAndWatch(dp_pb2.Empty())
        ep.stream = stream
        try:
            for response in stream:
                with self._lock:
                    ep.devices = {d.ID: d.health for d in response.devices}
                    ep.numa = {
                        d.ID: tuple(n.ID for n in d.topology.nodes)
                        for d in response.devices
                        if d.HasField("topology")
                    }
                self.on_change()
        except grpc.RpcError as exc:
            if not ep.replaced:
                log.warning("ListAndWatch ended", resource=ep.resource, error=str(exc.code()))
        if ep.replaced:
            return
        with self._lock:
            ep.devices = {d: "Unhealthy" for d in ep.devices}
        log.info("device plugin stream ended; its devices are unhealthy", resource=ep.resource)
        self.on_change()

    # ---- node status -------------------------------------------------------------------------
    def resources(self) -> tuple[dict[str, str], dict[str, str]]:
        with self._lock:
            capacity = {r: str(len(ep.devices)) for r, ep in self.endpoints.items()}
            allocatable = {
                r: str(sum(1 for h in ep.devices.values() if h == HEALTHY))
                for r, ep in self.endpoints.items()
            }
        return capacity, allocatable

    # ---- allocation --------------------------------------------------------------------------
    def _in_use(self, resource: str, pod_uid: str) -> set[str]:
        used: set[str] = set()
        for uid, containers in self.state.pods.items():
            for cname, by_resource in containers.items():
                if uid == pod_uid and cname.startswith("init:"):
                    continue  # devices of the pod's finished init containers are reused
                used.update(by_resource.get(resource, Allocation()).device_ids)
        return used

    def allocate(self, pod: Obj) -> dict[str, list[Obj]]:
        """Allocate for every container of ``pod``; container name → Allocate responses."""
        uid = pod["metadata"]["uid"]
        spec = pod.get("spec") or {}
        ordered = [("init:", c) for c in spec.get("initContainers") or []]
        ordered += [("", c) for c in spec.get("containers") or []]
        out: dict[str, list[Obj]] = {}
        with self._lock:
            for prefix, container in ordered:
                key = prefix + container["name"]
                limits = (container.get("resources") or {}).get("limits") or {}
                for resource, quantity in sorted(limits.items()):
                    ep = self.endpoints.get(resource)
                    if ep is None:
                        continue
                    pod_alloc = self.state.pods.setdefault(uid, {}).setdefault(key, {})
                    if resource not in pod_alloc:
                        pod_alloc[resource] = self._allocate_one(ep, uid, int(str(quantity)))
                        self.store.save(self.state)
                    out.setdefault(container["name"], []).append(pod_alloc[resource].response)
        return out

    def _allocate_one(self, ep: ResourceEndpoint, pod_uid: str, need: int) -> Allocation:
        healthy = sorted(d for d, h in ep.devices.items() if h == HEALTHY)
        in_use = self._in_use(ep.resource, pod_uid)
        available = [d for d in healthy if d not in in_use]
        if len(available) < need:
            raise AdmissionError(
                f"requested number of devices unavailable for {ep.resource}. "
                f"Requested: {need}, Available: {len(available)}"
            )
        chosen: list[str] = []
        try:
            if ep.options.get_preferred_allocation_available:
                preferred = ep.stub().GetPreferredAllocation(
                    dp_pb2.PreferredAllocationRequest(
                        container_requests=[
                            dp_pb2.ContainerPreferredAllocationRequest(
                                available_deviceIDs=available, allocation_size=need
                            )
                        ]
                    ),
                    timeout=30,
                )
                for resp in preferred.container_responses[:1]:
                    chosen = [d for d in resp.deviceIDs if d in available][:need]
            chosen += [d for d in available if d not in chosen][: need - len(chosen)]
            response = ep.stub().Allocate(
                dp_pb2.AllocateRequest(
                    container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=chosen)]
                ),
                timeout=30,
            )
        except grpc.RpcError as exc:
            raise AdmissionError(f"rpc error: code = {exc.code()} desc = {exc.details()}") from exc
        if not response.container_responses:
            raise AdmissionError(f"device plugin {ep.resource} returned an empty allocation")
        as_json = json_format.MessageToDict(
            response.container_responses[0], preserving_proto_field_name=True
        )
        return Allocation(device_ids=chosen, response=as_json)

    def pre_start(self, pod_uid: str, container: str) -> None:
        """PreStartContainer for each resource of the container that requires it."""
        with self._lock:
            allocs = dict(self.state.pods.get(pod_uid, {}).get(container, {}))
            eps = {r: self.endpoints.get(r) for r in allocs}
        for resource, alloc in allocs.items():
            ep = eps[resource]
            if ep is None or not ep.options.pre_start_required:
                continue
            ep.stub().PreStartContainer(
                dp_pb2.PreStartContainerRequest(devices_ids=alloc.device_ids),
                timeout=PRE_START_TIMEOUT,
            )

    def free(self, pod_uid: str) -> None:
        with self._lock:
            if self.state.pods.pop(pod_uid, None) is not None:
                self.store.save(self.state)

    def pod_uids(self) -> set[str]:
        return set(self.state.pods)

    # ---- pod resources API ---------------------------------------------------------------------
    def container_devices(self, pod_uid: str, container: str) -> list[DeviceInstance]:
        """The devices allocated to a container (``init:<name>`` for init containers)."""
        with self._lock:
            allocs = self.state.pods.get(pod_uid, {}).get(container, {})
            return [
                DeviceInstance(resource, d, self._numa(resource, d))
                for resource, alloc in sorted(allocs.items())
                for d in alloc.device_ids
            ]

    def allocatable(self) -> list[DeviceInstance]:
        """Every healthy device of every registered resource."""
        with self._lock:
            return [
                DeviceInstance(resource, d, ep.numa.get(d, ()))
                for resource, ep in sorted(self.endpoints.items())
                for d, h in sorted(ep.devices.items())
                if h == HEALTHY
            ]

    def _numa(self, resource: str, device: str) -> tuple[int, ...]:
        ep = self.endpoints.get(resource)
        return ep.numa.get(device, ()) if ep is not None else ()
