"""The fake's MIG rules: NVML's errors in NVML's situations.

Fixture node: GPU 0 is an H100 in MIG mode without instances, GPU 1 an H100 with MIG off,
GPU 2 an L4 (no MIG). H100 profile ids: 19 1g.10gb, 20 1g.10gb+me, 15 1g.20gb, 14 2g.20gb,
9 3g.40gb, 5 4g.40gb, 0 7g.80gb.
"""

from __future__ import annotations

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_nvml.types import Placement

P_1G, P_1G_ME, P_1G_2M, P_2G, P_3G, P_4G, P_7G = 19, 20, 15, 14, 9, 5, 0


def test_an_eighth_1g_instance_does_not_fit(fake: FakeNvml) -> None:
    assert fake.remaining_capacity(0, P_1G) == 7
    ids = [fake.create_gpu_instance(0, P_1G).id for _ in range(7)]
    assert sorted(ids) == list(range(7, 14))  # 1-slice instances are GPU instances 7..13
    assert fake.remaining_capacity(0, P_1G) == 0
    with pytest.raises(e.NvmlInsufficientResources) as info:
        fake.create_gpu_instance(0, P_1G)
    assert info.value.code == e.ERROR_INSUFFICIENT_RESOURCES == 23
    assert "1g.10gb allows 7 instances and 7 exist" in str(info.value)


def test_driver_places_at_the_highest_free_start(fake: FakeNvml) -> None:
    first = fake.create_gpu_instance(0, P_3G)
    second = fake.create_gpu_instance(0, P_3G)
    assert (first.id, first.placement) == (2, Placement(4, 4))
    assert (second.id, second.placement) == (1, Placement(0, 4))


def test_overlapping_placement_is_refused(fake: FakeNvml) -> None:
    fake.create_gpu_instance(0, P_3G, Placement(0, 4))
    with pytest.raises(e.NvmlInsufficientResources, match="overlaps GPU instance 1 at 0:4"):
        fake.create_gpu_instance(0, P_2G, Placement(2, 2))
    with pytest.raises(e.NvmlInsufficientResources):
        fake.create_gpu_instance(0, P_4G)  # its only placement, 0:4, is taken
    assert fake.create_gpu_instance(0, P_2G, Placement(4, 2)).id == 5


def test_placement_the_profile_lacks_is_an_invalid_argument(fake: FakeNvml) -> None:
    with pytest.raises(e.NvmlInvalidArgument, match=r"1:2 is not a placement of 2g\.20gb"):
        fake.create_gpu_instance(0, P_2G, Placement(1, 2))
    with pytest.raises(e.NvmlInvalidArgument, match="no GPU instance profile id 42"):
        fake.create_gpu_instance(0, 42)


def test_compute_slices_run_out(fake: FakeNvml) -> None:
    fake.create_gpu_instance(0, P_4G)
    fake.create_gpu_instance(0, P_3G)  # 4 + 3 = all 7 compute slices
    assert fake.remaining_capacity(0, P_1G) == 0
    with pytest.raises(e.NvmlInsufficientResources):
        fake.create_gpu_instance(0, P_1G)


def test_media_extensions_profile_is_limited_to_one(fake: FakeNvml) -> None:
    fake.create_gpu_instance(0, P_1G_ME)
    with pytest.raises(e.NvmlInsufficientResources, match=r"1g\.10gb\+me allows 1"):
        fake.create_gpu_instance(0, P_1G_ME)


def test_mig_calls_without_mig(fake: FakeNvml) -> None:
    with pytest.raises(e.NvmlNotSupported, match="MIG mode is not enabled"):
        fake.create_gpu_instance(1, P_1G)
    with pytest.raises(e.NvmlNotSupported, match="does not support MIG"):
        fake.gpu_instance_profiles(2)
    with pytest.raises(e.NvmlNotSupported):
        fake.mig_mode(2)
    assert fake.mig_devices(1) == [] and fake.mig_devices(2) == []
    # profiles are listed with MIG off, as current drivers do
    assert len(fake.gpu_instance_profiles(1)) == 7


def test_mig_mode_changes_wait_for_a_reset(fake: FakeNvml, control: FakeNvmlControl) -> None:
    mode = fake.set_mig_mode(1, True)
    assert (mode.current, mode.pending, mode.reset_required) == (False, True, True)
    with pytest.raises(e.NvmlNotSupported, match="pending a GPU reset"):
        fake.gpu_instances(1)
    control.add_process(100, 1, used_memory_bytes=1 << 30)
    with pytest.raises(e.NvmlInUse, match="processes 100"):
        fake.reset_gpu(1)
    control.remove_process(100)
    assert fake.reset_gpu(1).current is True
    assert fake.gpu(1).mig_enabled
    fake.create_gpu_instance(1, P_7G)
    with pytest.raises(e.NvmlInUse, match="GPU instances 0 exist"):
        fake.set_mig_mode(1, False)


def test_destroy_refuses_while_in_use(fake: FakeNvml, control: FakeNvmlControl) -> None:
    gi = fake.create_gpu_instance(0, P_3G)
    ci = fake.create_compute_instance(0, gi.id, 2)  # 3g.40gb, the whole instance
    with pytest.raises(e.NvmlInUse, match="holds compute instances 0"):
        fake.destroy_gpu_instance(0, gi.id)
    control.add_process(4242, ci.uuid, used_memory_bytes=1 << 30)
    with pytest.raises(e.NvmlInUse, match="processes 4242"):
        fake.destroy_compute_instance(0, gi.id, ci.id)
    control.remove_process(4242)
    fake.destroy_compute_instance(0, gi.id, ci.id)
    fake.destroy_gpu_instance(0, gi.id)
    assert fake.gpu_instances(0) == []
    with pytest.raises(e.NvmlNotFound):
        fake.destroy_gpu_instance(0, gi.id)


def test_compute_instances_and_mig_devices(fake: FakeNvml) -> None:
    gi = fake.create_gpu_instance(0, P_3G)
    profiles = fake.compute_instance_profiles(0, gi.id)
    assert [(p.id, p.name, p.instance_count) for p in profiles] == [
        (0, "1c.3g.40gb", 3),
        (1, "2c.3g.40gb", 1),
        (2, "3g.40gb", 1),
    ]
    cis = [fake.create_compute_instance(0, gi.id, 0) for _ in range(3)]
    assert [ci.id for ci in cis] == [0, 1, 2]
    with pytest.raises(e.NvmlInsufficientResources):
        fake.create_compute_instance(0, gi.id, 0)
    with pytest.raises(e.NvmlInvalidArgument, match="offers profiles"):
        fake.create_compute_instance(0, gi.id, 4)  # 7-slice compute instance in a 3g
    devices = fake.mig_devices(0)
    assert [d.profile for d in devices] == ["1c.3g.40gb"] * 3
    assert {d.uuid for d in devices} == {ci.uuid for ci in cis}
    assert all(d.parent_uuid == fake.gpu(0).uuid for d in devices)
    assert fake.memory_info(cis[0].uuid).total == 40448 * 1024 * 1024


def test_mig_uuids_are_deterministic(fake: FakeNvml, mixed_config: object) -> None:
    gi = fake.create_gpu_instance(0, P_7G)
    first = fake.create_compute_instance(0, gi.id, 4).uuid
    fake.destroy_compute_instance(0, gi.id, 0)
    assert fake.create_compute_instance(0, gi.id, 4).uuid == first
    assert first.startswith("MIG-")
    other = FakeNvml.from_config_file(str(mixed_config))
    assert other.mig_devices(0)[0].uuid == first


def test_mixed_compute_instances_in_a_3g(fake: FakeNvml) -> None:
    gi = fake.create_gpu_instance(0, P_3G)
    small = fake.create_compute_instance(0, gi.id, 0)  # 1c: the driver leaves room for a 2c
    large = fake.create_compute_instance(0, gi.id, 1)
    assert (small.placement, large.placement) == (Placement(2, 1), Placement(0, 2))
    assert [d.profile for d in fake.mig_devices(0)] == ["1c.3g.40gb", "2c.3g.40gb"]
