"""Which container holds which of our devices: the kubelet's pod resources API.

``v1.PodResourcesLister/List`` on ``<kubelet root>/pod-resources/kubelet.sock`` answers, per
active pod and container, the device IDs each device plugin allocated (``ContainerDevices``).
The kubelet gives names only (namespace, pod, container), no pod UIDs and no container IDs;
the cgroup join in :mod:`gpuslice_device_plugin.usage` gets those from the API server when it
needs them. One ``List`` per scrape: nothing is kept between scrapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuslice_core.errors import TransientError
from gpuslice_protos.kubelet.podresources.v1 import api_pb2 as pb
from gpuslice_protos.kubelet.podresources.v1 import api_pb2_grpc as pb_grpc

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


@dataclass(frozen=True)
class Holder:
    """One device ID allocated to one container, as the kubelet lists it."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str


class PodResourcesError(TransientError):
    """The kubelet's pod resources API cannot be reached or fails; the message says which."""


def holders(response: pb.ListPodResourcesResponse, resources: set[str]) -> list[Holder]:
    """The device-plugin allocations of ``resources`` in a ``List`` answer (DRA
    ``dynamic_resources`` are another driver's business and are skipped)."""
    out: list[Holder] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name not in resources:
                    continue
                out.extend(
                    Holder(pod.namespace, pod.name, container.name, devices.resource_name, i)
                    for i in devices.device_ids
                )
    return out


class PodResourcesClient:
    """``List`` over the kubelet's unix socket, one short call per scrape."""

    def __init__(self, socket: Path, resources: set[str], *, timeout: float = 5.0) -> None:
        self.socket = socket
        self.resources = resources
        self.timeout = timeout

    def list(self) -> list[Holder]:
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            stub = pb_grpc.PodResourcesListerStub(channel)
            try:
                reply = stub.List(pb.ListPodResourcesRequest(), timeout=self.timeout)
            except grpc.RpcError as exc:
                code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
                details = exc.details() if hasattr(exc, "details") else str(exc)
                raise PodResourcesError(
                    f"pod resources List ({self.socket}): {code}: {details}"
                ) from exc
        return holders(reply, self.resources)
