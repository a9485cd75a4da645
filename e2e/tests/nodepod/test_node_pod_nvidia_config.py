"""NVIDIA's quickstart claims, with only the DeviceClass and driver names changed to ours, on one
sandbox node pod (real kubelet plugin and enforcer, MPS on: the fake's stand-in control daemon):
their opaque ``resource.nvidia.com/v1beta1`` configs prepare, the enforcer holds the limits they
ask for, a time-slice interval is set on the GPU, and what gpuslice cannot honour is refused at
prepare with the field named."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    DRIVER,
    RESOURCE,
    claim_request,
    create_multi_request_template,
    pod_devices,
    run_pod,
)
from e2e.sandbox.nodeagent.testing import wait_for
from e2e.sandbox.nodeservices import NodePod, serve_node_pod, start_node_pod
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as epb

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)

GIB = 1024**3
NV = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
MPS_50_10GI = {
    **NV,
    "sharing": {
        "strategy": "MPS",
        "mpsConfig": {
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "10Gi",
        },
    },
}


@pytest.fixture(scope="module")
def node_pod(
    sandbox: ControlPlane, kube: RawApi, device_classes: list[str], request: pytest.FixtureRequest
) -> Iterator[NodePod]:
    # driver 615: memory partitioning and MPS protocol 3, the strongest mechanisms
    pod = start_node_pod(sandbox, [{"model": "L4", "count": 2}], nvml={"driverVersion": "615.20"})
    yield from serve_node_pod(pod, kube, lambda: request.session.testsfailed)


def opaque(parameters: dict[str, Any], requests: list[str]) -> Obj:
    return {"requests": requests, "opaque": {"driver": DRIVER, "parameters": parameters}}


def usage(pod: NodePod, claim_uid: str) -> epb.ShareUsage:
    with pod.services.enforcer() as stub:
        reply = stub.GetUsage(epb.GetUsageRequest(), timeout=10)
    [share] = [s for s in reply.shares if s.claim_uid == claim_uid]
    return share


def claim_uid(kube: RawApi, namespace: str, pod: Obj) -> str:
    name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = kube.get(resource_path(RESOURCE, "resourceclaims", namespace=namespace, name=name))
    return str(claim["metadata"]["uid"])


def test_nvidia_mps_quickstart_is_enforced_with_its_limits(
    node_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    """gpu-test-mps: one claim, two containers, MPS at 50 % of the SMs and 10Gi."""
    create_multi_request_template(
        kube,
        namespace,
        "shared-gpu",
        [claim_request("mps-gpu", "gpu.gpuslice.dev")],
        config=[opaque(MPS_50_10GI, ["mps-gpu"])],
    )
    ref = [{"name": "shared-gpu", "request": "mps-gpu"}]
    pod = run_pod(kube, node_pod.node, namespace, "mps", {"mps-ctr0": ref, "mps-ctr1": ref})
    [device] = usage(node_pod, claim_uid(kube, namespace, pod)).devices
    assert (device.sm_limit_percent, device.memory_limit_bytes) == (50, 10 * GIB)
    assert device.cores_mechanism == epb.MECHANISM_MPS_PROTOCOL3
    assert device.memory_mechanism == epb.MECHANISM_MEMORY_PARTITION
    agent = node_pod.node.agent
    assert agent is not None
    for container in ("mps-ctr0", "mps-ctr1"):
        [got] = pod_devices(node_pod.node, pod, container=container)
        assert (got["CORES"], got["MEMORY"], got["ENFORCEMENT"]) == ("50", str(10 * GIB), "hard")
        # the container is a client of the claim's MPS namespace
        env = agent.container_edits(pod["metadata"]["uid"], container)["env"]
        assert isinstance(env, list) and any(e.startswith("CUDA_MPS_PIPE_DIRECTORY=") for e in env)


def test_time_slicing_and_mps_requests_of_one_claim(
    node_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    """gpu-test5 with the Default interval: the time-sliced GPU is the claim's alone and needs
    no share; the MPS one gets its limits."""
    ts = {
        **NV,
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}},
    }
    create_multi_request_template(
        kube,
        namespace,
        "multiple-gpus",
        [claim_request("ts-gpu", "gpu.gpuslice.dev"), claim_request("mps-gpu", "gpu.gpuslice.dev")],
        config=[opaque(ts, ["ts-gpu"]), opaque(MPS_50_10GI, ["mps-gpu"])],
    )
    ts_ref = [{"name": "multiple-gpus", "request": "ts-gpu"}]
    mps_ref = [{"name": "multiple-gpus", "request": "mps-gpu"}]
    pod = run_pod(
        kube, node_pod.node, namespace, "ts-mps", {"ts-ctr0": ts_ref, "mps-ctr0": mps_ref}
    )
    [ts_device] = pod_devices(node_pod.node, pod, container="ts-ctr0")
    assert (ts_device["CORES"], ts_device["ENFORCEMENT"]) == ("100", "exclusive")
    [mps_device] = pod_devices(node_pod.node, pod, container="mps-ctr0")
    assert (mps_device["CORES"], mps_device["MEMORY"]) == ("50", str(10 * GIB))
    [device] = usage(node_pod, claim_uid(kube, namespace, pod)).devices
    assert device.device_uuid == mps_device["UUID"] != ts_device["UUID"]


def test_a_time_slice_interval_is_set_on_the_gpu_and_put_back_after(
    node_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    """gpu-test5 as NVIDIA ships it (interval Long): the pod runs, its GPU's compute time slice
    is Long (3, what ``nvidia-smi compute-policy --set-timeslice`` takes) while it does, and
    Default (0) again once the pod and its claim are gone."""
    long = {**NV, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}
    create_multi_request_template(
        kube,
        namespace,
        "long",
        [claim_request("ts-gpu", "gpu.gpuslice.dev")],
        config=[opaque(long, ["ts-gpu"])],
    )
    pod = run_pod(
        kube, node_pod.node, namespace, "long", {"ts": [{"name": "long", "request": "ts-gpu"}]}
    )
    [device] = pod_devices(node_pod.node, pod, container="ts")
    index = _uuids(node_pod).index(device["UUID"])
    control = FakeNvmlControl.from_config_file(node_pod.services.nvml_config)

    def time_slice() -> int:
        return control.state().gpus[index].time_slice

    assert time_slice() == 3
    kube.delete(resource_path("v1", "pods", namespace=namespace, name="long"))
    wait_for(lambda: time_slice() == 0 or None, 60, "the GPU's time slice back to Default")


def _uuids(node_pod: NodePod) -> list[str]:
    """The fake node's GPU UUIDs by NVML index."""
    with FakeNvml.from_config_file(node_pod.services.nvml_config) as nvml:
        return [g.uuid for g in nvml.gpus()]
