"""The kubelet plugin refuses a node whose GPUs other GPU software manages (issue 29;
services/kubelet-plugin/src/gpuslice_kubelet_plugin/coexist.py), as a real process against the
sandbox's API server: exit status 3, a Warning Event ``KubeletPluginRefused`` on the Node that
names the cause and the fix, a log line, and nothing published. Then the fix lets it start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import RESOURCE, delete_node_slices, node_slices
from e2e.sandbox.nodeagent.testing import wait_for
from e2e.support.kubelet_plugin import Processes
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.core import ServiceExitedError
from gpuslice_testkit.kubelet_plugin.harness import Node

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def processes(
    sandbox: ControlPlane, kube: RawApi, short_dir: Path, fake_node: Node, node_name: str
) -> Iterator[Processes]:
    made = Processes(sandbox, short_dir, fake_node, node_name)
    kube.create(
        resource_path("v1", "nodes"),
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node_name}},
    )
    yield made
    for p in made.started:
        p.stop()
    delete_node_slices(kube, node_name)
    kube.delete(resource_path("v1", "nodes", name=node_name))


def refusals(kube: RawApi, node: str) -> list[str]:
    events = kube.list(
        resource_path("v1", "events", namespace="default"),
        field_selector=f"involvedObject.name={node},reason=KubeletPluginRefused",
    )["items"]
    return [str(e["message"]) for e in events if e["type"] == "Warning"]


def test_another_driver_with_the_same_gpus_refuses_the_plugin(
    processes: Processes, kube: RawApi, fake_node: Node, node_name: str
) -> None:
    uuid = fake_node.nvml.gpus()[1].uuid
    other: Obj = {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": {"generateName": f"{node_name}-gpu.nvidia.com-"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-1",
                    "attributes": {"uuid": {"string": uuid}, "type": {"string": "gpu"}},
                }
            ],
        },
    }
    made = kube.create(resource_path(RESOURCE, "resourceslices"), other)
    with pytest.raises(ServiceExitedError, match="exited with 3"):
        processes.start()
    wait_for(lambda: refusals(kube, node_name) or None, 20, "the KubeletPluginRefused event")
    [message] = refusals(kube, node_name)
    assert f"another DRA driver publishes GPUs of node {node_name}" in message
    assert f"(gpu.nvidia.com: {uuid})" in message
    assert "refusing to start: other GPU software manages" in processes.started[-1].tail()
    assert [s["spec"]["driver"] for s in node_slices(kube, node_name)] == ["gpu.nvidia.com"]

    # the other driver leaves the node: the plugin starts
    kube.delete(resource_path(RESOURCE, "resourceslices", name=made["metadata"]["name"]))
    processes.start()


def test_the_operators_mig_label_refuses_the_plugin_until_its_manager_is_kept_off(
    processes: Processes, kube: RawApi, node_name: str
) -> None:
    node = resource_path("v1", "nodes", name=node_name)
    kube.patch(node, {"metadata": {"labels": {"nvidia.com/mig.config": "all-balanced"}}})
    with pytest.raises(ServiceExitedError, match="exited with 3"):
        processes.start()
    wait_for(lambda: refusals(kube, node_name) or None, 20, "the KubeletPluginRefused event")
    [message] = refusals(kube, node_name)
    assert message.startswith(f"node {node_name} is labelled nvidia.com/mig.config=all-balanced")
    assert f"kubectl label node {node_name} nvidia.com/gpu.deploy.mig-manager=false" in message
    assert node_slices(kube, node_name) == []

    kube.patch(node, {"metadata": {"labels": {"nvidia.com/gpu.deploy.mig-manager": "false"}}})
    processes.start()
