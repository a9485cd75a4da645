"""The dialect tables are consistent: one owner per name, valid names, units as documented."""

from __future__ import annotations

import re

import pytest

from gpuslice_api.quantity import GIB, MIB
from gpuslice_controller.admission import dialects
from gpuslice_controller.admission.dialects import BY_RESOURCE, DIALECTS, Dialect

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def test_every_resource_has_exactly_one_owner() -> None:
    names = [r for d in DIALECTS for r in d.resources]
    assert len(names) == len(set(names))
    assert set(BY_RESOURCE) == set(names)
    for d in DIALECTS:
        for r in d.resources:
            assert BY_RESOURCE[r] is d


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
def test_dialect_shape(d: Dialect) -> None:
    assert DNS_LABEL.fullmatch(d.name) and len(d.name) <= 20
    assert d.cores or d.memory, "a dialect asks for a share somehow"
    for r in d.resources:
        assert "/" in r, f"{r} is an extended resource (domain-qualified)"
    # count comes from the count resource or from cores, never both
    assert not (d.count and d.cores_count_whole_gpus)
    assert d.memory_unit in (MIB, GIB, 256 * MIB)


@pytest.mark.parametrize(
    ("dialect", "memory", "unit"),
    [
        (dialects.HAMI, "nvidia.com/gpumem", MIB),
        (dialects.ALIYUN, "aliyun.com/gpu-mem", GIB),
        (dialects.VCUDA, "tencent.com/vcuda-memory", 256 * MIB),
        (dialects.DOCKER_VCUDA, "docker.com/vcuda-memory", 256 * MIB),
        (dialects.QGPU, "tke.cloud.tencent.com/qgpu-memory", GIB),
        (dialects.VOLCANO, "volcano.sh/vgpu-memory", MIB),
    ],
    ids=lambda v: v.name if isinstance(v, Dialect) else None,
)
def test_memory_units_as_the_systems_define_them(dialect: Dialect, memory: str, unit: int) -> None:
    assert dialect.memory == memory
    assert dialect.memory_unit == unit


def test_only_hamis_count_is_the_plain_request() -> None:
    assert [d.name for d in DIALECTS if d.count_alone_is_plain] == ["hami"]
    assert dialects.HAMI.count == "nvidia.com/gpu"


def test_hami_annotations() -> None:
    keys = {a.key: a for a in dialects.HAMI.selector_annotations}
    assert set(keys) == {
        "nvidia.com/use-gputype",
        "nvidia.com/nouse-gputype",
        "nvidia.com/use-gpuuuid",
        "nvidia.com/nouse-gpuuuid",
    }
    assert keys["nvidia.com/use-gputype"].match == "contains-ignore-case"
    assert keys["nvidia.com/use-gpuuuid"].match == "exact"
    assert keys["nvidia.com/nouse-gputype"].exclude
    assert "nvidia.com/vgpu-mode" in dialects.HAMI.annotations
