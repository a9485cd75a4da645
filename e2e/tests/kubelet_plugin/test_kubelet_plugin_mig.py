"""Dynamic MIG on the real control plane: every placement of 8 H100s published (200 devices,
split into slices of at most 64 plus a slice of counter sets), the real scheduler allocating
placements through the counters, the instance created at prepare by the MIG manager (a
stand-in over real gRPC on the fake NVML) and destroyed when the pod goes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    RESOURCE,
    GpuNode,
    allocated_devices,
    claim_template,
    gpu_pod,
    pod_devices,
    start_gpu_node,
    stop_gpu_node,
)
from e2e.sandbox.nodeagent.testing import (
    condition,
    get_pod,
    unique,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
)
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml import Nvml, open_nvml
from gpuslice_testkit.kubelet_plugin.harness import write_node
from gpuslice_testkit.kubelet_plugin.standins import StandinMigManager

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)

H100X8_MIG = [{"model": "H100", "count": 8, "migEnabled": True}]


@dataclass
class MigNode:
    node: GpuNode
    nvml: Nvml
    manager: StandinMigManager


@pytest.fixture(scope="module")
def mig(sandbox: ControlPlane, kube: RawApi, device_classes: list[str]) -> Iterator[MigNode]:
    name = unique("mig-node")
    root = Path(tempfile.mkdtemp(prefix="gkm-"))
    nvml = open_nvml("fake", write_node(root, H100X8_MIG, name))
    manager = StandinMigManager(nvml).serve(root / "mig.sock")
    try:
        node = start_gpu_node(
            sandbox,
            H100X8_MIG,
            name=name,
            root=root,
            extra=("--dynamic-mig", "--mig-manager-socket", str(root / "mig.sock")),
        )
        yield MigNode(node, nvml, manager)
        stop_gpu_node(node, kube)
    finally:
        manager.stop()
        nvml.close()
        shutil.rmtree(root, ignore_errors=True)


def test_200_placements_are_split_across_slices(mig: MigNode, kube: RawApi) -> None:
    def five() -> list[Obj] | None:
        found = mig.node.slices(kube)
        return found if len(found) == 5 else None

    slices = wait_for(five, 20, "five slices")
    pools = {
        (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices
    }
    assert len(pools) == 1 and next(iter(pools))[1] == 5
    counters = [s for s in slices if s["spec"].get("sharedCounters")]
    devices = [s for s in slices if s["spec"].get("devices")]
    assert len(counters) == 1 and len(counters[0]["spec"]["sharedCounters"]) == 8
    assert sorted(len(s["spec"]["devices"]) for s in devices) == [8, 64, 64, 64]
    names = {d["name"] for s in devices for d in s["spec"]["devices"]}
    assert len(names) == 200 and "gpu-3-mig-1g-10gb-me-6" in names


def test_placements_are_allocated_through_counters_and_created_at_prepare(
    mig: MigNode, kube: RawApi, namespace: str
) -> None:
    node = mig.node.name
    for name, profile in (("big", "4g.40gb"), ("half", "3g.40gb"), ("small", "1g.10gb")):
        selector = (
            f'device.attributes["gpu.gpuslice.dev"].index == 0 && '
            f'device.attributes["gpu.gpuslice.dev"].profile == "{profile}"'
        )
        kube.create(
            resource_path(RESOURCE, "resourceclaimtemplates", namespace=namespace),
            claim_template(namespace, name, "mig.gpuslice.dev", selector=selector),
        )
    pods: dict[str, Obj] = {}
    for name in ("big", "half"):
        kube.create(
            resource_path("v1", "pods", namespace=namespace),
            gpu_pod(namespace, name, node, template=name),
        )
        pods[name] = wait_pod_phase(kube, namespace, name, "Running", timeout=30)
    # the 4g instance takes slices 0-3, so the scheduler can only place the 3g one at 4
    assert allocated_devices(kube, namespace, pods["big"]) == ["gpu-0-mig-4g-40gb-0"]
    assert allocated_devices(kube, namespace, pods["half"]) == ["gpu-0-mig-3g-40gb-4"]
    instances = {m.profile: m for m in mig.nvml.mig_devices(0)}
    assert sorted(instances) == ["3g.40gb", "4g.40gb"]
    [got] = pod_devices(mig.node, pods["half"])
    assert got["UUID"] == instances["3g.40gb"].uuid

    # 4 + 3 compute slices: a 1g instance no longer fits on GPU 0
    kube.create(
        resource_path("v1", "pods", namespace=namespace),
        gpu_pod(namespace, "small", node, template="small"),
    )

    def unschedulable() -> Obj | None:
        pod = get_pod(kube, namespace, "small")
        cond = condition(pod, "PodScheduled") if pod else None
        return cond if cond and cond["status"] == "False" else None

    assert "cannot allocate all claims" in wait_for(unschedulable, 30, "Unschedulable")["message"]

    kube.delete(resource_path("v1", "pods", namespace=namespace, name="big"))
    wait_pod_gone(kube, namespace, "big")
    wait_for(
        lambda: "4g.40gb" not in {m.profile for m in mig.nvml.mig_devices(0)},
        10,
        "the 4g instance to be destroyed",
    )
    small = wait_pod_phase(kube, namespace, "small", "Running", timeout=40)
    assert allocated_devices(kube, namespace, small)[0].startswith("gpu-0-mig-1g-10gb-")
