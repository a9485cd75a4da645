"""``gpuslice_mig_manager_instance_info`` as a scrape shows it: one series per live GPU
instance, its ``GPU_I_ID`` the id NVML reports, gone when the instance is destroyed."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from gpuslice_mig_manager.apply import LayoutState, apply_layout
from gpuslice_mig_manager.layouts import LayoutConfig
from gpuslice_mig_manager.manager import MigManager
from gpuslice_nvml.fake import FakeNvml

pytestmark = pytest.mark.timeout(30)

INFO = "gpuslice_mig_manager_instance_info"


def info(manager: MigManager, gpu: int) -> set[tuple[str, str, str]]:
    """(GPU_I_PROFILE, GPU_I_ID, layout) of GPU ``gpu``'s ``instance_info`` series, each 1."""
    uuid = manager.nvml.gpu(gpu).uuid
    found = set()
    for family in manager.metrics.registry.collect():
        for sample in family.samples:
            labels = sample.labels
            if sample.name == INFO and labels["gpu"] == str(gpu) and labels["UUID"] == uuid:
                assert sample.value == 1
                found.add((labels["GPU_I_PROFILE"], labels["GPU_I_ID"], labels["layout"]))
    return found


def nvml_says(fake: FakeNvml, gpu: int, layout: str) -> set[tuple[str, str, str]]:
    return {(gi.profile_name, str(gi.id), layout) for gi in fake.gpu_instances(gpu)}


def test_a_layout_instance_has_a_series_with_its_gpu_instance_id(
    fake: FakeNvml, manager: MigManager, layouts: LayoutConfig
) -> None:
    assert apply_layout(manager, "all-balanced", layouts).state is LayoutState.SUCCESS
    assert len(info(manager, 0)) == 4
    assert info(manager, 0) == nvml_says(fake, 0, "all-balanced")

    assert apply_layout(manager, "all-7g.40gb", layouts).state is LayoutState.SUCCESS
    assert info(manager, 0) == nvml_says(fake, 0, "all-7g.40gb")
    assert [p for p, _id, _layout in info(manager, 0)] == ["7g.40gb"]  # the 4 old ones are gone
    text = generate_latest(manager.metrics.registry).decode()
    assert text.count(f"{INFO}{{") == 8  # one per GPU, none left from the earlier layout


def test_an_on_demand_instance_is_seen_at_once_and_gone_when_destroyed(
    fake: FakeNvml, dynamic_manager: MigManager, layouts: LayoutConfig
) -> None:
    manager = dynamic_manager
    apply_layout(manager, "all-enabled", layouts)
    uuid = fake.gpu(0).uuid
    assert info(manager, 0) == set()

    created = manager.create_instance(uuid, "3g.20gb", 4, "claim-1").instance

    [gi] = fake.gpu_instances(0)
    assert created.gpu_instance_id == gi.id
    assert info(manager, 0) == {("3g.20gb", str(gi.id), "")}  # no list or reconcile needed
    manager.destroy_instance(uuid, gi.id, "claim-1")
    assert info(manager, 0) == set()
    assert (
        manager.metrics.registry.get_sample_value(
            "gpuslice_mig_manager_instances", {"gpu": "0", "UUID": uuid, "GPU_I_PROFILE": "3g.20gb"}
        )
        == 0
    )
