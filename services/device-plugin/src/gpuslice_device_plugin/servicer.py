"""``v1beta1.DevicePlugin`` for one resource: RPC → domain call, nothing else.

Errors are raised as domain errors (``UnknownDeviceError``, ``UnhealthyDeviceError``) and mapped
to gRPC statuses by ``gpuslice_core.grpcserver.ErrorInterceptor``; the kubelet turns a failed
Allocate into the pod's ``UnexpectedAdmissionError`` with our message in it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.allocate import (
    Topology,
    check_request,
    container_response,
    mps_response,
    preferred,
)
from gpuslice_device_plugin.config import Settings
from gpuslice_device_plugin.devices import Resource
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.mps import ReplicaShare
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

log = get_logger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    def __init__(
        self,
        resource: Resource,
        settings: Settings,
        health: HealthTracker,
        topology: Topology,
        metrics: Metrics,
        *,
        shared_policy: str = "distributed",
        shares: dict[str, ReplicaShare] | None = None,
        cdi_ids: dict[str, list[str]] | None = None,
    ) -> None:
        self.resource = resource
        self.settings = settings
        self.health = health
        self.topology = topology
        self.metrics = metrics
        self.shared_policy = shared_policy
        self.shares = shares or {}
        self.cdi_ids = cdi_ids
        self.stopped = threading.Event()

    def stop(self) -> None:
        """End the ListAndWatch streams (the server is going away)."""
        self.stopped.set()
        self.health.wake()

    def snapshot(self) -> pb.ListAndWatchResponse:
        devices = []
        counts = {HEALTHY: 0, UNHEALTHY: 0}
        for d in self.resource.devices:
            state = HEALTHY if self.health.healthy(d) else UNHEALTHY
            counts[state] += 1
            topology = None
            if d.numa_node is not None:
                topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa_node)])
            devices.append(pb.Device(ID=d.id, health=state, topology=topology))
        for state, n in counts.items():
            self.metrics.devices.labels(resource=self.resource.name, health=state).set(n)
        return pb.ListAndWatchResponse(devices=devices)

    # ---- DevicePlugin ----------------------------------------------------------------------
    def GetDevicePluginOptions(  # noqa: N802 - the gRPC method name
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return OPTIONS

    def ListAndWatch(  # noqa: N802
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        generation = self.health.generation
        last = self.snapshot()
        log.info("ListAndWatch started", resource=self.resource.name, devices=len(last.devices))
        yield last
        while context.is_active() and not self.stopped.is_set() and not self.health.stopped:
            changed = self.health.wait_change(generation, 1.0, self.stopped)
            if changed == generation:  # a timeout (or a stop): nothing to send
                continue
            generation = changed
            current = self.snapshot()
            if current != last:
                last = current
                unhealthy = [d.ID for d in current.devices if d.health != HEALTHY]
                log.info("ListAndWatch update", resource=self.resource.name, unhealthy=unhealthy)
                yield current

    def GetPreferredAllocation(  # noqa: N802
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        with self.metrics.preferred.time():
            out = pb.PreferredAllocationResponse()
            for req in request.container_requests:
                ids = preferred(
                    self.resource,
                    list(req.available_deviceIDs),
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                    self.topology,
                    policy=self.shared_policy,
                )
                out.container_responses.append(
                    pb.ContainerPreferredAllocationResponse(deviceIDs=ids)
                )
            return out

    def Allocate(  # noqa: N802
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        with self.metrics.allocate.time():
            out = pb.AllocateResponse()
            for req in request.container_requests:
                devices = check_request(self.resource, list(req.devices_ids), self.health)
                response = container_response(
                    self.resource,
                    devices,
                    list_strategies=self.settings.device_list_strategies,
                    id_strategy=self.settings.device_id_strategy,
                    pass_device_specs=self.settings.pass_device_specs,
                    cdi_ids=self.cdi_ids,
                )
                if self.resource.sharing == "mps":  # one device: failRequestsGreaterThanOne
                    share = self.shares[devices[0].id]
                    response = mps_response(response, share.cdi_id)
                    log.info(
                        "allocated",
                        resource=self.resource.name,
                        devices=list(req.devices_ids),
                        share=share.share_id,
                        cores=share.cores,
                        memory=share.memory_bytes,
                        enforcement=share.level,
                    )
                else:
                    log.info(
                        "allocated", resource=self.resource.name, devices=list(req.devices_ids)
                    )
                out.container_responses.append(response)
            return out

    def PreStartContainer(  # noqa: N802
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
