"""Placement planning on paper, over the A100-40GB profile table NVML reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_mig_manager.planner import (
    PlanError,
    Present,
    Shape,
    Want,
    check_placement,
    pick_placement,
    plan,
    total_compute_slices,
)
from gpuslice_nvml import Placement
from gpuslice_nvml.fake import FakeNvml

pytestmark = pytest.mark.timeout(10)


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Shape], int]:
    node = tmp_path_factory.mktemp("planner") / "node.yaml"
    node.write_text("name: planner\nstatePath: s.json\ngpus:\n  - model: A100-SXM4-40GB\n")
    profiles = FakeNvml.from_config_file(Path(node)).gpu_instance_profiles(0)
    return {p.name: Shape.of(p) for p in profiles}, total_compute_slices(profiles)


def wants(shapes: dict[str, Shape], **counts: int) -> list[Want]:
    out = []
    for name, count in counts.items():
        profile = name.replace("_", ".")
        out += [Want(profile, shapes[profile])] * count
    return out


def present(shapes: dict[str, Shape], name: str, start: int, gi: int, pinned: str = "") -> Present:
    shape = shapes[name]
    return Present(gi, shape, Placement(start, shape.memory_slices), name, pinned)


def test_total_compute_slices_comes_from_the_largest_profile(
    table: tuple[dict[str, Shape], int],
) -> None:
    assert table[1] == 7


def test_balanced_needs_backtracking(table: tuple[dict[str, Shape], int]) -> None:
    shapes, total = table
    result = plan(wants(shapes, **{"1g_5gb": 2, "2g_10gb": 1, "3g_20gb": 1}), [], total)
    assert sorted((n.device_profile, n.placement.start) for n in result.create) == [
        ("1g.5gb", 2),
        ("1g.5gb", 3),
        ("2g.10gb", 0),
        ("3g.20gb", 4),
    ]


def test_matching_instances_are_kept(table: tuple[dict[str, Shape], int]) -> None:
    shapes, total = table
    now = [present(shapes, "1g.5gb", s, 7 + s) for s in range(7)]
    same = plan(wants(shapes, **{"1g_5gb": 7}), now, total)
    assert not same.changes and len(same.keep) == 7

    fewer = plan(wants(shapes, **{"1g_5gb": 3}), now, total)
    assert [p.placement.start for p in fewer.keep] == [0, 1, 2]
    assert len(fewer.destroy) == 4 and not fewer.create


def test_pinned_instances_are_never_destroyed(table: tuple[dict[str, Shape], int]) -> None:
    shapes, total = table
    now = [present(shapes, "1g.5gb", s, 7 + s, "processes 1" if s == 3 else "") for s in range(7)]
    result = plan(wants(shapes, **{"1g_5gb": 2, "2g_10gb": 1, "3g_20gb": 1}), now, total)
    assert 10 in {p.gpu_instance_id for p in result.keep}
    assert all(not p.pinned_by for p in result.destroy)

    with pytest.raises(PlanError) as blocked:
        plan(wants(shapes, **{"7g_40gb": 1}), now, total)
    assert blocked.value.blocked
    assert (
        "GPU instance 10 (1g.5gb at 3:1) is not part of the layout and is held by processes 1"
        in (str(blocked.value))
    )


def test_impossible_layouts_are_not_blocked(table: tuple[dict[str, Shape], int]) -> None:
    shapes, total = table
    with pytest.raises(PlanError) as err:
        plan(wants(shapes, **{"4g_20gb": 1, "3g_20gb": 1, "1g_5gb": 1}), [], total)
    assert not err.value.blocked
    with pytest.raises(PlanError):
        plan(wants(shapes, **{"1g_5gb+me": 2}), [], total)  # one +me instance per GPU


def test_pick_and_check_placement(table: tuple[dict[str, Shape], int]) -> None:
    shapes, total = table
    three = present(shapes, "3g.20gb", 0, 1)
    assert pick_placement(shapes["2g.10gb"], [three], total) == Placement(4, 2)
    assert pick_placement(shapes["4g.20gb"], [three], total) is None
    assert "overlaps GPU instance 1" in (
        check_placement(shapes["2g.10gb"], Placement(2, 2), [three], total) or ""
    )
    me = present(shapes, "1g.5gb+me", 0, 7)
    assert check_placement(shapes["1g.5gb+me"], Placement(3, 1), [me], total) == (
        "1g.5gb+me allows 1 instances per GPU and 1 exist"
    )
    tiny = Shape(1, "1g.x", 1, 1, 8, tuple(Placement(s, 1) for s in range(8)))
    full = [present(shapes, "1g.5gb", s, 7 + s) for s in range(7)]
    assert check_placement(tiny, Placement(7, 1), full, total) == (
        "1g.x needs 1 compute slices and 0 of 7 are free"
    )
