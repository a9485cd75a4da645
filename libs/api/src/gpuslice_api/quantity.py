"""Kubernetes resource quantities ("20Gi", "100", "1.5G", "500m") as exact numbers.

Capacity values, consumed capacity in allocation results and ``GpuConfig.limits.memory`` are
quantities. Parsing is exact (``Fraction``); callers round where a whole number is needed.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from gpuslice_core.errors import InvalidArgumentError

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
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<exp>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)"
)


def parse_quantity(value: str | int, *, what: str = "quantity") -> Fraction:
    """The exact value of a Kubernetes quantity; ``InvalidArgumentError`` names ``what``."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what}: {value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    match = _QUANTITY.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise InvalidArgumentError(
            f"{what}: {value!r} is not a quantity (examples: 100, 20Gi, 512Mi, 1.5G)"
        )
    number = Fraction(match["num"])
    if match["exp"]:
        number *= Fraction(10) ** int(match["exp"][1:])
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
