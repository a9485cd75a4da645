"""Label and field selectors as the API server reads them, for the ``GPU`` objects.

``label_selector("gpuslice.dev/type=gpu,gpuslice.dev/node in (a,b),!gpuslice.dev/mig-profile")``
returns a predicate over a labels map. The grammar is Kubernetes' (``k8s.io/apimachinery``
``labels.Parse``): requirements joined by commas, each ``key``, ``!key``, ``key=value``,
``key==value``, ``key!=value``, ``key in (v1,v2)`` or ``key notin (v1,v2)``. ``!=`` and
``notin`` also match objects without the key, as upstream. The set-based ``in``/``notin``
values may be empty (``in ()`` matches nothing).

``field_selector`` knows ``metadata.name`` and ``metadata.namespace`` (``=``, ``==``, ``!=``)
only: the fields every object has (a cluster-scoped one's namespace is empty), and what
``kubectl get gpu <name> -w`` sends. Anything else is an
``InvalidArgumentError`` naming what was given and what is supported, which the API answers with
400.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from gpuslice_core.errors import InvalidArgumentError

Predicate = Callable[[Mapping[str, str]], bool]
_KEY = r"(?:[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET = re.compile(rf"^\s*({_KEY})\s+(in|notin)\s*\(([^()]*)\)\s*$")
_EQ = re.compile(rf"^\s*({_KEY})\s*(==|!=|=)\s*({_VALUE})\s*$")
_EXISTS = re.compile(rf"^\s*(!?)\s*({_KEY})\s*$")
_VALUE_ONLY = re.compile(rf"^{_VALUE}$")


def _split(text: str) -> list[str]:
    """Requirements split at the commas that are not inside ``(...)``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _requirement(text: str) -> Predicate:
    if m := _SET.match(text):
        key, op = m.group(1), m.group(4)
        values = {v.strip() for v in m.group(5).split(",") if v.strip()}
        bad = [v for v in values if not _VALUE_ONLY.match(v)]
        if bad:
            raise InvalidArgumentError(f"labelSelector: {bad[0]!r} is not a valid label value")
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m := _EQ.match(text):
        key, op, value = m.group(1), m.group(4), m.group(5)
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if m := _EXISTS.match(text):
        negate, key = m.group(1) == "!", m.group(2)
        return lambda labels: (key in labels) != negate
    raise InvalidArgumentError(
        f"labelSelector: cannot parse {text.strip()!r}; use key, !key, key=value, key!=value, "
        "key in (a,b) or key notin (a,b), joined by commas"
    )


def label_selector(text: str | None) -> Predicate:
    """A predicate over labels for ``text`` (empty or None: everything)."""
    requirements = [_requirement(part) for part in _split(text or "")]
    return lambda labels: all(r(labels) for r in requirements)


def field_selector(text: str | None) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate over objects for ``text``; ``metadata.name`` and ``metadata.namespace`` are
    known."""
    tests: list[Callable[[Mapping[str, Any]], bool]] = []
    for part in _split(text or ""):
        m = re.match(r"^\s*([A-Za-z.]+)\s*(==|!=|=)\s*(\S*)\s*$", part)
        if m is None or m.group(1) not in ("metadata.name", "metadata.namespace"):
            raise InvalidArgumentError(
                f"fieldSelector: {part.strip()!r} is not supported; the view's resources "
                "support metadata.name and metadata.namespace with =, == and != only"
            )
        field = m.group(1).removeprefix("metadata.")
        tests.append(_field_test(field, m.group(2) != "!=", m.group(3)))
    return lambda obj: all(t(obj) for t in tests)


def _field_test(field: str, equal: bool, value: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda obj: (str(obj["metadata"].get(field) or "") == value) == equal
