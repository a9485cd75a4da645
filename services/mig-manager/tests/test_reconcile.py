"""Start-up recovery of interrupted changes and periodic reconciliation (in process)."""

from __future__ import annotations

import pytest

from gpuslice_mig_manager.apply import apply_layout
from gpuslice_mig_manager.layouts import LayoutConfig
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.reconcile import reconcile, recover
from gpuslice_mig_manager.state import Intent
from gpuslice_nvml import Placement
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl

from .conftest import MakeManager

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def enabled(fake: FakeNvml, make_manager: MakeManager, layouts: LayoutConfig) -> FakeNvml:
    apply_layout(make_manager(), "all-enabled", layouts)
    return fake


def half_made(fake: FakeNvml, manager: MigManager, *, gpu: int, start: int) -> int:
    """What a kill -9 after create-GI leaves: an intent and a GPU instance without CI."""
    uuid = fake.gpu(gpu).uuid
    with manager.store.transaction() as st:
        intent = Intent(
            op="create",
            gpu_uuid=uuid,
            profile_id=14,
            profile_name="2g.10gb",
            placement_start=start,
            placement_size=2,
            owner="claim-z",
        )
        st.intents[intent.key] = intent
    return fake.create_gpu_instance(gpu, 14, Placement(start, 2)).id


def test_recover_rolls_back_a_half_made_instance(
    enabled: FakeNvml, make_manager: MakeManager
) -> None:
    manager = make_manager(dynamic=True)
    half_made(enabled, manager, gpu=0, start=2)

    done = recover(manager)

    assert len(done) == 1 and "rolled back GPU instance" in done[0]
    assert enabled.gpu_instances(0) == []
    assert not manager.state().intents and not manager.state().instances
    assert recover(manager) == []  # nothing left to settle


def test_recover_keeps_an_interrupted_instance_a_process_uses(
    enabled: FakeNvml, control: FakeNvmlControl, make_manager: MakeManager
) -> None:
    manager = make_manager(dynamic=True)
    gi = half_made(enabled, manager, gpu=1, start=0)
    ci = enabled.create_compute_instance(1, gi, enabled.compute_instance_profiles(1, gi)[-1].id)
    control.add_process(5, ci.uuid)

    done = recover(manager)

    assert "in use; kept and recorded" in done[0]
    record = manager.state().instances[f"{enabled.gpu(1).uuid}/{gi}"]
    assert record.owner == "claim-z"
    assert not manager.state().intents


def test_recover_drops_an_intent_that_never_reached_nvml(
    enabled: FakeNvml, make_manager: MakeManager
) -> None:
    manager = make_manager(dynamic=True)
    half_made(enabled, manager, gpu=0, start=4)
    enabled.destroy_gpu_instance(0, enabled.gpu_instances(0)[0].id)

    assert "nothing to undo" in recover(manager)[0]
    assert not manager.state().intents


def test_reconcile_destroys_unowned_orphans_only_with_dynamic_mig(
    enabled: FakeNvml, control: FakeNvmlControl, make_manager: MakeManager
) -> None:
    free = enabled.create_gpu_instance(2, 19, Placement(0, 1))
    enabled.create_compute_instance(2, free.id, 0)
    busy = enabled.create_gpu_instance(2, 19, Placement(1, 1))
    busy_ci = enabled.create_compute_instance(2, busy.id, 0)
    control.add_process(77, busy_ci.uuid)

    static = reconcile(make_manager())
    assert sorted(d.kind for d in static) == ["orphan", "orphan"]
    assert len(enabled.gpu_instances(2)) == 2

    dynamic = make_manager(dynamic=True)
    drifts = reconcile(dynamic)
    assert sorted(d.kind for d in drifts) == ["orphan-destroyed", "orphan-in-use"]
    assert "processes 77" in next(d.message for d in drifts if d.kind == "orphan-in-use")
    assert [gi.id for gi in enabled.gpu_instances(2)] == [busy.id]
    assert dynamic.metrics.drift.labels(kind="orphan-destroyed")._value.get() == 1

    assert reconcile(dynamic) == []  # a lasting drift is reported once


def test_reconcile_keeps_owned_instances_and_drops_vanished_records(
    enabled: FakeNvml, make_manager: MakeManager
) -> None:
    manager = make_manager(dynamic=True)
    uuid = enabled.gpu(3).uuid
    kept = manager.create_instance(uuid, "3g.20gb", 0, "claim-1").instance
    gone = manager.create_instance(uuid, "3g.20gb", 4, "claim-2").instance
    for ci in enabled.compute_instances(3, gone.gpu_instance_id):
        enabled.destroy_compute_instance(3, gone.gpu_instance_id, ci.id)
    enabled.destroy_gpu_instance(3, gone.gpu_instance_id)  # behind the manager's back

    drifts = reconcile(manager)

    assert [d.kind for d in drifts] == ["vanished"]
    assert "held by claim claim-2" in drifts[0].message
    assert list(manager.state().instances) == [kept.key]
    assert [gi.id for gi in enabled.gpu_instances(3)] == [kept.gpu_instance_id]
