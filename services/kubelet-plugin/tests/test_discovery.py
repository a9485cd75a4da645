"""The device model built from the fake NVML: names, attributes, capacity, MIG, counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslice_kubelet_plugin.discovery import discover, dns_label, semver
from gpuslice_kubelet_plugin.enforcer import GpuEnforcement
from gpuslice_nvml import open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_testkit.kubelet_plugin.harness import Node, write_node


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("570.158.01", "570.158.1"),
        ("12.8", "12.8.0"),
        ("9.0", "9.0.0"),
        ("1.2.3.4", None),
        ("r570", None),
        ("535", "535.0.0"),
    ],
)
def test_versions_become_strict_semver(raw: str, expected: str | None) -> None:
    assert semver(raw) == expected


def test_profile_names_become_dns_labels() -> None:
    assert dns_label("1g.10gb") == "1g-10gb"
    assert dns_label("1g.10gb+me") == "1g-10gb-me"
    assert dns_label("1c.3g.40gb") == "1c-3g-40gb"


def test_whole_gpus_and_static_mig_devices(node: Node) -> None:
    inventory = discover(node.nvml)
    names = [d.name for d in inventory.devices]
    assert names == ["gpu-0", "gpu-1", "gpu-2-mig-1g-10gb-0", "gpu-2-mig-3g-40gb-4"]
    gpu0 = inventory.get("gpu-0")
    assert gpu0 is not None
    api = gpu0.api()
    info = node.nvml.gpu(0)
    assert api["allowMultipleAllocations"] is True
    attrs = api["attributes"]
    assert attrs["type"] == {"string": "gpu"}
    assert attrs["uuid"] == {"string": info.uuid}
    assert attrs["index"] == {"int": 0}
    assert attrs["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attrs["architecture"] == {"string": "Hopper"}
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attrs["driverVersion"] == {"version": "570.158.1"}
    assert attrs["cudaDriverVersion"] == {"version": "12.8.0"}
    assert attrs["multiprocessors"] == {"int": 132}
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": info.pci_bus_id}
    assert attrs["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert "enforcement" not in attrs
    assert api["capacity"]["cores"] == {
        "value": "100",
        "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
    }
    assert api["capacity"]["memory"]["value"] == "81559Mi"
    assert api["capacity"]["memory"]["requestPolicy"] == {
        "default": "81559Mi",
        "validRange": {"min": "1Mi", "max": "81559Mi", "step": "1Mi"},
    }
    assert len(attrs) + len(api["capacity"]) <= 32

    mig = inventory.get("gpu-2-mig-3g-40gb-4")
    assert mig is not None and mig.mig is not None
    mapi = mig.api()
    assert "allowMultipleAllocations" not in mapi
    assert mapi["attributes"]["type"] == {"string": "mig"}
    assert mapi["attributes"]["profile"] == {"string": "3g.40gb"}
    assert mapi["attributes"]["parentUUID"] == {"string": node.nvml.gpu(2).uuid}
    assert mapi["attributes"]["uuid"]["string"].startswith("MIG-")
    assert mapi["attributes"]["multiprocessors"] == {"int": 60}
    # NVIDIA's capacities, so CEL such as device.capacity[...].copyEngines carries over
    assert {k: v["value"] for k, v in mapi["capacity"].items()} == {
        "memory": "40448Mi",
        "multiprocessors": "60",
        "copyEngines": "3",
        "decoders": "3",
        "encoders": "0",
        "jpegEngines": "3",
        "ofaEngines": "0",
    }
    assert len(mapi["attributes"]) + len(mapi["capacity"]) <= 32
    assert "addressingMode" not in mapi["attributes"]  # not a coherent-memory system
    assert mig.mig.gpu_instance_id is not None and not mig.mig.dynamic


def test_addressing_mode_is_published_on_coherent_systems(tmp_path: Path) -> None:
    gpus: list[dict[str, Any]] = [
        {"model": "H100", "addressingMode": "ATS"},
        {
            "model": "H100",
            "migEnabled": True,
            "addressingMode": "ATS",
            "migInstances": [{"profile": "7g.80gb"}],
        },
    ]
    with open_nvml("fake", write_node(tmp_path, gpus, "gh")) as nvml:
        inventory = discover(nvml)
    for device in inventory.devices:  # a MIG device carries its parent's, as with NVIDIA
        assert device.attributes["addressingMode"] == {"string": "ATS"}, device.name


def test_enforcement_level_and_mechanisms_become_attributes(node: Node) -> None:
    uuid0 = node.nvml.gpu(0).uuid
    granted = GpuEnforcement(level="soft", memory="memory-partition", cores="watchdog")
    inventory = discover(node.nvml, enforcement={uuid0: granted})
    gpu0 = inventory.get("gpu-0")
    assert gpu0 is not None and gpu0.attributes["enforcement"] == {"string": "soft"}
    assert gpu0.attributes["memoryEnforcement"] == {"string": "memory-partition"}
    assert gpu0.attributes["coresEnforcement"] == {"string": "watchdog"}
    gpu1 = inventory.get("gpu-1")
    assert gpu1 is not None and "enforcement" not in gpu1.attributes


def test_dynamic_mig_publishes_every_placement_with_counters(tmp_path: Path) -> None:
    config = write_node(tmp_path, [{"model": "H100", "migEnabled": True}], "dyn")
    with open_nvml("fake", config) as nvml:
        inventory = discover(nvml, dynamic_mig_enabled=True)
    names = [d.name for d in inventory.devices]
    assert len(names) == 7 + 7 + 4 + 3 + 2 + 1 + 1
    assert "gpu-0-mig-1g-10gb-me-3" in names and "gpu-0-mig-7g-80gb-0" in names
    [cset] = inventory.counter_sets
    assert cset.name == "gpu-0-counter-set"
    assert cset.counters == {
        **{f"memory-slice-{i}": 1 for i in range(8)},
        "compute-slices": 7,
        "1g-10gb-me-instances": 1,
    }
    dev = inventory.get("gpu-0-mig-3g-40gb-4")
    assert dev is not None
    [consumes] = dev.api()["consumesCounters"]
    assert consumes["counterSet"] == "gpu-0-counter-set"
    assert consumes["counters"] == {
        **{f"memory-slice-{i}": {"value": "1"} for i in range(4, 8)},
        "compute-slices": {"value": "3"},
    }
    me = inventory.get("gpu-0-mig-1g-10gb-me-3")
    assert me is not None
    assert me.api()["consumesCounters"][0]["counters"]["1g-10gb-me-instances"] == {"value": "1"}
    assert me.uuid == "" and me.mig is not None and me.mig.dynamic


def test_a_lost_gpu_keeps_its_devices(node: Node) -> None:
    first = discover(node.nvml)
    FakeNvmlControl.from_config_file(node.config).mark_gpu_lost(1)
    again = discover(node.nvml, previous=first)
    assert [d.name for d in again.devices] == [d.name for d in first.devices]
    without_previous = discover(node.nvml)
    assert "gpu-1" not in [d.name for d in without_previous.devices]
