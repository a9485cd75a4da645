"""The kubelet plugin's side of the per-node mode rule, on Node objects as the API returns them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from gpuslice_api.nodemode import device_plugin_resources, kubelet_plugin_refusal


def node(
    labels: Mapping[str, str] | None = None, capacity: Mapping[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"name": "gpu-1", "labels": dict(labels or {})},
        "status": {"capacity": {"cpu": "16", "memory": "64Gi", "pods": "110", **(capacity or {})}},
    }


def test_a_node_without_the_label_and_without_device_plugin_gpus_is_a_dra_node() -> None:
    assert kubelet_plugin_refusal(node()) is None
    assert kubelet_plugin_refusal(node({"gpuslice.dev/mode": "dra"})) is None
    assert kubelet_plugin_refusal({"metadata": {"name": "bare"}}) is None


def test_the_device_plugin_label_refuses_the_node() -> None:
    reason = kubelet_plugin_refusal(node({"gpuslice.dev/mode": "device-plugin"}))
    assert reason is not None
    assert reason.startswith("node gpu-1 is labelled gpuslice.dev/mode=device-plugin")
    assert "remove the label to switch the node to DRA" in reason


@pytest.mark.parametrize(
    "capacity",
    [
        {"nvidia.com/gpu": "8"},
        {"nvidia.com/gpu.shared": "32"},
        {"nvidia.com/mig-1g.10gb": "7", "nvidia.com/gpu": "0"},
    ],
)
def test_gpus_in_the_capacity_refuse_the_node(capacity: dict[str, str]) -> None:
    reason = kubelet_plugin_refusal(node(capacity=capacity))
    assert reason is not None
    listed = ", ".join(f"{k}={v}" for k, v in sorted(capacity.items()) if v != "0")
    assert f"node gpu-1 has {listed} in its capacity" in reason


def test_a_device_plugin_gone_for_good_leaves_zeros_that_do_not_count() -> None:
    assert kubelet_plugin_refusal(node(capacity={"nvidia.com/gpu": "0"})) is None
    # other vendors' resources are not GPUs of ours
    assert device_plugin_resources({"example.com/fpga": "2", "nvidia.com/gpux": "1"}) == {}
