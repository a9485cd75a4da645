"""``-o jsonpath=<template>``: the part of kubectl's JSONPath that scripts use.

A template is text with expressions in braces, as kubectl takes it:

- ``{.items[*].metadata.name}``: fields by ``.name`` (a dot inside a name escaped as ``\\.``,
  e.g. ``{.metadata.labels.gpuslice\\.dev/node}``) or ``['name']``; list items by ``[n]``
  (negative from the end) or ``[*]``; every value of an object or list by ``.*``; ``$`` or a
  leading ``.`` for the object printed (inside ``range``, the current item).
- ``{range .items[*]}...{end}``: the text between, once per result.
- ``{"\\n"}``, ``{"\\t"}``: a quoted string, JSON escapes allowed.

Several results of one expression print separated by a space; strings print as they are,
objects and lists as JSON; a missing field prints nothing (as with kubectl get). Not
supported, and an error that says so: filters ``[?(...)]``, slices ``[a:b]``, recursive
descent ``..``, unions ``[a,b]``. Like kubectl, nothing is added after the template (no
newline).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gpuslice_core.errors import InvalidArgumentError

_STEP = re.compile(r"""\.\*|\.((?:\\.|[^.\[\\])+)|\[(\*|-?\d+|'[^']*'|"[^"]*")\]""")


@dataclass
class _Range:
    path: list[str]
    body: list[Any] = field(default_factory=list)


def _steps(expr: str, template: str) -> list[str]:
    """An expression as steps: a field name, ``*`` (every item or value) or ``#<n>`` (item n)."""
    rest = expr.strip().removeprefix("$").removeprefix("@")
    steps: list[str] = []
    position = 0
    while position < len(rest):
        match = _STEP.match(rest, position)
        if not match:
            raise InvalidArgumentError(
                f"-o jsonpath={template}: cannot read {rest[position:]!r} (supported: .field, "
                "['field'], [n], [*], .*; see kubectl gpuslice's docs)"
            )
        name, index = match.group(1), match.group(2)
        if match.group(0) == ".*" or index == "*":
            steps.append("*")
        elif name is not None:
            steps.append(re.sub(r"\\(.)", r"\1", name))
        elif index[0] in "'\"":
            steps.append(index[1:-1])
        else:
            steps.append(f"#{index}")
        position = match.end()
    return steps


def _text_part(into: list[Any], template: str, text: str) -> None:
    if "{" in text or "}" in text:
        raise InvalidArgumentError(f"-o jsonpath={template}: unbalanced braces")
    if text:
        into.append(text)


def parse(template: str) -> list[Any]:
    """The template as text (str), expressions (list of steps) and ranges."""
    root: list[Any] = []
    stack = [root]
    position = 0
    for match in re.finditer(r"\{((?:\"(?:\\.|[^\"\\])*\"|[^}\"])*)\}", template):
        _text_part(stack[-1], template, template[position : match.start()])
        position = match.end()
        inner = match.group(1).strip()
        if inner.startswith('"'):
            stack[-1].append(str(json.loads(inner, strict=False)))
        elif inner == "end":
            if len(stack) == 1:
                raise InvalidArgumentError(f"-o jsonpath={template}: {{end}} without {{range}}")
            stack.pop()
        elif inner.startswith("range "):
            block = _Range(_steps(inner.removeprefix("range "), template))
            stack[-1].append(block)
            stack.append(block.body)
        else:
            stack[-1].append(_steps(inner, template))
    _text_part(stack[-1], template, template[position:])
    if len(stack) > 1:
        raise InvalidArgumentError(f"-o jsonpath={template}: {{range}} without {{end}}")
    return root


def _walk(value: Any, steps: list[str]) -> Iterator[Any]:
    if not steps:
        yield value
        return
    step, rest = steps[0], steps[1:]
    if step == "*":
        items = list(value.values()) if isinstance(value, dict) else value
        for item in items if isinstance(items, list) else ():
            yield from _walk(item, rest)
    elif step.startswith("#") and isinstance(value, list):
        index = int(step[1:])
        if -len(value) <= index < len(value):
            yield from _walk(value[index], rest)
    elif isinstance(value, dict) and step in value:
        yield from _walk(value[step], rest)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))  # objects, lists, numbers, true/false/null


def _render(nodes: list[Any], data: Any) -> str:
    out: list[str] = []
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, _Range):
            for item in _walk(data, node.path):
                out.append(_render(node.body, item))
        else:
            out.append(" ".join(_text(v) for v in _walk(data, node)))
    return "".join(out)


def render(template: str, data: Any) -> str:
    """``data`` printed through ``template`` (``InvalidArgumentError`` for one not supported)."""
    return _render(parse(template), data)
