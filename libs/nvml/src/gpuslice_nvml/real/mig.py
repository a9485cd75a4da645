"""MIG through pynvml: profiles, placements, GPU/compute instances and MIG devices.

Calls follow NVIDIA's tools (go-nvlib, mig-parted): profile info is queried with
``nvmlDeviceGetGpuInstanceProfileInfoV`` over every NVML profile enum, skipping the enums the
GPU answers NOT_SUPPORTED or INVALID_ARGUMENT for; Create/Get calls take the driver's profile id
from ``info.id``; MIG devices are enumerated by index, skipping empty slots (NOT_FOUND /
INVALID_ARGUMENT). Profile names are computed with go-nvlib's rule, as the fake does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from gpuslice_nvml import errors as e
from gpuslice_nvml import profiles as p
from gpuslice_nvml.real.calls import call, error_code, map_error, text
from gpuslice_nvml.types import (
    MIB,
    NO_INSTANCE_ID,
    ComputeInstance,
    ComputeInstanceProfile,
    GpuInstance,
    GpuInstanceProfile,
    MigDevice,
    Placement,
)

_SKIPPED = (e.ERROR_NOT_SUPPORTED, e.ERROR_INVALID_ARGUMENT)
#: What NVML answers for the handle of an instance that no longer exists.
_GONE = (e.ERROR_INVALID_ARGUMENT, e.ERROR_NOT_FOUND)
_MAX_PLACEMENTS = 32


@dataclass(frozen=True)
class MigHandle:
    """A MIG device handle with the ids NVML reports for it."""

    handle: Any
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int


def gi_profile_info(h: Any, enum: int) -> Any | None:
    """``nvmlDeviceGetGpuInstanceProfileInfoV`` (v2, v1 on drivers without it); ``None`` for
    an enum the GPU does not offer."""
    try:
        try:
            return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, enum, 2)
        except pynvml.NVMLError as exc:
            if error_code(exc) != e.ERROR_FUNCTION_NOT_FOUND:
                raise
            return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, enum, 1)
    except pynvml.NVMLError as exc:
        if error_code(exc) in _SKIPPED:
            return None
        raise map_error(exc, f"nvmlDeviceGetGpuInstanceProfileInfoV(profile enum {enum})") from exc


def gi_profiles(h: Any, total_memory: int) -> list[GpuInstanceProfile]:
    result = []
    for enum in range(p.GI_PROFILE_COUNT):
        info = gi_profile_info(h, enum)
        if info is None:
            continue
        placements = _gi_placements(h, info.id)
        result.append(
            GpuInstanceProfile(
                name=p.gi_profile_name(enum, info.memorySizeMB, total_memory),
                nvml_profile=enum,
                id=info.id,
                slice_count=info.sliceCount,
                memory_slices=placements[0].size if placements else 0,
                instance_count=info.instanceCount,
                multiprocessors=info.multiprocessorCount,
                memory_mib=info.memorySizeMB,
                copy_engines=info.copyEngineCount,
                decoders=info.decoderCount,
                encoders=info.encoderCount,
                jpeg_decoders=info.jpegCount,
                ofa_engines=info.ofaCount,
                p2p_supported=bool(info.isP2pSupported),
                placements=placements,
            )
        )
    return sorted(result, key=profile_order)


def profile_order(profile: GpuInstanceProfile) -> tuple[int, int, int]:
    """Smallest first, as ``nvidia-smi mig -lgip`` lists them and the fake's catalog holds them
    (the driver answers enum by enum, so the real order is ours to fix)."""
    return (profile.slice_count, profile.memory_mib, profile.nvml_profile)


def _gi_placements(h: Any, profile_id: int) -> tuple[Placement, ...]:
    array = (pynvml.c_nvmlGpuInstancePlacement_t * _MAX_PLACEMENTS)()
    count = ctypes.c_uint(_MAX_PLACEMENTS)
    call(
        f"nvmlDeviceGetGpuInstancePossiblePlacements_v2(profile {profile_id})",
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements,
        h,
        profile_id,
        array,
        ctypes.byref(count),
    )
    return tuple(Placement(array[i].start, array[i].size) for i in range(count.value))


def _info_if_alive(fn: Callable[[Any], Any], handle: Any, what: str) -> Any | None:
    """``fn(handle)``, or ``None`` for an instance destroyed since it was listed (another
    process, e.g. the MIG manager, changed the layout between the two calls)."""
    try:
        return fn(handle)
    except pynvml.NVMLError as exc:
        if error_code(exc) in _GONE:
            return None
        raise map_error(exc, what) from exc


def gpu_instances(gpu: int, h: Any, profiles: list[GpuInstanceProfile]) -> list[GpuInstance]:
    result = []
    for profile in profiles:
        for gi in _gi_handles(h, profile):
            info = _info_if_alive(pynvml.nvmlGpuInstanceGetInfo, gi, "nvmlGpuInstanceGetInfo")
            if info is not None:
                result.append(_gpu_instance(gpu, info, profile))
    return sorted(result, key=lambda gi: gi.id)


def _gi_handles(h: Any, profile: GpuInstanceProfile) -> list[Any]:
    size = max(profile.instance_count, 1)
    array = (pynvml.c_nvmlGpuInstance_t * size)()
    count = ctypes.c_uint(size)
    call(
        f"nvmlDeviceGetGpuInstances(profile {profile.id})",
        pynvml.nvmlDeviceGetGpuInstances,
        h,
        profile.id,
        array,
        ctypes.byref(count),
    )
    return [array[i] for i in range(count.value)]


def _gpu_instance(gpu: int, info: Any, profile: GpuInstanceProfile) -> GpuInstance:
    placement = Placement(info.placement.start, info.placement.size)
    return GpuInstance(gpu, info.id, info.profileId, profile.name, placement)


def create_gpu_instance(
    gpu: int, h: Any, profile: GpuInstanceProfile, placement: Placement | None
) -> GpuInstance:
    if placement is None:
        what = f"nvmlDeviceCreateGpuInstance(GPU {gpu}, profile {profile.id})"
        gi = call(what, pynvml.nvmlDeviceCreateGpuInstance, h, profile.id)
    else:
        what = f"nvmlDeviceCreateGpuInstanceWithPlacement(GPU {gpu}, {profile.id}, {placement})"
        c_placement = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
        gi = call(
            what,
            pynvml.nvmlDeviceCreateGpuInstanceWithPlacement,
            h,
            profile.id,
            ctypes.byref(c_placement),
        )
    info = call("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gi)
    return _gpu_instance(gpu, info, profile)


def gi_handle(gpu: int, h: Any, gi_id: int) -> Any:
    return call(
        f"nvmlDeviceGetGpuInstanceById(GPU {gpu}, GPU instance {gi_id})",
        pynvml.nvmlDeviceGetGpuInstanceById,
        h,
        gi_id,
    )


def gi_profile_of(gi: Any, profiles: list[GpuInstanceProfile]) -> GpuInstanceProfile:
    info = call("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gi)
    profile = next((pr for pr in profiles if pr.id == info.profileId), None)
    if profile is None:
        raise e.nvml_error(e.ERROR_UNKNOWN, "nvmlGpuInstanceGetInfo", "unknown profile id")
    return profile


def ci_profiles(
    gi: Any, gi_profile: GpuInstanceProfile, total_memory: int
) -> list[ComputeInstanceProfile]:
    result = []
    for enum in range(p.CI_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, enum, p.CI_ENGINE_PROFILE_SHARED, 2
            )
        except pynvml.NVMLError as exc:
            if error_code(exc) in _SKIPPED:
                continue
            raise map_error(exc, "nvmlGpuInstanceGetComputeInstanceProfileInfoV") from exc
        array = (pynvml.c_nvmlComputeInstancePlacement_t * _MAX_PLACEMENTS)()
        count = ctypes.c_uint(_MAX_PLACEMENTS)
        call(
            "nvmlGpuInstanceGetComputeInstancePossiblePlacements",
            pynvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements,
            gi,
            info.id,
            array,
            ctypes.byref(count),
        )
        name = p.ci_profile_name(
            info.sliceCount, gi_profile.nvml_profile, gi_profile.memory_mib, total_memory
        )
        result.append(
            ComputeInstanceProfile(
                name=name,
                nvml_profile=enum,
                id=info.id,
                gpu_instance_profile_id=gi_profile.id,
                slice_count=info.sliceCount,
                instance_count=info.instanceCount,
                multiprocessors=info.multiprocessorCount,
                placements=tuple(
                    Placement(array[i].start, array[i].size) for i in range(count.value)
                ),
            )
        )
    return result


def compute_instances(
    gpu: int,
    gi_id: int,
    gi: Any,
    cis: list[ComputeInstanceProfile],
    uuids: dict[tuple[int, int], str],
) -> list[ComputeInstance]:
    result = []
    for profile in cis:
        size = max(profile.instance_count, 1)
        array = (pynvml.c_nvmlComputeInstance_t * size)()
        count = ctypes.c_uint(size)
        call(
            f"nvmlGpuInstanceGetComputeInstances(profile {profile.id})",
            pynvml.nvmlGpuInstanceGetComputeInstances,
            gi,
            profile.id,
            array,
            ctypes.byref(count),
        )
        for i in range(count.value):
            info = _info_if_alive(
                pynvml.nvmlComputeInstanceGetInfo, array[i], "nvmlComputeInstanceGetInfo"
            )
            if info is not None:
                result.append(_compute_instance(gpu, gi_id, info, profile, uuids))
    return sorted(result, key=lambda ci: ci.id)


def _compute_instance(
    gpu: int,
    gi_id: int,
    info: Any,
    profile: ComputeInstanceProfile,
    uuids: dict[tuple[int, int], str],
) -> ComputeInstance:
    return ComputeInstance(
        gpu_index=gpu,
        gpu_instance_id=gi_id,
        id=info.id,
        profile_id=info.profileId,
        profile_name=profile.name,
        placement=Placement(info.placement.start, info.placement.size),
        uuid=uuids.get((gi_id, info.id), ""),
    )


def create_compute_instance(
    gpu: int,
    gi_id: int,
    gi: Any,
    profile: ComputeInstanceProfile,
    uuids_after: Callable[[], dict[tuple[int, int], str]],
) -> ComputeInstance:
    """Create the compute instance; ``uuids_after`` reads the MIG UUIDs once it exists."""
    what = f"nvmlGpuInstanceCreateComputeInstance(GPU {gpu}, GI {gi_id}, profile {profile.id})"
    ci = call(what, pynvml.nvmlGpuInstanceCreateComputeInstance, gi, profile.id)
    info = call("nvmlComputeInstanceGetInfo", pynvml.nvmlComputeInstanceGetInfo, ci)
    return _compute_instance(gpu, gi_id, info, profile, uuids_after())


def mig_handles(h: Any) -> list[MigHandle]:
    """Every MIG device of a GPU, skipping empty slots like go-nvlib."""
    count = call("nvmlDeviceGetMaxMigDeviceCount", pynvml.nvmlDeviceGetMaxMigDeviceCount, h)
    result = []
    for i in range(count):
        try:
            mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except pynvml.NVMLError as exc:
            if error_code(exc) in (e.ERROR_NOT_FOUND, e.ERROR_INVALID_ARGUMENT):
                continue
            raise map_error(exc, f"nvmlDeviceGetMigDeviceHandleByIndex({i})") from exc
        result.append(
            MigHandle(
                handle=mh,
                uuid=text(call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, mh)),
                gpu_instance_id=call(
                    "nvmlDeviceGetGpuInstanceId", pynvml.nvmlDeviceGetGpuInstanceId, mh
                ),
                compute_instance_id=call(
                    "nvmlDeviceGetComputeInstanceId", pynvml.nvmlDeviceGetComputeInstanceId, mh
                ),
            )
        )
    return result


def mig_devices(
    gpu: int, h: Any, parent_uuid: str, profiles: list[GpuInstanceProfile], total_memory: int
) -> list[MigDevice]:
    result = []
    for mig in mig_handles(h):
        gi = gi_handle(gpu, h, mig.gpu_instance_id)
        gi_info = call("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gi)
        gi_profile = gi_profile_of(gi, profiles)
        ci = call(
            "nvmlGpuInstanceGetComputeInstanceById",
            pynvml.nvmlGpuInstanceGetComputeInstanceById,
            gi,
            mig.compute_instance_id,
        )
        ci_info = call("nvmlComputeInstanceGetInfo", pynvml.nvmlComputeInstanceGetInfo, ci)
        attrs = call("nvmlDeviceGetAttributes", pynvml.nvmlDeviceGetAttributes, mig.handle)
        memory = call("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, mig.handle)
        result.append(
            MigDevice(
                uuid=mig.uuid,
                parent_uuid=parent_uuid,
                gpu_index=gpu,
                gpu_instance_id=mig.gpu_instance_id,
                compute_instance_id=mig.compute_instance_id,
                gpu_instance_profile_id=gi_info.profileId,
                compute_instance_profile_id=ci_info.profileId,
                profile=p.ci_profile_name(
                    attrs.computeInstanceSliceCount,
                    gi_profile.nvml_profile,
                    gi_profile.memory_mib,
                    total_memory,
                ),
                placement=Placement(gi_info.placement.start, gi_info.placement.size),
                memory_bytes=int(memory.total) or attrs.memorySizeMB * MIB,
                multiprocessors=attrs.multiprocessorCount,
            )
        )
    return sorted(result, key=lambda d: (d.gpu_instance_id, d.compute_instance_id))


def instance_id(value: int) -> int | None:
    """NVML's "not in a MIG instance" marker as ``None``."""
    return None if value in (NO_INSTANCE_ID, -1) else value
