"""Device health in pod status (the kubelet's ResourceHealthStatus, docs/node-agent.md): the
node agent watches the real kubelet plugin's NodeWatchResources stream and writes
``containerStatuses[].allocatedResourcesStatus`` through the real API server, which validates
the field. One GPU node (two H100s on the fake NVML) serves the module; an XID injected through
the fake NVML control API makes the pod's device Unhealthy, recovery makes it Healthy again, and
a killed plugin leaves it Unknown until the plugin is back.

The decay of a device that is not refreshed within its timeout (30 s by default; the plugin does
not set a shorter one) is tested with a fake clock in test_nodeagent_units.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    DRIVER,
    RESOURCE,
    GpuNode,
    claim_template,
    start_gpu_node,
    stop_gpu_node,
)
from e2e.sandbox.nodeagent.testing import get_pod, wait_for, wait_pod_phase
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(60)

H100X2 = [{"model": "H100", "count": 2}]
# recovery: an XID taint clears after 1 quiet second, checked every 0.3 s
FLAGS = ("--health-streaming", "--xid-quiet-period", "1", "--health-check-interval", "0.3")
ON_GPU0 = 'device.attributes["gpu.gpuslice.dev"].index == 0'


@pytest.fixture(scope="module")
def node(sandbox: ControlPlane, kube: RawApi, device_classes: list[str]) -> Iterator[GpuNode]:
    gpu_node = start_gpu_node(sandbox, H100X2, extra=FLAGS)
    yield gpu_node
    stop_gpu_node(gpu_node, kube)


def gpu0_pod(kube: RawApi, namespace: str, node: GpuNode) -> Obj:
    """A running pod holding gpu-0: container ``main`` lists the claim, ``side`` names its
    request (so its status entry is ``claim:gpu/gpu``), ``plain`` lists none."""
    kube.create(
        resource_path(RESOURCE, "resourceclaimtemplates", namespace=namespace),
        claim_template(namespace, "gpu0", "gpu.gpuslice.dev", selector=ON_GPU0),
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": namespace},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu0"}],
            "containers": [
                {"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}},
                {
                    "name": "side",
                    "image": "busybox",
                    "resources": {"claims": [{"name": "gpu", "request": "gpu"}]},
                },
                {"name": "plain", "image": "busybox"},
            ],
        },
    }
    kube.create(resource_path("v1", "pods", namespace=namespace), pod)
    return wait_pod_phase(kube, namespace, "p", "Running", timeout=30)


def health_of(pod: Obj) -> dict[str, list[Obj]]:
    """Container name → its allocatedResourcesStatus."""
    return {
        cs["name"]: cs.get("allocatedResourcesStatus") or []
        for cs in pod["status"].get("containerStatuses") or []
    }


def wait_health(kube: RawApi, namespace: str, state: str, timeout: float = 15) -> Obj:
    """The pod once its ``main`` container shows the device in ``state``."""

    def check() -> Obj | None:
        pod = get_pod(kube, namespace, "p")
        assert pod is not None, "the pod is gone"
        entries = health_of(pod)["main"]
        states = [r["health"] for e in entries for r in e["resources"]]
        return pod if states == [state] else None

    return wait_for(check, timeout, f"the pod's device to show {state}")


def cdi_id(node: GpuNode, pod: Obj) -> str:
    """The first CDI id the plugin returned for the pod's claim (the agent's checkpoint)."""
    assert node.agent is not None
    claim = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    [(driver, device)] = node.agent.dra.driver_devices(pod["metadata"]["namespace"], claim)
    assert driver == DRIVER and device.device_name == "gpu-0"
    return device.cdi_device_ids[0]


def test_an_xid_makes_the_device_unhealthy_in_pod_status_and_recovery_healthy(
    node: GpuNode, kube: RawApi, namespace: str
) -> None:
    gpu0_pod(kube, namespace, node)
    pod = wait_health(kube, namespace, "Healthy")
    rid = cdi_id(node, pod)
    assert health_of(pod) == {
        "main": [
            {
                "name": "claim:gpu",
                "resources": [{"resourceID": rid, "health": "Healthy", "message": "healthy"}],
            }
        ],
        "side": [
            {
                "name": "claim:gpu/gpu",
                "resources": [{"resourceID": rid, "health": "Healthy", "message": "healthy"}],
            }
        ],
        "plain": [],
    }

    node.control.inject_xid(0, 79)
    pod = wait_health(kube, namespace, "Unhealthy")
    [entry] = health_of(pod)["main"]
    assert entry["resources"][0]["message"] == "XID 79 (NoSchedule)"
    assert health_of(pod)["side"][0]["resources"][0]["health"] == "Unhealthy"

    # 1 s without a repeat and the GPU answers: the plugin clears the taint
    pod = wait_health(kube, namespace, "Healthy")
    assert health_of(pod)["main"][0]["resources"][0]["message"] == "healthy"


def test_a_killed_plugin_leaves_the_device_unknown_until_it_is_back(
    node: GpuNode, kube: RawApi, namespace: str
) -> None:
    assert node.agent is not None
    gpu0_pod(kube, namespace, node)
    wait_health(kube, namespace, "Healthy")

    node.plugin.kill9()  # the stream fails: the driver's health is cleared
    pod = wait_health(kube, namespace, "Unknown")
    [entry] = health_of(pod)["main"]
    assert "message" not in entry["resources"][0]
    assert node.agent.device_health(DRIVER, node.name, "gpu-0") == ("Unknown", "")

    node.plugin.start()  # registers again: a new stream
    wait_health(kube, namespace, "Healthy", timeout=20)
