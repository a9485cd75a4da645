"""GpuConfig decoding and quantities."""

from __future__ import annotations

import re
import time
from fractions import Fraction

import pytest

from gpuslice_api.gpuconfig import decode
from gpuslice_api.quantity import format_bytes, human_bytes, parse_quantity
from gpuslice_core.errors import InvalidArgumentError

BASE = {"apiVersion": "gpu.gpuslice.dev/v1alpha1", "kind": "GpuConfig"}


def test_defaults() -> None:
    config = decode(BASE)
    assert config.sharing.strategy is None
    assert config.enforcement.mode == "Auto" and not config.enforcement.strict
    assert config.limits.cores is None and config.limits.memory is None


def test_every_field() -> None:
    config = decode(
        {
            **BASE,
            "sharing": {"strategy": "MPS"},
            "enforcement": {"mode": "Hard", "strict": True, "workConserving": True},
            "limits": {"cores": 30, "memory": "20Gi"},
        }
    )
    assert config.sharing.strategy == "MPS"
    assert config.enforcement.work_conserving
    assert config.limits.memory == 20 * 1024**3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"limits": {"cores": 0}}, "limits.cores: 0 is not allowed"),
        ({"limits": {"cores": 101}}, "allowed: an integer 1..100"),
        ({"limits": {"cores": "30"}}, "limits.cores: '30' is not allowed"),
        (
            {"limits": {"memory": "512Ki"}},
            "limits.memory: '512Ki' is not allowed (must be at least 1Mi)",
        ),
        ({"limits": {"memory": "lots"}}, "limits.memory: 'lots' is not allowed (not a quantity"),
        ({"sharing": {"strategy": "Shared"}}, "allowed: TimeSlicing, MPS"),
        ({"enforcement": {"mode": "hard"}}, "allowed: Auto, Hard, Soft, Off"),
        ({"enforcement": {"strict": "yes"}}, "enforcement.strict: 'yes' is not allowed"),
        ({"limit": {"cores": 1}}, "unknown field 'limit'"),
        ({"sharing": {"strategy": "MPS", "mps": {}}}, "unknown field 'mps' in sharing"),
    ],
)
def test_errors_name_field_value_and_range(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        decode({**BASE, **fields}, what="GpuConfig #0")
    assert message in str(err.value)
    assert str(err.value).startswith("GpuConfig #0: ")


def test_wrong_kind_or_version() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"this driver accepts gpu\.gpuslice\.dev/v1alpha1"
    ):
        decode({"apiVersion": "gpu.gpuslice.dev/v1", "kind": "GpuConfig"})
    with pytest.raises(InvalidArgumentError, match="must be an object"):
        decode("cores: 30")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100", 100),
        ("20Gi", 20 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        ("2k", 2000),
        ("81559Mi", 81559 * 2**20),
    ],
)
def test_quantities(text: str, value: Fraction | int) -> None:
    assert parse_quantity(text) == value


def test_quantity_formats() -> None:
    assert format_bytes(85520809984) == "81559Mi"
    assert format_bytes(20 * 2**30) == "20Gi"
    assert format_bytes(1000) == "1000"
    assert human_bytes(85520809984) == "79.6Gi"
    with pytest.raises(InvalidArgumentError):
        parse_quantity("20 GiB")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1e300000000", "out of range (exponent 300000000"),
        ("1e-300000000", "out of range (exponent -300000000"),
        ("9Ei", "is out of range"),
        ("1" * 5000, "is too long"),
    ],
)
def test_quantities_out_of_range_are_refused_at_once(text: str, why: str) -> None:
    """An exact parse costs what the number's size is: 1e300000000 took minutes."""
    start = time.perf_counter()
    with pytest.raises(InvalidArgumentError, match=re.escape(why)) as err:
        parse_quantity(text, what="limits.memory")
    assert time.perf_counter() - start < 0.1
    assert str(err.value).startswith("limits.memory: ")
    assert "allowed: a quantity below 8Ei (2^63) in magnitude" in str(err.value)
    assert len(str(err.value)) < 300


def test_a_huge_memory_limit_names_the_field_and_the_range() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        decode({**BASE, "limits": {"memory": "1e300000000"}})
    assert "limits.memory: '1e300000000' is not allowed (out of range: a quantity below 8Ei" in (
        str(err.value)
    )
    assert "allowed: a quantity from 1Mi up to the GPU's memory" in str(err.value)


def test_many_bad_fields_make_one_short_message() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        decode(BASE | {f"k{i}": i for i in range(500)})
    assert "unknown field 'k0'" in str(err.value)
    assert "and 495 more problems" in str(err.value)
    assert len(str(err.value)) < 400
