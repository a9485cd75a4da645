"""Kubernetes resource quantities ("20Gi", "100", "1.5G", "500m") as exact numbers.

Capacity values, consumed capacity in allocation results and ``GpuConfig.limits.memory`` are
quantities. Parsing is exact (``Fraction``); callers round where a whole number is needed.

A quantity in opaque parameters is a string the API server never checks, and an exact parse
costs what the number's size is: ``1e300000000`` (16 bytes) kept a kubelet plugin busy for
minutes. So a quantity has at most ``MAX_CHARS`` characters and an exponent within
``MAX_EXPONENT``, and its value lies within Kubernetes' own range (a quantity's ``Value()`` is
an int64): ``-LARGEST..LARGEST``, far beyond any GPU. Anything else is refused with the field's
name and that range, before any big number is computed.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from gpuslice_core.errors import InvalidArgumentError
from gpuslice_core.untrusted import shown

MIB = 1024 * 1024
GIB = 1024 * MIB

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: dict[str, int | Fraction] = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": 1,
}
_DECIMAL.update({"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18})
MAX_CHARS = 64
MAX_EXPONENT = 30
LARGEST = 2**63 - 1
"""The largest quantity (8Ei - 1): Kubernetes' int64."""
RANGE = "a quantity below 8Ei (2^63) in magnitude, of at most 64 characters"
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<exp>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)"
)


class OutOfRangeError(InvalidArgumentError):
    """A quantity beyond ``RANGE``."""


def parse_quantity(value: str | int, *, what: str = "quantity") -> Fraction:
    """The exact value of a Kubernetes quantity; ``InvalidArgumentError`` names ``what``."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what}: {value!r} is not a quantity")
    number = Fraction(value) if isinstance(value, int) else _parse(value, what)
    if abs(number) > LARGEST:
        raise OutOfRangeError(f"{what}: {shown(value)} is out of range; allowed: {RANGE}")
    return number


def _parse(value: object, what: str) -> Fraction:
    if isinstance(value, str) and len(value) > MAX_CHARS:
        raise OutOfRangeError(f"{what}: {shown(value)} is too long; allowed: {RANGE}")
    match = _QUANTITY.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise InvalidArgumentError(
            f"{what}: {shown(value)} is not a quantity (examples: 100, 20Gi, 512Mi, 1.5G)"
        )
    exponent = int(match["exp"][1:]) if match["exp"] else 0
    if abs(exponent) > MAX_EXPONENT:
        raise OutOfRangeError(
            f"{what}: {shown(value)} is out of range (exponent {exponent}, at most "
            f"{MAX_EXPONENT} either way); allowed: {RANGE}"
        )
    number = Fraction(match["num"]) * Fraction(10) ** exponent
    suffix = match["suffix"] or ""
    scale: int | Fraction = _BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix]
    number *= scale
    return -number if match["sign"] == "-" else number


def quantity_int(value: str | int, *, what: str = "quantity") -> int:
    """A quantity rounded up to a whole number (as the API server rounds ``Value()``)."""
    return math.ceil(parse_quantity(value, what=what))


def memory_quantity(value: object, *, floor_mib: bool = False) -> int:
    """Bytes of a memory quantity of at least 1Mi, for a pydantic validator (a ``ValueError``
    says why not); ``floor_mib`` rounds down to whole MiB first, as MPS takes limits in MiB."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError("must be a quantity string such as 20Gi")
    try:
        parsed = parse_quantity(value, what="memory")
    except OutOfRangeError as exc:
        raise ValueError(f"out of range: {RANGE}") from exc
    except InvalidArgumentError as exc:
        raise ValueError("not a quantity (examples: 20Gi, 512Mi)") from exc
    if floor_mib:
        parsed = Fraction(parsed // MIB * MIB)
    if parsed < MIB:
        raise ValueError("must be at least 1Mi")
    return math.ceil(parsed)


def format_bytes(value: int) -> str:
    """A byte count as a canonical quantity: ``Gi``/``Mi`` when exact, plain bytes otherwise."""
    for suffix in ("Gi", "Mi", "Ki"):
        unit = _BINARY[suffix]
        if value and value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)


def human_bytes(value: int) -> str:
    """Bytes for a message: ``20Gi``, ``79.6Gi``."""
    if value % GIB == 0:
        return f"{value // GIB}Gi"
    if value >= GIB:
        return f"{value / GIB:.1f}Gi"
    return format_bytes(value)
