"""Typed servicers built on the generated classes carry real payloads over a unix socket."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpuslice_protos.gpuslice.v1 import enforcer_pb2, enforcer_pb2_grpc
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as dra_pb2
from gpuslice_protos.kubelet.dra.v1 import api_pb2_grpc as dra_grpc


@pytest.fixture
def address(tmp_path: Path) -> Iterator[str]:
    """A unix socket address; socket paths are limited to 107 bytes."""
    if len(str(tmp_path / "grpc.sock")) < 100:
        yield f"unix:{tmp_path / 'grpc.sock'}"
        return
    with tempfile.TemporaryDirectory(prefix="gs-") as short:
        yield f"unix:{Path(short) / 'grpc.sock'}"


class DraPlugin(dra_grpc.DRAPluginServicer):
    def NodePrepareResources(
        self, request: dra_pb2.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_pb2.NodePrepareResourcesResponse:
        response = dra_pb2.NodePrepareResourcesResponse()
        for claim in request.claims:
            device = dra_pb2.Device(
                pool_name="node-a",
                device_name="gpu-0",
                cdi_device_ids=[f"k8s.gpu.gpuslice.dev/claim={claim.uid}-gpu-0"],
            )
            if claim.name == "shared":
                device.share_id = "share-1"
            response.claims[claim.uid].devices.append(device)
        return response

    def NodeUnprepareResources(
        self, request: dra_pb2.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra_pb2.NodeUnprepareResourcesResponse:
        response = dra_pb2.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].error = ""
        return response


@pytest.mark.timeout(20)
def test_dra_v1_prepare_keeps_share_id_presence(address: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dra_grpc.add_DRAPluginServicer_to_server(DraPlugin(), server)
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            reply = dra_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(
                    claims=[
                        dra_pb2.Claim(namespace="ns", uid="uid-1", name="shared"),
                        dra_pb2.Claim(namespace="ns", uid="uid-2", name="whole"),
                    ]
                ),
                timeout=5,
            )
    finally:
        server.stop(grace=None)
    shared = reply.claims["uid-1"].devices[0]
    whole = reply.claims["uid-2"].devices[0]
    assert shared.HasField("share_id") and shared.share_id == "share-1"
    assert not whole.HasField("share_id")
    assert list(whole.cdi_device_ids) == ["k8s.gpu.gpuslice.dev/claim=uid-2-gpu-0"]


class Enforcer(enforcer_pb2_grpc.EnforcerServicer):
    def __init__(self) -> None:
        self.shares: dict[str, str] = {}

    def CreateShare(
        self, request: enforcer_pb2.CreateShareRequest, context: grpc.ServicerContext
    ) -> enforcer_pb2.CreateShareResponse:
        created = request.claim_uid not in self.shares
        share_id = self.shares.setdefault(request.claim_uid, f"share-{len(self.shares)}")
        return enforcer_pb2.CreateShareResponse(
            share_id=share_id,
            created=created,
            container_edits=enforcer_pb2.ContainerEdits(
                env=[f"GPUSLICE_CORES={request.cores_percent}"],
                hooks=[enforcer_pb2.Hook(hook_name="createContainer", path="/bin/true")],
            ),
            limits=[
                enforcer_pb2.LimitEnforcement(
                    resource=enforcer_pb2.RESOURCE_MEMORY,
                    mechanism=enforcer_pb2.MECHANISM_WATCHDOG,
                    reason="no memory partitioning on this driver",
                )
            ],
            level=enforcer_pb2.ENFORCEMENT_LEVEL_SOFT,
        )

    # The generated servicer stub is abstract: mypy insists on every RPC being implemented.
    def ReleaseShare(
        self, request: enforcer_pb2.ReleaseShareRequest, context: grpc.ServicerContext
    ) -> enforcer_pb2.ReleaseShareResponse:
        share_id = self.shares.pop(request.claim_uid, "")
        return enforcer_pb2.ReleaseShareResponse(released=bool(share_id), share_id=share_id)

    def GetUsage(
        self, request: enforcer_pb2.GetUsageRequest, context: grpc.ServicerContext
    ) -> enforcer_pb2.GetUsageResponse:
        return enforcer_pb2.GetUsageResponse()

    def WatchViolations(
        self, request: enforcer_pb2.WatchViolationsRequest, context: grpc.ServicerContext
    ) -> Iterator[enforcer_pb2.Violation]:
        return iter(())

    def GetCapabilities(
        self, request: enforcer_pb2.GetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> enforcer_pb2.GetCapabilitiesResponse:
        return enforcer_pb2.GetCapabilitiesResponse()


@pytest.mark.timeout(20)
def test_enforcer_create_share_round_trip(address: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    enforcer_pb2_grpc.add_EnforcerServicer_to_server(Enforcer(), server)
    server.add_insecure_port(address)
    server.start()
    request = enforcer_pb2.CreateShareRequest(
        claim_uid="uid-1",
        claim_namespace="ns",
        claim_name="c",
        pods=[enforcer_pb2.PodReference(uid="pod-1", namespace="ns", name="p")],
        device_uuids=["GPU-0"],
        cores_percent=30,
        memory_bytes=4 << 30,
        mode=enforcer_pb2.ENFORCEMENT_MODE_SOFT,
        work_conserving=True,
    )
    try:
        with grpc.insecure_channel(address) as channel:
            stub = enforcer_pb2_grpc.EnforcerStub(channel)
            first = stub.CreateShare(request, timeout=5)
            again = stub.CreateShare(request, timeout=5)
            released = stub.ReleaseShare(
                enforcer_pb2.ReleaseShareRequest(claim_uid="uid-1"), timeout=5
            )
            released_again = stub.ReleaseShare(
                enforcer_pb2.ReleaseShareRequest(claim_uid="uid-1"), timeout=5
            )
    finally:
        server.stop(grace=None)
    assert (first.share_id, first.created) == ("share-0", True)
    assert (again.share_id, again.created) == ("share-0", False)
    assert list(first.container_edits.env) == ["GPUSLICE_CORES=30"]
    assert not first.container_edits.hooks[0].HasField("timeout_seconds")
    assert first.limits[0].mechanism == enforcer_pb2.MECHANISM_WATCHDOG
    assert first.level == enforcer_pb2.ENFORCEMENT_LEVEL_SOFT
    assert (released.released, released.share_id) == (True, "share-0")
    assert (released_again.released, released_again.share_id) == (False, "")
