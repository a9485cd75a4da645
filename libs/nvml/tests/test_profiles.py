"""go-nvlib's profile naming rule, reproduced exactly."""

from __future__ import annotations

import pytest

from gpuslice_nvml import profiles as p
from gpuslice_nvml.types import MIB


@pytest.mark.parametrize(
    ("memory_mb", "total_mib", "expected"),
    [
        (4864, 40960, 5),  # A100-40GB 1g.5gb
        (9856, 40960, 10),
        (9984, 81559, 10),  # H100 1g.10gb: 9.75 GiB of 79.6 GiB
        (40448, 81559, 40),
        (71424, 143771, 71),  # H200 3g.71gb: 70.5 rounds half away from zero, like Go
        (16384, 143771, 18),  # H200 1g.18gb: 1/8 of 141 GB = 17.625
    ],
)
def test_memory_gb_follows_go_nvlib(memory_mb: int, total_mib: int, expected: int) -> None:
    assert p.mig_memory_gb(memory_mb, total_mib * MIB) == expected


def test_names_carry_attribute_suffixes() -> None:
    total = 81559 * MIB
    assert p.gi_profile_name(p.GI_1_SLICE, 9984, total) == "1g.10gb"
    assert p.gi_profile_name(p.GI_1_SLICE_REV1, 9984, total) == "1g.10gb+me"
    assert p.gi_profile_name(p.GI_1_SLICE_ALL_ME, 9984, total) == "1g.10gb+me.all"
    assert p.gi_profile_name(p.GI_1_SLICE_NO_ME, 9984, total) == "1g.10gb-me"
    assert p.gi_profile_name(p.GI_2_SLICE_GFX, 20096, total) == "2g.20gb+gfx"


def test_compute_instance_names() -> None:
    total = 81559 * MIB
    assert p.ci_profile_name(1, p.GI_3_SLICE, 40448, total) == "1c.3g.40gb"
    assert p.ci_profile_name(3, p.GI_3_SLICE, 40448, total) == "3g.40gb"


def test_unknown_enum_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown GPU instance profile enum"):
        p.gi_profile_name(99, 1024, 1 << 30)


@pytest.mark.parametrize(
    ("gi", "allowed"),
    [(7, [1, 2, 3, 4, 7]), (4, [1, 2, 4]), (3, [1, 2, 3]), (2, [1, 2]), (1, [1])],
)
def test_compute_instance_sizes(gi: int, allowed: list[int]) -> None:
    assert [c for c in range(1, 9) if p.ci_profile_allowed(c, gi)] == allowed


def test_compute_instance_placements_are_aligned() -> None:
    assert p.ci_placement_starts(1, 7) == (0, 1, 2, 3, 4, 5, 6)
    assert p.ci_placement_starts(2, 7) == (0, 2, 4)
    assert p.ci_placement_starts(3, 7) == (0, 4)
    assert p.ci_placement_starts(4, 7) == (0,)
    assert p.ci_placement_starts(2, 4) == (0, 2)
