"""CEL for the claim templates the pod webhook makes: selectors from a dialect's annotations
and a GPU's memory size, with user text always escaped into string literals (never built by
concatenating untrusted input)."""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence

from gpuslice_api.quantity import format_bytes
from gpuslice_controller.admission.dialects import Dialect, SelectorAnnotation

MAX_CEL_BYTES = 10 * 1024
"""The API server's limit on one CEL expression."""
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def cel_string(value: str) -> str:
    """``value`` as a CEL string literal: quotes and backslashes escaped, everything outside
    printable ASCII as ``\\u``/``\\U`` escapes, so user text can never end the literal."""
    out = ['"']
    for ch in value:
        code = ord(ch)
        if 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"{value!r} holds a lone surrogate")
        if ch in '\\"':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def attribute(domain: str, name: str) -> str:
    return f"device.attributes[{cel_string(domain)}].{name}"


def size_selector(domain: str, size: int) -> str:
    quantity = cel_string(format_bytes(size))
    return f"device.capacity[{cel_string(domain)}].memory.compareTo(quantity({quantity})) == 0"


def annotation_selectors(d: Dialect, annotations: Mapping[str, str], domain: str) -> list[str]:
    """One CEL selector per selector annotation the pod carries; ValueError says why one cannot
    be made (the webhook denies the pod with it)."""
    out = []
    for rule in d.selector_annotations:
        raw = annotations.get(rule.key)
        if raw is None:
            continue
        entries = [e.strip() for e in str(raw).split(",") if e.strip()]
        if not entries:
            continue
        try:
            expression = _selector(rule, entries, domain)
        except ValueError as exc:
            raise ValueError(f"annotation {rule.key}={raw!r}: {exc}") from exc
        if len(expression.encode()) > MAX_CEL_BYTES:
            raise ValueError(
                f"annotation {rule.key} is too long: its selector would exceed the "
                f"{MAX_CEL_BYTES}-byte limit of a CEL expression"
            )
        out.append(expression)
    return out


def _selector(rule: SelectorAnnotation, entries: Sequence[str], domain: str) -> str:
    attr = attribute(domain, rule.attribute)
    if rule.match == "exact":
        listed = ", ".join(cel_string(e) for e in entries)
        matches = f"{attr} in [{listed}]"
    else:
        lowered = f"{attr}.lowerAscii()"
        matches = " || ".join(
            f"{lowered}.contains({cel_string(e.translate(_ASCII_LOWER))})" for e in entries
        )
        if len(entries) > 1:
            matches = f"({matches})"
    guarded = f"has({attr}) && {matches}"
    return f"!({guarded})" if rule.exclude else guarded
