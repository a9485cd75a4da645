"""The coexistence check's decision (``coexist.coexistence_refusal``); the Event and the exit
status against the real API server are in
e2e/tests/kubelet_plugin/test_kubelet_plugin_coexist.py."""

from __future__ import annotations

from typing import Any

from gpuslice_kubelet_plugin.coexist import coexistence_refusal

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def node(labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "labels": labels or {}}}


def a_slice(driver: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"spec": {"driver": driver, "nodeName": "n1", "devices": devices}}


def device(name: str, **attributes: str) -> dict[str, Any]:
    return {"name": name, "attributes": {k: {"string": v} for k, v in attributes.items()}}


def test_a_node_of_its_own_is_served() -> None:
    assert coexistence_refusal(node(), [], [GPU_A]) is None
    # our own slices, and other drivers' devices that are not our GPUs, are no reason
    ours = a_slice("gpu.gpuslice.dev", [device("gpu-0", uuid=GPU_A)])
    other = a_slice("gpu.nvidia.com", [device("gpu-1", uuid=GPU_B)])
    assert coexistence_refusal(node(), [ours, other], [GPU_A]) is None


def test_another_driver_publishing_the_same_gpu_is_refused() -> None:
    nvidia = a_slice("gpu.nvidia.com", [device("gpu-0", uuid=GPU_A, type="gpu")])
    reason = coexistence_refusal(node(), [nvidia], [GPU_A, GPU_B])
    assert reason is not None
    assert "another DRA driver publishes GPUs of node n1 in its ResourceSlices" in reason
    assert f"(gpu.nvidia.com: {GPU_A})" in reason
    assert "node.nodeSelector" in reason


def test_a_mig_device_of_our_gpu_counts_and_v1beta1_shapes_are_read() -> None:
    mig = {
        "name": "gpu-0-mig-1g10gb-19-0",
        "basic": {"attributes": {"parentUUID": {"string": GPU_B}, "uuid": {"string": "MIG-x"}}},
    }
    reason = coexistence_refusal(node(), [a_slice("hami-core-gpu.project-hami.io", [mig])], [GPU_B])
    assert reason is not None and "hami-core-gpu.project-hami.io: " + GPU_B in reason


def test_the_operators_mig_manager_is_refused_unless_it_is_kept_off_the_node() -> None:
    reason = coexistence_refusal(node({"nvidia.com/mig.config": "all-disabled"}), [], [GPU_A])
    assert reason is not None
    assert reason.startswith("node n1 is labelled nvidia.com/mig.config=all-disabled")
    assert "kubectl label node n1 nvidia.com/gpu.deploy.mig-manager=false" in reason
    assert "kubectl label node n1 nvidia.com/mig.config-" in reason
    kept_off = {
        "nvidia.com/mig.config": "all-disabled",
        "nvidia.com/gpu.deploy.mig-manager": "false",
    }
    assert coexistence_refusal(node(kept_off), [], [GPU_A]) is None
    # our own MIG label is ours
    assert (
        coexistence_refusal(node({"gpuslice.dev/mig.config": "all-1g.10gb"}), [], [GPU_A]) is None
    )
