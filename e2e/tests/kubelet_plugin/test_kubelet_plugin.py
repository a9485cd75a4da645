"""gpuslice-kubelet-plugin on the real control plane, driven the way users drive it: pods with
ResourceClaimTemplates, allocated by the real kube-scheduler from the plugin's slices, started
by the node agent with the CDI spec the plugin wrote (the environment is read from the pod's
log). One fake node of 8 H100s (GPU 7 in MIG mode) serves the whole module."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    DRIVER,
    GIB,
    H100X8,
    RESOURCE,
    GpuNode,
    allocated_devices,
    claim_template,
    create_claim,
    gpu_pod,
    pod_devices,
    pod_env,
    start_gpu_node,
    stop_gpu_node,
)
from e2e.sandbox.nodeagent.testing import (
    condition,
    get_pod,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
)
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)

H100_MEMORY = 81559 * 1024 * 1024


@pytest.fixture(scope="module")
def node(sandbox: ControlPlane, kube: RawApi, device_classes: list[str]) -> Iterator[GpuNode]:
    gpu_node = start_gpu_node(sandbox, H100X8)
    yield gpu_node
    stop_gpu_node(gpu_node, kube)


def create(kube: RawApi, namespace: str, plural: str, obj: Obj, gv: str = "v1") -> Obj:
    return kube.create(resource_path(gv, plural, namespace=namespace), obj)


def delete_pod(kube: RawApi, namespace: str, name: str) -> None:
    kube.delete(resource_path("v1", "pods", namespace=namespace, name=name))


def test_slices_for_8_h100s_are_accepted(node: GpuNode, kube: RawApi) -> None:
    slices = wait_for(lambda: node.slices(kube), 20, "the node's ResourceSlices")
    assert len(slices) == 1
    pool = slices[0]["spec"]["pool"]
    assert pool["name"] == node.name and pool["resourceSliceCount"] == 1
    devices = node.devices(kube)
    assert sorted(devices) == sorted(
        [f"gpu-{i}" for i in range(7)]
        + ["gpu-7-mig-1g-10gb-1", "gpu-7-mig-2g-20gb-2", "gpu-7-mig-3g-40gb-4"]
    )
    gpu0 = devices["gpu-0"]
    assert gpu0["allowMultipleAllocations"] is True
    assert gpu0["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert gpu0["capacity"]["cores"]["requestPolicy"]["validRange"]["max"] == "100"
    assert gpu0["capacity"]["memory"]["value"] == "81559Mi"
    mig = devices["gpu-7-mig-3g-40gb-4"]
    assert mig["attributes"]["type"] == {"string": "mig"}
    assert mig["attributes"]["profile"] == {"string": "3g.40gb"}
    assert DRIVER in node.agent.registered_drivers()  # type: ignore[union-attr]


def test_exclusive_gpu_pod(node: GpuNode, kube: RawApi, namespace: str) -> None:
    create(
        kube,
        namespace,
        "resourceclaimtemplates",
        claim_template(namespace, "whole", "gpu.gpuslice.dev"),
        RESOURCE,
    )
    create(kube, namespace, "pods", gpu_pod(namespace, "p", node.name, template="whole"))
    pod = wait_pod_phase(kube, namespace, "p", "Running", timeout=30)
    [device] = allocated_devices(kube, namespace, pod)
    assert re.fullmatch(r"gpu-[0-6]", device), device
    index = int(device.split("-")[1])
    [got] = pod_devices(node, pod)
    assert got["UUID"] == node.gpu_uuid(index)
    assert (got["CORES"], got["MEMORY"]) == ("100", str(H100_MEMORY))
    assert got["ENFORCEMENT"] == "exclusive"
    assert got["CLAIM"].startswith(f"{namespace}/p-gpu")
    uid = got["CLAIM_UID"]
    assert node.checkpoint_claims()[uid]["state"] == "PrepareCompleted"

    delete_pod(kube, namespace, "p")
    wait_pod_gone(kube, namespace, "p")
    assert uid not in node.checkpoint_claims()
    assert not list(node.plugin.cdi_root.glob(f"*{uid}*"))


def test_two_shares_on_one_gpu_and_a_third_that_does_not_fit(
    node: GpuNode, kube: RawApi, namespace: str
) -> None:
    on_gpu5 = 'device.attributes["gpu.gpuslice.dev"].index == 5'
    for name, cores, memory in (("a", "30", "20Gi"), ("b", "50", "40Gi"), ("c", "30", "30Gi")):
        create(
            kube,
            namespace,
            "resourceclaimtemplates",
            claim_template(
                namespace, name, "gpu.gpuslice.dev", cores=cores, memory=memory, selector=on_gpu5
            ),
            RESOURCE,
        )
    create(kube, namespace, "pods", gpu_pod(namespace, "pa", node.name, template="a"))
    create(kube, namespace, "pods", gpu_pod(namespace, "pb", node.name, template="b"))
    pa = wait_pod_phase(kube, namespace, "pa", "Running", timeout=30)
    pb = wait_pod_phase(kube, namespace, "pb", "Running", timeout=30)
    uuid5 = node.gpu_uuid(5)
    [got_a], [got_b] = pod_devices(node, pa), pod_devices(node, pb)
    assert got_a["UUID"] == got_b["UUID"] == uuid5
    assert (got_a["CORES"], got_a["MEMORY"]) == ("30", str(20 * GIB))
    assert (got_b["CORES"], got_b["MEMORY"]) == ("50", str(40 * GIB))
    assert got_a["ENFORCEMENT"] == "none"  # no enforcer in this sandbox: accounting

    create(kube, namespace, "pods", gpu_pod(namespace, "pc", node.name, template="c"))

    def unschedulable() -> Obj | None:
        pod = get_pod(kube, namespace, "pc")
        cond = condition(pod, "PodScheduled") if pod else None
        return cond if cond and cond["status"] == "False" else None

    cond = wait_for(unschedulable, 30, "pc's PodScheduled=False")
    assert cond["reason"] == "Unschedulable"
    assert "cannot allocate all claims" in cond["message"], cond["message"]
    pc = get_pod(kube, namespace, "pc")
    assert pc is not None and pc["status"]["phase"] == "Pending"

    delete_pod(kube, namespace, "pa")  # 30 cores and 20Gi free again: the third one fits
    pc = wait_pod_phase(kube, namespace, "pc", "Running", timeout=40)
    [got_c] = pod_devices(node, pc)
    assert (got_c["CORES"], got_c["MEMORY"]) == ("30", str(30 * GIB))


def test_mig_device_pod(node: GpuNode, kube: RawApi, namespace: str) -> None:
    create(
        kube,
        namespace,
        "resourceclaimtemplates",
        claim_template(
            namespace,
            "mig",
            "mig.gpuslice.dev",
            selector='device.attributes["gpu.gpuslice.dev"].profile == "3g.40gb"',
        ),
        RESOURCE,
    )
    create(kube, namespace, "pods", gpu_pod(namespace, "m", node.name, template="mig"))
    pod = wait_pod_phase(kube, namespace, "m", "Running", timeout=30)
    assert allocated_devices(kube, namespace, pod) == ["gpu-7-mig-3g-40gb-4"]
    env = pod_env(node, pod)
    assert env["GPUSLICE_GPU_7_MIG_3G_40GB_4_UUID"].startswith("MIG-")
    assert env["GPUSLICE_GPU_7_MIG_3G_40GB_4_ENFORCEMENT"] == "mig"


def test_a_claim_shared_by_two_pods_is_prepared_once(
    node: GpuNode, kube: RawApi, namespace: str
) -> None:
    claim = create_claim(kube, namespace, "shared")
    uid = claim["metadata"]["uid"]
    create(kube, namespace, "pods", gpu_pod(namespace, "s1", node.name, claim="shared"))
    create(kube, namespace, "pods", gpu_pod(namespace, "s2", node.name, claim="shared"))
    s1 = wait_pod_phase(kube, namespace, "s1", "Running", timeout=30)
    s2 = wait_pod_phase(kube, namespace, "s2", "Running", timeout=30)
    assert pod_devices(node, s1) == pod_devices(node, s2)
    specs = list(node.plugin.cdi_root.glob(f"*{uid}*"))
    assert len(specs) == 1
    before = specs[0].stat().st_mtime_ns

    delete_pod(kube, namespace, "s1")
    wait_pod_gone(kube, namespace, "s1")
    assert node.checkpoint_claims()[uid]["state"] == "PrepareCompleted"  # s2 still uses it
    assert specs[0].stat().st_mtime_ns == before  # not prepared again

    delete_pod(kube, namespace, "s2")
    wait_pod_gone(kube, namespace, "s2")
    wait_for(lambda: uid not in node.checkpoint_claims(), 10, "the claim to be unprepared")
    assert not specs[0].exists()


def test_a_legacy_nvidia_gpu_limit_gets_a_whole_gpu(
    node: GpuNode, kube: RawApi, namespace: str
) -> None:
    create(
        kube,
        namespace,
        "pods",
        gpu_pod(namespace, "legacy", node.name, limits={"nvidia.com/gpu": "1"}),
    )
    pod = wait_pod_phase(kube, namespace, "legacy", "Running", timeout=30)
    extended = pod["status"]["extendedResourceClaimStatus"]
    assert extended["requestMappings"][0]["resourceName"] == "nvidia.com/gpu"
    [got] = pod_devices(node, pod)
    assert got["UUID"].startswith("GPU-")
    assert got["CORES"] == "100"
