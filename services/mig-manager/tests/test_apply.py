"""Layouts on an 8x A100-SXM4-40GB fake node: apply, re-apply, switch, wait for busy instances."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from gpuslice_mig_manager.apply import LayoutState, apply_layout
from gpuslice_mig_manager.layouts import LayoutConfig, parse_layouts
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.state import open_store
from gpuslice_nvml import MigMode, Placement
from gpuslice_nvml.errors import ERROR_NO_PERMISSION, nvml_error
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl, load_node

from .conftest import BOOT_ID

pytestmark = pytest.mark.timeout(30)


def layout_of(fake: FakeNvml, gpu: int) -> list[tuple[str, int]]:
    """(MIG device profile, placement start) of every MIG device on a GPU."""
    return sorted((d.profile, d.placement.start) for d in fake.mig_devices(gpu))


def total_instances(fake: FakeNvml) -> int:
    return sum(len(fake.gpu_instances(i)) for i in range(fake.device_count()))


def test_all_1g_5gb_makes_56_instances(
    fake: FakeNvml, manager: MigManager, layouts: LayoutConfig
) -> None:
    assert not fake.gpu(0).mig_enabled
    result = apply_layout(manager, "all-1g.5gb", layouts)

    assert result.state is LayoutState.SUCCESS, result.message
    assert result.changed
    assert total_instances(fake) == 56
    for gpu in range(8):
        assert fake.mig_mode(gpu).current
        assert layout_of(fake, gpu) == [("1g.5gb", s) for s in range(7)]
    assert sum(len(c.created) for c in result.gpus) == 56
    assert "56 instances created" in result.message
    records = manager.state().instances
    assert len(records) == 56
    assert {r.layout for r in records.values()} == {"all-1g.5gb"}
    assert not manager.state().intents


def test_reapplying_a_layout_changes_nothing(
    fake: FakeNvml, manager: MigManager, layouts: LayoutConfig
) -> None:
    apply_layout(manager, "all-1g.5gb", layouts)
    uuids = {d.uuid for i in range(8) for d in fake.mig_devices(i)}

    again = apply_layout(manager, "all-1g.5gb", layouts)

    assert again.state is LayoutState.SUCCESS
    assert not again.changed
    assert all(not c.created and not c.destroyed for c in again.gpus)
    assert {d.uuid for i in range(8) for d in fake.mig_devices(i)} == uuids


def test_switching_to_all_balanced_destroys_and_recreates(
    fake: FakeNvml, manager: MigManager, layouts: LayoutConfig
) -> None:
    apply_layout(manager, "all-1g.5gb", layouts)

    result = apply_layout(manager, "all-balanced", layouts)

    assert result.state is LayoutState.SUCCESS, result.message
    assert total_instances(fake) == 32
    for gpu in range(8):
        devices = layout_of(fake, gpu)
        assert Counter(p for p, _ in devices) == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
        # Two of the existing 1g.5gb are kept; the 3g.20gb has to go to slices 4-7 for them.
        assert devices == [("1g.5gb", 0), ("1g.5gb", 1), ("2g.10gb", 2), ("3g.20gb", 4)]
    change = result.gpus[0]
    assert len(change.destroyed) == 5 and len(change.created) == 2
    assert {i.profile_name for i in change.destroyed} == {"1g.5gb"}
    records = manager.state().instances
    assert len(records) == 32
    assert {r.layout for r in records.values()} == {"all-balanced"}
    uuid = manager.nvml.gpu(0).uuid
    labels = {"gpu": "0", "UUID": uuid, "GPU_I_PROFILE": "1g.5gb"}
    assert manager.metrics.registry.get_sample_value("gpuslice_mig_manager_instances", labels) == 2


def test_all_balanced_from_scratch_needs_placement_search(
    fake: FakeNvml, manager: MigManager, layouts: LayoutConfig
) -> None:
    # Lowest-start-first would put the 3g.20gb at 0 and leave room for one 1g.5gb only.
    result = apply_layout(manager, "all-balanced", layouts)

    assert result.state is LayoutState.SUCCESS, result.message
    assert layout_of(fake, 3) == [("1g.5gb", 2), ("1g.5gb", 3), ("2g.10gb", 0), ("3g.20gb", 4)]


def test_an_instance_in_use_blocks_the_switch_until_it_is_free(
    fake: FakeNvml, control: FakeNvmlControl, manager: MigManager, layouts: LayoutConfig
) -> None:
    apply_layout(manager, "all-1g.5gb", layouts)
    busy = next(d for d in fake.mig_devices(2) if d.placement.start == 4)
    control.add_process(4242, busy.uuid, used_memory_bytes=1 << 30)

    waiting = apply_layout(manager, "all-balanced", layouts)

    assert waiting.state is LayoutState.PENDING
    change = waiting.gpus[2]
    assert "GPU instance" in change.waiting and "1g.5gb at 4:1" in change.waiting
    assert "processes 4242" in change.waiting
    assert "GPU 2:" in waiting.message and "4242" in waiting.message
    assert layout_of(fake, 2) == [("1g.5gb", s) for s in range(7)]  # untouched while it waits
    assert all(c.state is LayoutState.SUCCESS for c in waiting.gpus if c.gpu_index != 2)

    control.remove_process(4242)
    done = apply_layout(manager, "all-balanced", layouts)

    assert done.state is LayoutState.SUCCESS, done.message
    assert Counter(p for p, _ in layout_of(fake, 2)) == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    assert [c.gpu_index for c in done.gpus if c.changed] == [2]


def test_a_busy_instance_the_new_layout_can_use_is_kept(
    fake: FakeNvml, control: FakeNvmlControl, manager: MigManager, layouts: LayoutConfig
) -> None:
    apply_layout(manager, "all-1g.5gb", layouts)
    busy = next(d for d in fake.mig_devices(0) if d.placement.start == 3)
    control.add_process(7, busy.uuid)

    result = apply_layout(manager, "all-balanced", layouts)

    assert result.state is LayoutState.SUCCESS, result.message
    assert busy.uuid in {d.uuid for d in fake.mig_devices(0)}


def test_an_instance_held_by_a_claim_blocks_the_switch(
    fake: FakeNvml, make_manager: object, layouts: LayoutConfig
) -> None:
    assert callable(make_manager)
    manager: MigManager = make_manager(dynamic=True)
    apply_layout(manager, "all-enabled", layouts)
    gpu = fake.gpu(0)
    manager.create_instance(gpu.uuid, "7g.40gb", 0, "claim-7")

    result = apply_layout(manager, "all-1g.5gb", layouts)

    assert result.state is LayoutState.PENDING
    assert "claim claim-7" in result.gpus[0].waiting
    assert [d.profile for d in fake.mig_devices(0)] == ["7g.40gb"]

    gi = fake.gpu_instances(0)[0].id
    manager.destroy_instance(gpu.uuid, gi, "claim-7")
    assert apply_layout(manager, "all-1g.5gb", layouts).state is LayoutState.SUCCESS


def test_all_disabled_turns_mig_off(
    fake: FakeNvml, manager: MigManager, layouts: LayoutConfig
) -> None:
    apply_layout(manager, "all-1g.5gb", layouts)

    result = apply_layout(manager, "all-disabled", layouts)

    assert result.state is LayoutState.SUCCESS, result.message
    assert all(not fake.mig_mode(i).current for i in range(8))
    assert not manager.state().instances


def test_a_profile_the_gpu_lacks_fails_listing_the_supported_ones(
    manager: MigManager,
) -> None:
    config = parse_layouts(
        "version: v1\nmig-configs:\n  h100:\n    - devices: [1]\n      mig-enabled: true\n"
        "      mig-devices: {'1g.10gb+me': 1, '3g.40gb': 1}\n"
    )

    result = apply_layout(manager, "h100", config)

    assert result.state is LayoutState.FAILED
    error = result.gpus[0].error
    assert "has no MIG profile '1g.10gb+me', '3g.40gb'" in error
    assert "1g.5gb, 1g.5gb+me, 1g.10gb, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb" in error
    assert [c.gpu_index for c in result.gpus] == [1]


def test_a_layout_that_does_not_fit_fails_with_the_reason(manager: MigManager) -> None:
    config = parse_layouts(
        "version: v1\nmig-configs:\n  too-much:\n    - devices: all\n      mig-enabled: true\n"
        "      mig-devices: {'3g.20gb': 2, '1g.5gb': 1}\n"
    )

    result = apply_layout(manager, "too-much", config)

    assert result.state is LayoutState.FAILED
    assert "does not fit" in result.gpus[0].error


def test_an_unknown_layout_fails_listing_the_layouts(
    manager: MigManager, layouts: LayoutConfig
) -> None:
    result = apply_layout(manager, "all-9g.99gb", layouts)

    assert result.state is LayoutState.FAILED
    assert "no layout named 'all-9g.99gb'" in result.message
    assert "all-balanced" in result.message


def test_dry_run_changes_nothing(
    fake: FakeNvml, manager: MigManager, layouts: LayoutConfig
) -> None:
    result = apply_layout(manager, "all-balanced", layouts, dry_run=True)

    assert result.state is LayoutState.SUCCESS
    assert not result.changed
    assert sum(len(c.created) for c in result.gpus) == 32
    assert all(c.reset_required for c in result.gpus)
    assert not fake.mig_mode(0).current


def test_compute_instance_profiles_in_a_layout(fake: FakeNvml, manager: MigManager) -> None:
    config = parse_layouts(
        "version: v1\nmig-configs:\n  ci:\n    - devices: [0]\n      mig-enabled: true\n"
        "      mig-devices: {'1c.3g.20gb': 1, '3g.20gb': 1}\n"
    )

    result = apply_layout(manager, "ci", config)

    assert result.state is LayoutState.SUCCESS, result.message
    assert sorted(d.profile for d in fake.mig_devices(0)) == ["1c.3g.20gb", "3g.20gb"]
    assert apply_layout(manager, "ci", config).changed is False


def test_gpus_not_selected_are_left_alone(fake: FakeNvml, manager: MigManager) -> None:
    config = parse_layouts(
        "version: v1\nmig-configs:\n  two:\n    - devices: [0, 5]\n      mig-enabled: true\n"
        "      mig-devices: {'7g.40gb': 1}\n"
    )

    result = apply_layout(manager, "two", config)

    assert [c.gpu_index for c in result.gpus] == [0, 5]
    assert [i.placement for i in fake.gpu_instances(5)] == [Placement(0, 8)]
    assert not fake.mig_mode(1).current


def test_metrics_count_creates_destroys_and_applies(
    manager: MigManager, layouts: LayoutConfig
) -> None:
    apply_layout(manager, "all-7g.40gb", layouts)
    apply_layout(manager, "all-4g.20gb", layouts)

    def value(name: str, **labels: str) -> float | None:
        return manager.metrics.registry.get_sample_value(name, labels)

    assert value("gpuslice_mig_manager_create_instance_total", result="success") == 16
    assert value("gpuslice_mig_manager_destroy_instance_total", result="success") == 8
    assert value("gpuslice_mig_manager_apply_layout_total", result="success") == 2
    assert value("gpuslice_mig_manager_apply_layout_duration_seconds_count", result="success") == 2
    seven = {"gpu": "7", "UUID": manager.nvml.gpu(7).uuid}
    assert value("gpuslice_mig_manager_instances", **seven, GPU_I_PROFILE="4g.20gb") == 1
    assert value("gpuslice_mig_manager_instances", **seven, GPU_I_PROFILE="7g.40gb") == 0


def test_a_failed_gpu_reset_means_rebooting(
    node_config: Path, tmp_path: Path, layouts: LayoutConfig
) -> None:
    class NoReset(FakeNvml):
        def reset_gpu(self, gpu: int) -> MigMode:
            raise nvml_error(ERROR_NO_PERMISSION, f"GPU reset (GPU {gpu})", "not allowed here")

    fake = NoReset(load_node(node_config))
    manager = MigManager(fake, open_store(tmp_path / "state", boot_id=BOOT_ID))

    result = apply_layout(manager, "all-1g.5gb", layouts)

    assert result.state is LayoutState.REBOOTING
    change = result.gpus[0]
    assert change.reset_required and change.reboot_required
    assert "reset the GPU or reboot the node" in change.waiting
    assert fake.mig_mode(0) == MigMode(current=False, pending=True)
    assert "needs a GPU reset or a node reboot" in result.message
