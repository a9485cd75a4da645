"""MIG rules of the fake, applied to one GPU's state.

The checks and error codes are NVML's: a placement the profile does not offer is
INVALID_ARGUMENT; no room (instance count reached, placement taken, compute slices used up)
is INSUFFICIENT_RESOURCES; destroying something that still has compute instances or
processes is IN_USE; MIG calls without MIG mode are NOT_SUPPORTED. GPU-instance ids follow the
driver's memory-slice tree (a 7g instance is 0, 4-slice halves 1-2, 2-slice quarters 3-6,
1-slice eighths 7-14), and without an explicit placement the driver's choice is the free
placement with the highest start, as ``nvidia-smi mig -cgi`` shows on A100/H100. Compute
instances are placed the same way (so a 1c then a 2c fit in a 3g instance) and take the lowest
free compute-instance id.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake.catalog import COMPUTE_SLICES
from gpuslice_nvml.fake.state import CiState, GiState, GpuState, ProcessState
from gpuslice_nvml.types import ComputeInstanceProfile, GpuInstanceProfile, MigMode, Placement

if TYPE_CHECKING:
    from gpuslice_nvml.fake.node import FakeGpu

_SWIZZLE_BASE = {8: 0, 4: 1, 2: 3, 1: 7}


def gpu_instance_id(placement: Placement) -> int:
    """The driver's GPU-instance id for a placement (its node in the memory-slice tree)."""
    return _SWIZZLE_BASE[placement.size] + placement.start // placement.size


def require_capable(gpu: FakeGpu, what: str) -> None:
    if not gpu.model.mig_capable:
        raise e.nvml_error(
            e.ERROR_NOT_SUPPORTED, what, f"{gpu.model.product_name} does not support MIG"
        )


def require_enabled(gpu: FakeGpu, gs: GpuState, what: str) -> None:
    require_capable(gpu, what)
    if not gs.mig_current:
        hint = "; enabling is pending a GPU reset" if gs.mig_pending else ""
        raise e.nvml_error(e.ERROR_NOT_SUPPORTED, what, f"MIG mode is not enabled{hint}")


def set_mode(gpu: FakeGpu, gs: GpuState, enabled: bool) -> MigMode:
    what = f"nvmlDeviceSetMigMode(GPU {gpu.index}, {'enable' if enabled else 'disable'})"
    require_capable(gpu, what)
    if not enabled and gs.gpu_instances:
        ids = ", ".join(str(gi.id) for gi in gs.gpu_instances)
        raise e.nvml_error(e.ERROR_IN_USE, what, f"GPU instances {ids} exist; destroy them first")
    gs.mig_pending = enabled
    return MigMode(current=gs.mig_current, pending=gs.mig_pending)


def reset(gpu: FakeGpu, gs: GpuState, processes: Sequence[ProcessState]) -> MigMode:
    """A GPU reset: the pending MIG mode takes effect and MIG instances are gone."""
    what = f"GPU reset (GPU {gpu.index})"
    busy = [p.pid for p in processes if p.gpu == gpu.index]
    if busy:
        raise e.nvml_error(e.ERROR_IN_USE, what, f"processes {_ids(busy)} run on the GPU")
    gs.gpu_instances = []
    gs.mig_current = gs.mig_pending
    return MigMode(current=gs.mig_current, pending=gs.mig_pending)


def gi_profile(gpu: FakeGpu, profile_id: int, what: str) -> GpuInstanceProfile:
    profile = gpu.gi_profile(profile_id)
    if profile is None:
        known = ", ".join(f"{p.id} ({p.name})" for p in gpu.gi_profiles)
        raise e.nvml_error(
            e.ERROR_INVALID_ARGUMENT,
            what,
            f"{gpu.model.product_name} has no GPU instance profile id {profile_id}; ids: {known}",
        )
    return profile


def create_gi(
    gpu: FakeGpu, gs: GpuState, profile_id: int, placement: Placement | None = None
) -> GiState:
    call = "nvmlDeviceCreateGpuInstance" + ("WithPlacement" if placement else "")
    where = f", placement {placement}" if placement else ""
    what = f"{call}(GPU {gpu.index}, profile {profile_id}{where})"
    require_enabled(gpu, gs, what)
    profile = gi_profile(gpu, profile_id, what)
    if placement is not None and placement not in profile.placements:
        offered = ", ".join(str(p) for p in profile.placements)
        raise e.nvml_error(
            e.ERROR_INVALID_ARGUMENT,
            what,
            f"{placement} is not a placement of {profile.name}; it has {offered}",
        )
    same = [gi for gi in gs.gpu_instances if gi.profile_id == profile_id]
    if len(same) >= profile.instance_count:
        raise e.nvml_error(
            e.ERROR_INSUFFICIENT_RESOURCES,
            what,
            f"{profile.name} allows {profile.instance_count} instances and {len(same)} exist",
        )
    free_compute = COMPUTE_SLICES - _compute_slices_used(gpu, gs)
    if profile.slice_count > free_compute:
        raise e.nvml_error(
            e.ERROR_INSUFFICIENT_RESOURCES,
            what,
            f"{profile.name} needs {profile.slice_count} compute slices, {free_compute} are free",
        )
    if placement is not None:
        for gi in gs.gpu_instances:
            if placement.overlaps(_placement(gi)):
                raise e.nvml_error(
                    e.ERROR_INSUFFICIENT_RESOURCES,
                    what,
                    f"{placement} overlaps GPU instance {gi.id} at {_placement(gi)}",
                )
    else:
        free = free_placements(gs, profile)
        if not free:
            raise e.nvml_error(
                e.ERROR_INSUFFICIENT_RESOURCES,
                what,
                f"no free placement for {profile.name} (memory slices taken)",
            )
        placement = max(free)
    gi = GiState(
        id=gpu_instance_id(placement),
        profile_id=profile_id,
        start=placement.start,
        size=placement.size,
    )
    gs.gpu_instances.append(gi)
    gs.gpu_instances.sort(key=lambda g: g.id)
    return gi


def destroy_gi(gpu: FakeGpu, gs: GpuState, gi_id: int, processes: Sequence[ProcessState]) -> None:
    what = f"nvmlGpuInstanceDestroy(GPU {gpu.index}, GPU instance {gi_id})"
    gi = find_gi(gpu, gs, gi_id, what)
    if gi.compute_instances:
        ids = _ids(ci.id for ci in gi.compute_instances)
        raise e.nvml_error(
            e.ERROR_IN_USE, what, f"it holds compute instances {ids}; destroy them first"
        )
    busy = [p.pid for p in processes if p.gpu == gpu.index and p.gpu_instance_id == gi_id]
    if busy:
        raise e.nvml_error(e.ERROR_IN_USE, what, f"processes {_ids(busy)} run on it")
    gs.gpu_instances.remove(gi)


def find_gi(gpu: FakeGpu, gs: GpuState, gi_id: int, what: str) -> GiState:
    require_enabled(gpu, gs, what)
    for gi in gs.gpu_instances:
        if gi.id == gi_id:
            return gi
    raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"GPU {gpu.index} has no GPU instance {gi_id}")


def ci_profiles(gpu: FakeGpu, gi: GiState) -> tuple[ComputeInstanceProfile, ...]:
    profile = gpu.gi_profile(gi.profile_id)
    assert profile is not None  # instances are only made from known profiles
    return gpu.ci_profiles(profile)


def create_ci(gpu: FakeGpu, gs: GpuState, gi_id: int, profile_id: int) -> CiState:
    what = (
        f"nvmlGpuInstanceCreateComputeInstance(GPU {gpu.index}, GPU instance {gi_id}, "
        f"profile {profile_id})"
    )
    gi = find_gi(gpu, gs, gi_id, what)
    offered = ci_profiles(gpu, gi)
    profile = next((p for p in offered if p.id == profile_id), None)
    if profile is None:
        known = ", ".join(f"{p.id} ({p.name})" for p in offered)
        raise e.nvml_error(
            e.ERROR_INVALID_ARGUMENT, what, f"GPU instance {gi_id} offers profiles {known}"
        )
    same = [ci for ci in gi.compute_instances if ci.profile_id == profile_id]
    if len(same) >= profile.instance_count:
        raise e.nvml_error(
            e.ERROR_INSUFFICIENT_RESOURCES,
            what,
            f"{profile.name} allows {profile.instance_count} instances and {len(same)} exist",
        )
    taken = [Placement(ci.start, ci.size) for ci in gi.compute_instances]
    free = [p for p in profile.placements if not any(p.overlaps(t) for t in taken)]
    if not free:
        raise e.nvml_error(
            e.ERROR_INSUFFICIENT_RESOURCES,
            what,
            f"no free compute slices in GPU instance {gi_id} for {profile.name}",
        )
    used_ids = {ci.id for ci in gi.compute_instances}
    placement = max(free)  # like GPU instances: the highest free start
    ci = CiState(
        id=next(i for i in range(len(used_ids) + 1) if i not in used_ids),
        profile_id=profile_id,
        start=placement.start,
        size=placement.size,
    )
    gi.compute_instances.append(ci)
    gi.compute_instances.sort(key=lambda c: c.id)
    return ci


def destroy_ci(
    gpu: FakeGpu, gs: GpuState, gi_id: int, ci_id: int, processes: Sequence[ProcessState]
) -> None:
    what = (
        f"nvmlComputeInstanceDestroy(GPU {gpu.index}, GPU instance {gi_id}, "
        f"compute instance {ci_id})"
    )
    gi = find_gi(gpu, gs, gi_id, what)
    ci = next((c for c in gi.compute_instances if c.id == ci_id), None)
    if ci is None:
        raise e.nvml_error(
            e.ERROR_NOT_FOUND, what, f"GPU instance {gi_id} has no compute instance {ci_id}"
        )
    busy = [
        p.pid
        for p in processes
        if p.gpu == gpu.index and p.gpu_instance_id == gi_id and p.compute_instance_id == ci_id
    ]
    if busy:
        raise e.nvml_error(e.ERROR_IN_USE, what, f"processes {_ids(busy)} run on it")
    gi.compute_instances.remove(ci)


def free_placements(gs: GpuState, profile: GpuInstanceProfile) -> list[Placement]:
    taken = [_placement(gi) for gi in gs.gpu_instances]
    return [p for p in profile.placements if not any(p.overlaps(t) for t in taken)]


def remaining_capacity(gpu: FakeGpu, gs: GpuState, profile_id: int) -> int:
    """How many more instances of the profile fit (best packing of the free placements)."""
    what = f"nvmlDeviceGetGpuInstanceRemainingCapacity(GPU {gpu.index}, profile {profile_id})"
    require_enabled(gpu, gs, what)
    profile = gi_profile(gpu, profile_id, what)
    existing = sum(1 for gi in gs.gpu_instances if gi.profile_id == profile_id)
    limit = min(
        profile.instance_count - existing,
        (COMPUTE_SLICES - _compute_slices_used(gpu, gs)) // profile.slice_count,
    )
    return _max_disjoint(free_placements(gs, profile), max(limit, 0))


def _max_disjoint(candidates: list[Placement], limit: int) -> int:
    best = 0

    def search(start: int, chosen: list[Placement]) -> None:
        nonlocal best
        best = max(best, len(chosen))
        if best >= limit:
            return
        for i in range(start, len(candidates)):
            if not any(candidates[i].overlaps(c) for c in chosen):
                search(i + 1, [*chosen, candidates[i]])

    search(0, [])
    return min(best, limit)


def _compute_slices_used(gpu: FakeGpu, gs: GpuState) -> int:
    total = 0
    for gi in gs.gpu_instances:
        profile = gpu.gi_profile(gi.profile_id)
        total += profile.slice_count if profile else 0
    return total


def _placement(gi: GiState) -> Placement:
    return Placement(gi.start, gi.size)


def _ids(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in values)
