from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuslice_device_plugin.devices import DiscoveryError, Resource, discover
from gpuslice_nvml import Nvml
from gpuslice_testkit.device_plugin import H100_MIXED, H100X8_NVLINK, settings

Factory = Callable[[dict[str, Any]], Nvml]


def counts(resources: list[Resource]) -> dict[str, int]:
    return {r.name: len(r.devices) for r in resources}


def test_none_strategy_gpus_by_uuid_with_numa(fake_node: Factory) -> None:
    nvml = fake_node(H100X8_NVLINK)
    [gpu] = discover(nvml, settings())
    assert gpu.name == "nvidia.com/gpu"
    assert gpu.socket_name == "gpuslice-gpu.sock"
    assert [d.id for d in gpu.devices] == [g.uuid for g in nvml.gpus()]
    assert [d.numa_node for d in gpu.devices] == [0] * 4 + [1] * 4


def test_index_strategy(fake_node: Factory) -> None:
    [gpu] = discover(fake_node(H100X8_NVLINK), settings("", "--device-id-strategy=index"))
    assert [d.id for d in gpu.devices] == [str(i) for i in range(8)]


def test_none_strategy_counts_mig_gpus_whole(fake_node: Factory) -> None:
    assert counts(discover(fake_node(H100_MIXED), settings())) == {"nvidia.com/gpu": 4}


def test_mixed_strategy(fake_node: Factory) -> None:
    nvml = fake_node(H100_MIXED)
    found = discover(nvml, settings("flags: {migStrategy: mixed}"))
    assert counts(found) == {
        "nvidia.com/gpu": 2,
        "nvidia.com/mig-1g.10gb": 4,
        "nvidia.com/mig-3g.40gb": 2,
    }
    mig = {r.name: r for r in found}["nvidia.com/mig-3g.40gb"]
    assert mig.socket_name == "gpuslice-mig-3g.40gb.sock"
    assert all(d.id.startswith("MIG-") and d.gpu_instance_id is not None for d in mig.devices)
    indexed = discover(nvml, settings("flags: {migStrategy: mixed}", "--device-id-strategy=index"))
    ids = {r.name: [d.id for d in r.devices] for r in indexed}
    assert ids["nvidia.com/gpu"] == ["0", "1"]
    assert sorted(ids["nvidia.com/mig-1g.10gb"] + ids["nvidia.com/mig-3g.40gb"]) == [
        "2:0",
        "2:1",
        "2:2",
        "3:0",
        "3:1",
        "3:2",
    ]


def test_single_strategy(fake_node: Factory) -> None:
    doc = {"gpus": [{"model": "H100", "count": 2, "migEnabled": True,
                     "migInstances": [{"profile": "1g.10gb", "count": 7}]}]}  # fmt: skip
    assert counts(discover(fake_node(doc), settings("flags: {migStrategy: single}"))) == {
        "nvidia.com/gpu": 14
    }


def test_single_strategy_refuses_mixed_layouts(fake_node: Factory) -> None:
    with pytest.raises(DiscoveryError, match=r"GPUs \[0, 1\] are not"):
        discover(fake_node(H100_MIXED), settings("flags: {migStrategy: single}"))
    two = [{"profile": "1g.10gb"}, {"profile": "3g.40gb"}]
    doc = {"gpus": [{"model": "H100", "migEnabled": True, "migInstances": two}]}
    with pytest.raises(DiscoveryError, match="one MIG profile"):
        discover(fake_node(doc), settings("flags: {migStrategy: single}"))


def test_single_strategy_without_mig_gpus_is_none(fake_node: Factory) -> None:
    found = discover(fake_node(H100X8_NVLINK), settings("flags: {migStrategy: single}"))
    assert counts(found) == {"nvidia.com/gpu": 8}


def test_time_slicing_replicas(fake_node: Factory) -> None:
    nvml = fake_node(H100X8_NVLINK)
    cfg = "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}"
    [gpu] = discover(nvml, settings(cfg))
    assert gpu.name == "nvidia.com/gpu" and gpu.replicas == 4
    first = nvml.gpu(0).uuid
    assert [d.id for d in gpu.devices[:4]] == [f"{first}::{n}" for n in range(4)]
    assert len(gpu.devices) == 32
    assert gpu.devices[5].visible == nvml.gpu(1).uuid


def test_time_slicing_rename_by_default(fake_node: Factory) -> None:
    cfg = (
        "sharing: {timeSlicing: {renameByDefault: true,"
        " resources: [{name: nvidia.com/gpu, replicas: 2}]}}"
    )
    [gpu] = discover(fake_node(H100X8_NVLINK), settings(cfg))
    assert gpu.name == "nvidia.com/gpu.shared"
    assert gpu.socket_name == "gpuslice-gpu.shared.sock"
