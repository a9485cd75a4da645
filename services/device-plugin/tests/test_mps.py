"""sharing.mps against a stand-in enforcer on a unix socket: equal shares per replica, the CDI
spec that carries everything the container gets, and Allocate that hands out only that."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice_core import cdi
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_device_plugin.allocate import container_response, mps_response
from gpuslice_device_plugin.devices import DiscoveryError, discover
from gpuslice_device_plugin.mps import MIB, EnforcerClient, setup_shares, split
from gpuslice_nvml import Nvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc
from gpuslice_testkit.device_plugin import H100_MIXED, settings

pytestmark = pytest.mark.timeout(30)
Factory = Callable[[dict[str, Any]], Nvml]
MPS4 = "sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}"


class StandInEnforcer(pb_grpc.EnforcerServicer):
    """Keeps shares by claim UID like the real one (idempotent create, release)."""

    def GetCapabilities(self, request: pb.GetCapabilitiesRequest, context: Any) -> Any:
        return pb.GetCapabilitiesResponse()

    def WatchViolations(self, request: pb.WatchViolationsRequest, context: Any) -> Any:
        return iter(())

    def __init__(self) -> None:
        self.shares: dict[str, pb.CreateShareRequest] = {}
        self.released: list[str] = []

    def CreateShare(self, request: pb.CreateShareRequest, context: Any) -> Any:
        created = request.claim_uid not in self.shares
        self.shares[request.claim_uid] = request
        return pb.CreateShareResponse(
            share_id=f"sh-{request.claim_uid[-8:]}",
            created=created,
            container_edits=pb.ContainerEdits(
                env=["CUDA_MPS_PIPE_DIRECTORY=/var/run/gpuslice/mps"],
                hooks=[pb.Hook(hook_name="createContainer", path="/bin/hook", args=["hook"])],
            ),
            limits=[
                pb.LimitEnforcement(
                    resource=pb.RESOURCE_MEMORY, mechanism=pb.MECHANISM_MEMORY_PARTITION
                ),
                pb.LimitEnforcement(
                    resource=pb.RESOURCE_CORES, mechanism=pb.MECHANISM_MPS_PROTOCOL3
                ),
            ],
            level=pb.ENFORCEMENT_LEVEL_HARD,
        )

    def ReleaseShare(self, request: pb.ReleaseShareRequest, context: Any) -> Any:
        self.released.append(request.claim_uid)
        return pb.ReleaseShareResponse(
            released=self.shares.pop(request.claim_uid, None) is not None
        )

    def GetUsage(self, request: pb.GetUsageRequest, context: Any) -> Any:
        return pb.GetUsageResponse(
            shares=[
                pb.ShareUsage(
                    claim_uid=uid,
                    devices=[
                        pb.DeviceUsage(
                            sm_limit_percent=r.cores_percent, memory_limit_bytes=r.memory_bytes
                        )
                    ],
                )
                for uid, r in sorted(self.shares.items())
            ]
        )


@pytest.fixture
def enforcer() -> Iterator[tuple[StandInEnforcer, Path]]:
    d = Path(tempfile.mkdtemp(prefix="gdm-"))
    servicer = StandInEnforcer()
    server = UnixGrpcServer([d / "enforcer.sock"], name="enforcer")
    server.add(pb_grpc.add_EnforcerServicer_to_server, servicer, "gpuslice.v1.Enforcer")
    server.start()
    yield servicer, d / "enforcer.sock"
    server.stop(0.1)
    shutil.rmtree(d, ignore_errors=True)


def test_split_is_equal_in_whole_mib() -> None:
    assert split(4, 80 * 1024 * MIB) == (25, 20 * 1024 * MIB)
    assert split(3, 10 * MIB + 5) == (33, 3 * MIB)


def test_replicas_become_enforced_shares_and_cdi_devices(
    fake_node: Factory, enforcer: tuple[StandInEnforcer, Path], tmp_path: Path
) -> None:
    nvml = fake_node({"gpus": [{"model": "L4", "count": 2}]})
    s = settings(MPS4)
    [gpu] = discover(nvml, s)
    assert (gpu.sharing, gpu.replicas, len(gpu.devices)) == ("mps", 4, 8)
    assert gpu.fail_requests_greater_than_one
    memory = {g.index: g.memory_total_bytes for g in nvml.gpus()}
    visibility = {
        d.id: container_response(
            gpu, [d], list_strategies=("envvar",), id_strategy="uuid", pass_device_specs=True
        )
        for d in gpu.devices
    }
    servicer, socket = enforcer
    servicer.shares["dp-GPU-stale-0"] = pb.CreateShareRequest(claim_uid="dp-GPU-stale-0")
    shares = setup_shares(EnforcerClient(socket), [gpu], memory, tmp_path, visibility)

    assert servicer.released == ["dp-GPU-stale-0"]  # an earlier configuration's share
    assert len(servicer.shares) == 8
    first = gpu.devices[0]
    request = servicer.shares[f"dp-{first.uuid}-0"]
    assert (request.cores_percent, request.memory_bytes) == split(4, memory[0])
    assert list(request.device_uuids) == [first.uuid]
    assert request.mode == pb.ENFORCEMENT_MODE_AUTO
    share = shares[first.id]
    assert (share.level, share.memory_mechanism, share.cores_mechanism) == (
        "hard",
        "memory-partition",
        "mps-protocol3",
    )
    assert share.cdi_id == "k8s.gpu.gpuslice.dev/device-plugin=gpu-0-0"

    # The CDI device holds the visibility, the enforcer's edits and the limits.
    edits = cdi.resolve(tmp_path, [share.cdi_id])
    env = dict(e.split("=", 1) for e in edits.env)
    assert env["NVIDIA_VISIBLE_DEVICES"] == first.uuid
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/var/run/gpuslice/mps"
    assert env["GPUSLICE_GPU_0_0_CORES"] == "25"
    assert env["GPUSLICE_GPU_0_0_ENFORCEMENT"] == "hard"
    assert [h.path for h in edits.hooks] == ["/bin/hook"]
    assert "/dev/nvidia0" in [d.path for d in edits.device_nodes]

    # Allocate hands out the CDI device only: no GPU without its limits.
    response = mps_response(visibility[first.id], share.cdi_id)
    assert [c.name for c in response.cdi_devices] == [share.cdi_id]
    assert not response.envs and not response.devices and not response.mounts

    # A restart finds the same shares (same parameters) and releases nothing.
    again = setup_shares(EnforcerClient(socket), [gpu], memory, tmp_path, visibility)
    assert again == shares and servicer.released == ["dp-GPU-stale-0"]


def test_mps_on_mig_devices_is_refused(fake_node: Factory) -> None:
    text = (
        "flags: {migStrategy: mixed}\n"
        "sharing: {mps: {resources: [{name: mig-1g.10gb, replicas: 2}]}}"
    )
    with pytest.raises(DiscoveryError, match=r"mig-1g\.10gb is made of MIG devices"):
        discover(fake_node(H100_MIXED), settings(text))
