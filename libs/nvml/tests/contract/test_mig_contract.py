"""MIG as every backend reports it (read-only)."""

from __future__ import annotations

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml import profiles as p
from gpuslice_nvml.interface import Nvml


def test_profiles(nvml: Nvml) -> None:
    for gpu in nvml.gpus():
        if not gpu.mig_capable:
            with pytest.raises(e.NvmlNotSupported):
                nvml.gpu_instance_profiles(gpu.index)
            assert nvml.mig_devices(gpu.index) == []
            continue
        profiles = nvml.gpu_instance_profiles(gpu.index)
        assert profiles
        assert len({pr.id for pr in profiles}) == len(profiles)
        for profile in profiles:
            name = p.gi_profile_name(
                profile.nvml_profile, profile.memory_mib, gpu.memory_total_bytes
            )
            assert profile.name == name
            assert profile.slice_count == p.GI_PROFILE_SLICES[profile.nvml_profile]
            assert 1 <= profile.instance_count <= len(profile.placements)
            assert all(pl.size == profile.memory_slices for pl in profile.placements)
            assert 0 < profile.multiprocessors <= gpu.multiprocessors


def test_live_instances_agree_with_mig_devices(nvml: Nvml) -> None:
    mig_gpus = [g for g in nvml.gpus() if g.mig_enabled]
    if not mig_gpus:
        pytest.skip("no GPU in MIG mode")
    for gpu in mig_gpus:
        instances = {gi.id: gi for gi in nvml.gpu_instances(gpu.index)}
        devices = nvml.mig_devices(gpu.index)
        by_ids = {(d.gpu_instance_id, d.compute_instance_id): d for d in devices}
        for gi in instances.values():
            assert gi.placement in next(
                pr.placements
                for pr in nvml.gpu_instance_profiles(gpu.index)
                if pr.id == gi.profile_id
            )
            for ci in nvml.compute_instances(gpu.index, gi.id):
                device = by_ids[(gi.id, ci.id)]
                assert device.uuid == ci.uuid and ci.uuid.startswith("MIG-")
                assert device.profile == ci.profile_name
                assert device.profile.endswith(gi.profile_name)
                assert device.parent_uuid == gpu.uuid
                memory = nvml.memory_info(ci.uuid)
                assert 0 < memory.total < gpu.memory_total_bytes
            offered = {pr.id for pr in nvml.compute_instance_profiles(gpu.index, gi.id)}
            assert {ci.profile_id for ci in nvml.compute_instances(gpu.index, gi.id)} <= offered
        assert {d.gpu_instance_id for d in devices} <= set(instances)
        for profile in nvml.gpu_instance_profiles(gpu.index):
            assert 0 <= nvml.remaining_capacity(gpu.index, profile.id) <= profile.instance_count
