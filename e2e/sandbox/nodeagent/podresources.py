"""The kubelet's pod resources API (``v1.PodResourcesLister``) at
``<root>/pod-resources/kubelet.sock``: which devices each container of the node's pods got,
the way monitoring agents (dcgm-exporter) read them (docs/node-agent.md, "What it simulates":
Pod resources API; the wire contract is the kubelet's podresources v1 API in proto/).

- ``List``: every active pod (admitted or waiting, not terminated, not rejected) with its app
  containers and restartable init containers (sidecars), as the kubelet lists them. Per
  container: ``devices`` from the device manager's allocation (one ``ContainerDevices`` per
  device and NUMA node, as the kubelet builds them) and ``dynamic_resources`` for the claims the
  container references (the same selection the runtime's CDI ids come from: listed claims,
  ``request`` filtering, the extended-resource claim's request mappings), one entry per claim
  with one ``ClaimResource`` per prepared device (its own CDI ids, driver, pool, device and
  ``share_id`` when the plugin returned one). Claims not prepared on this node are left out.
- ``Get``: the same for one pod; ``NOT_FOUND`` for a pod the node does not know. A known pod
  that is no longer active (finished, rejected) is answered with its containers and no
  resources, since they were released (the kubelet answers for any pod it still has; for an
  unknown one it returns a plain error, gRPC ``Unknown``).
- ``GetAllocatableResources``: the healthy device-plugin devices; ``cpu_ids`` and ``memory``
  stay empty (no CPU or memory manager in the sandbox).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from e2e.sandbox.nodeagent.claims import PodClaim, container_claim_devices
from e2e.sandbox.nodeagent.devicemanager import DeviceInstance
from e2e.sandbox.nodeagent.dra_plugins import PreparedDevice
from gpuslice_core.errors import NotFoundError
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj
from gpuslice_protos.kubelet.podresources.v1 import api_pb2 as pb
from gpuslice_protos.kubelet.podresources.v1 import api_pb2_grpc as pb_grpc

log = get_logger(__name__)

SOCKET = "kubelet.sock"
SERVICE = "v1.PodResourcesLister"


@dataclass(frozen=True)
class PodEntry:
    """A pod as the agent knows it: the object, its claims, and whether it is active."""

    pod: Obj
    claims: list[PodClaim] = field(default_factory=list)
    active: bool = True


@dataclass(frozen=True)
class Sources:
    """Where the answers come from (the agent's managers; fakes in unit tests)."""

    active_pods: Callable[[], list[PodEntry]]
    find_pod: Callable[[str, str], PodEntry | None]  # (namespace, name)
    claim_devices: Callable[[str, str], list[tuple[str, PreparedDevice]]]  # (ns, claim)
    container_devices: Callable[[str, str], list[DeviceInstance]]  # (pod uid, container key)
    allocatable: Callable[[], list[DeviceInstance]]


# ---- building the messages --------------------------------------------------------------------
def container_devices_pb(devices: Iterable[DeviceInstance]) -> list[pb.ContainerDevices]:
    """One ContainerDevices per device and NUMA node (one without topology when unknown), as
    the kubelet's ``containerDevicesFromResourceDeviceInstances`` does."""
    out: list[pb.ContainerDevices] = []
    for d in devices:
        if not d.numa_nodes:
            out.append(pb.ContainerDevices(resource_name=d.resource, device_ids=[d.device_id]))
            continue
        for node in d.numa_nodes:
            out.append(
                pb.ContainerDevices(
                    resource_name=d.resource,
                    device_ids=[d.device_id],
                    topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=node)]),
                )
            )
    return out


def claim_resource_pb(driver: str, device: PreparedDevice) -> pb.ClaimResource:
    resource = pb.ClaimResource(
        cdi_devices=[pb.CDIDevice(name=i) for i in device.cdi_device_ids],
        driver_name=driver,
        pool_name=device.pool_name,
        device_name=device.device_name,
    )
    if device.share_id:
        resource.share_id = device.share_id
    return resource


def pod_containers(pod: Obj) -> list[tuple[str, Obj]]:
    """(device-manager key, container) for the containers the API lists: restartable init
    containers (sidecars), then the app containers."""
    spec = pod.get("spec") or {}
    out = [
        (f"init:{c['name']}", c)
        for c in spec.get("initContainers") or []
        if c.get("restartPolicy") == "Always"
    ]
    out += [(c["name"], c) for c in spec.get("containers") or []]
    return out


def pod_resources_pb(entry: PodEntry, sources: Sources) -> pb.PodResources:
    pod = entry.pod
    meta = pod["metadata"]
    ns, uid = meta["namespace"], meta["uid"]
    containers: list[pb.ContainerResources] = []
    for key, container in pod_containers(pod):
        resources = pb.ContainerResources(name=container["name"])
        if entry.active:
            resources.devices.extend(container_devices_pb(sources.container_devices(uid, key)))
            by_claim = container_claim_devices(
                pod, container, entry.claims, lambda name: sources.claim_devices(ns, name)
            )
            for claim_name, devices in by_claim.items():
                resources.dynamic_resources.append(
                    pb.DynamicResource(
                        claim_name=claim_name,
                        claim_namespace=ns,
                        claim_resources=[claim_resource_pb(drv, d) for drv, d in devices],
                    )
                )
        containers.append(resources)
    return pb.PodResources(name=meta["name"], namespace=ns, containers=containers)


# ---- the service ------------------------------------------------------------------------------
class PodResourcesServicer(pb_grpc.PodResourcesListerServicer):
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def List(  # noqa: N802 - the gRPC method name
        self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pb.ListPodResourcesResponse:
        pods = [pod_resources_pb(e, self.sources) for e in self.sources.active_pods()]
        return pb.ListPodResourcesResponse(pod_resources=pods)

    def Get(  # noqa: N802 - the gRPC method name
        self, request: pb.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> pb.GetPodResourcesResponse:
        entry = self.sources.find_pod(request.pod_namespace, request.pod_name)
        if entry is None:
            raise NotFoundError(
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
            )
        return pb.GetPodResourcesResponse(pod_resources=pod_resources_pb(entry, self.sources))

    def GetAllocatableResources(  # noqa: N802 - the gRPC method name
        self, request: pb.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pb.AllocatableResourcesResponse:
        return pb.AllocatableResourcesResponse(
            devices=container_devices_pb(self.sources.allocatable())
        )


class PodResourcesServer:
    """``<dir>/kubelet.sock`` serving ``v1.PodResourcesLister`` (and gRPC health)."""

    def __init__(self, directory: Path, sources: Sources, node: str) -> None:
        self.socket = directory / SOCKET
        self.servicer = PodResourcesServicer(sources)
        self._server = UnixGrpcServer([self.socket], name=f"{node}-podresources")
        self._server.add(pb_grpc.add_PodResourcesListerServicer_to_server, self.servicer, SERVICE)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=1.0)
