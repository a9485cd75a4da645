"""MIG profile enums and the go-nvlib naming rule, shared by both backends.

NVIDIA's tools name a profile from its NVML enum and its memory: ``<g>g.<gb>gb`` (plus
``<c>c.`` for a compute instance smaller than its GPU instance, and an attribute suffix). The GB
figure is not the instance's memory rounded; it is the instance's share of the GPU rounded *up*
to eighths and multiplied by the GPU's memory in whole GiB (go-nvlib ``getMigMemorySizeGB``). We
compute names the same way everywhere, so a name can never disagree with the numbers behind it.
"""

from __future__ import annotations

import math

from gpuslice_nvml.types import GIB, MIB

# NVML_GPU_INSTANCE_PROFILE_* (nvml.h; the same values in pynvml and go-nvml).
GI_1_SLICE = 0
GI_2_SLICE = 1
GI_3_SLICE = 2
GI_4_SLICE = 3
GI_7_SLICE = 4
GI_8_SLICE = 5
GI_6_SLICE = 6
GI_1_SLICE_REV1 = 7  # 1g with media extensions (+me)
GI_2_SLICE_REV1 = 8  # 2g with media extensions (+me)
GI_1_SLICE_REV2 = 9  # 1g with two memory slices (1g.10gb on A100-40GB, 1g.20gb on H100)
GI_1_SLICE_GFX = 10
GI_2_SLICE_GFX = 11
GI_4_SLICE_GFX = 12
GI_1_SLICE_NO_ME = 13
GI_2_SLICE_NO_ME = 14
GI_1_SLICE_ALL_ME = 15
GI_2_SLICE_ALL_ME = 16
GI_3_SLICE_GFX = 17
GI_PROFILE_COUNT = 18

# NVML_COMPUTE_INSTANCE_PROFILE_*.
CI_1_SLICE = 0
CI_2_SLICE = 1
CI_3_SLICE = 2
CI_4_SLICE = 3
CI_7_SLICE = 4
CI_8_SLICE = 5
CI_6_SLICE = 6
CI_1_SLICE_REV1 = 7
CI_7_SLICE_NVL = 8
CI_PROFILE_COUNT = 9

CI_ENGINE_PROFILE_SHARED = 0

#: Compute slices ("g") of each GPU-instance profile enum.
GI_PROFILE_SLICES: dict[int, int] = {
    GI_1_SLICE: 1,
    GI_2_SLICE: 2,
    GI_3_SLICE: 3,
    GI_4_SLICE: 4,
    GI_7_SLICE: 7,
    GI_8_SLICE: 8,
    GI_6_SLICE: 6,
    GI_1_SLICE_REV1: 1,
    GI_2_SLICE_REV1: 2,
    GI_1_SLICE_REV2: 1,
    GI_1_SLICE_GFX: 1,
    GI_2_SLICE_GFX: 2,
    GI_4_SLICE_GFX: 4,
    GI_1_SLICE_NO_ME: 1,
    GI_2_SLICE_NO_ME: 2,
    GI_1_SLICE_ALL_ME: 1,
    GI_2_SLICE_ALL_ME: 2,
    GI_3_SLICE_GFX: 3,
}

#: Name suffix of each GPU-instance profile enum that has one.
GI_PROFILE_SUFFIX: dict[int, str] = {
    GI_1_SLICE_REV1: "+me",
    GI_2_SLICE_REV1: "+me",
    GI_1_SLICE_GFX: "+gfx",
    GI_2_SLICE_GFX: "+gfx",
    GI_4_SLICE_GFX: "+gfx",
    GI_3_SLICE_GFX: "+gfx",
    GI_1_SLICE_NO_ME: "-me",
    GI_2_SLICE_NO_ME: "-me",
    GI_1_SLICE_ALL_ME: "+me.all",
    GI_2_SLICE_ALL_ME: "+me.all",
}

#: Compute slices ("c") of each compute-instance profile enum.
CI_PROFILE_SLICES: dict[int, int] = {
    CI_1_SLICE: 1,
    CI_2_SLICE: 2,
    CI_3_SLICE: 3,
    CI_4_SLICE: 4,
    CI_7_SLICE: 7,
    CI_8_SLICE: 8,
    CI_6_SLICE: 6,
    CI_1_SLICE_REV1: 1,
    CI_7_SLICE_NVL: 7,
}

#: The plain compute-instance enum for ``c`` compute slices.
CI_PROFILE_FOR_SLICES: dict[int, int] = {
    1: CI_1_SLICE,
    2: CI_2_SLICE,
    3: CI_3_SLICE,
    4: CI_4_SLICE,
    6: CI_6_SLICE,
    7: CI_7_SLICE,
    8: CI_8_SLICE,
}


def _go_round(value: float) -> int:
    """Go's ``math.Round``: half away from zero (Python's ``round`` would round 70.5 to 70)."""
    return math.floor(value + 0.5)


def mig_memory_gb(memory_size_mb: int, total_memory_bytes: int) -> int:
    """The "<gb>gb" figure of a profile: go-nvlib ``getMigMemorySizeGB``.

    ``memory_size_mb`` is the profile's ``memorySizeMB`` (MiB); ``total_memory_bytes`` is the
    GPU's ``nvmlDeviceGetMemoryInfo().total``.
    """
    if total_memory_bytes <= 0:
        raise ValueError("total GPU memory must be positive")
    fraction = (memory_size_mb * MIB) / total_memory_bytes
    fraction = math.ceil(fraction * 8) / 8
    total_gb = -(-total_memory_bytes // GIB)  # ceil(total / GiB)
    return _go_round(fraction * total_gb)


def gi_profile_name(nvml_profile: int, memory_size_mb: int, total_memory_bytes: int) -> str:
    """The NVIDIA name of a GPU-instance profile, e.g. ``1g.10gb`` or ``1g.10gb+me``."""
    try:
        slices = GI_PROFILE_SLICES[nvml_profile]
    except KeyError:
        raise ValueError(f"unknown GPU instance profile enum {nvml_profile}") from None
    gb = mig_memory_gb(memory_size_mb, total_memory_bytes)
    return f"{slices}g.{gb}gb{GI_PROFILE_SUFFIX.get(nvml_profile, '')}"


def ci_profile_name(
    ci_slices: int, gi_nvml_profile: int, memory_size_mb: int, total_memory_bytes: int
) -> str:
    """The name of a compute instance of ``ci_slices`` slices in a GPU instance of the given
    profile: the GPU-instance name when it spans it, else ``<c>c.<gpu instance name>``."""
    gi_name = gi_profile_name(gi_nvml_profile, memory_size_mb, total_memory_bytes)
    if ci_slices == GI_PROFILE_SLICES[gi_nvml_profile]:
        return gi_name
    return f"{ci_slices}c.{gi_name}"


def ci_profile_allowed(ci_slices: int, gi_slices: int) -> bool:
    """go-nvlib's rule for which compute-instance sizes a GPU instance offers: the whole
    instance, or ``c`` slices where ``2c <= g + 1`` (so a 7g offers 1c/2c/3c/4c, a 4g 1c/2c)."""
    if ci_slices == gi_slices:
        return True
    return ci_slices < gi_slices and ci_slices * 2 <= gi_slices + 1


def ci_placement_starts(ci_slices: int, gi_slices: int) -> tuple[int, ...]:
    """Compute-slice starts of a ``ci_slices`` compute instance inside a ``gi_slices`` GPU
    instance: aligned like GPU instances are (3-slice ones at 0 and 4)."""
    if ci_slices == gi_slices:
        return (0,)
    step = 4 if ci_slices == 3 else ci_slices
    return tuple(s for s in range(0, gi_slices, step) if s + ci_slices <= gi_slices)
