"""Every message docs/troubleshooting.md quotes as gpuslice's is one the code writes (issue 32).

The page quotes gpuslice's messages in code spans on blockquote lines (``> `…` ``) and in the
column "gpuslice says" of its tables; ``<…>`` stands for a part that varies. Each must occur in
a string of the code under services/, libs/, tools/ (Python, and the CDI hook's Go) or in
charts/ (templates):

- Python: every string literal and f-string, implicitly concatenated parts joined (what ``ast``
  gives), docstrings left out. A replacement field ``{x}`` is a wildcard, except a name (or
  ``module.NAME``) bound to a string constant at module level somewhere in the code, which is
  replaced by that string when it has one value.
- Go: string literals joined across ``+``; an expression between them is a wildcard.
- Chart templates: each line, ``{{ … }}`` a wildcard.

A quoted ``<…>`` matches anything, a wildcard of the code stands for a part the page may spell
out or leave out.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
WILD = "\x00"
COLUMN = "gpuslice says"


def page_messages(text: str) -> list[str]:
    """The messages the page quotes as gpuslice's."""
    found: list[str] = []
    column: int | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(">"):
            found += re.findall(r"`([^`]+)`", stripped)
            continue
        if not stripped.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in stripped.strip("|").split("|")]
        if COLUMN in cells:
            column = cells.index(COLUMN)
        elif column is not None and not set(stripped) <= set("|-: "):
            found += re.findall(r"`([^`]+)`", cells[column])
    return found


def source_files() -> Iterator[Path]:
    for top in ("services", "libs", "tools"):
        for path in sorted((ROOT / top).glob("*/src/**/*.py")):
            yield path
    yield from sorted((ROOT / "services").glob("*/hook/*.go"))
    for path in sorted((ROOT / "charts").rglob("*")):
        if path.suffix in (".yaml", ".tpl", ".txt") and path.is_file():
            yield path


def docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


@cache
def python_constants() -> dict[str, str]:
    """Module-level ``NAME = "text"`` of the code, for names bound to one value only."""
    values: dict[str, set[str]] = defaultdict(set)
    for path in source_files():
        if path.suffix != ".py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            if (
                isinstance(target, ast.Name)
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
            ):
                values[target.id].add(value.value)
    return {name: next(iter(v)) for name, v in values.items() if len(v) == 1}


def field(node: ast.FormattedValue) -> str:
    value = node.value
    name = (
        value.id
        if isinstance(value, ast.Name)
        else value.attr
        if isinstance(value, ast.Attribute)
        else None
    )
    if name is not None and node.conversion == -1 and node.format_spec is None:
        return python_constants().get(name, WILD)
    return WILD


def python_strings(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield "".join(
                str(part.value)
                if isinstance(part, ast.Constant)
                else field(part)
                if isinstance(part, ast.FormattedValue)
                else WILD
                for part in node.values
            )
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        ):
            yield re.sub(r"\{[^{}]*\}|%[sdr]", WILD, node.value)


def go_strings(path: Path) -> Iterator[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r'"\s*\+\s*"', "", text)  # "a " + "b"
    text = re.sub(r'"\s*\+\s*[^"\n]+?\s*\+\s*"', WILD, text)  # "a " + x + " b"
    text = re.sub(r'"\s*\+\s*[^"\n]+?\s*\+\s*\n\s*"', WILD, text)
    for match in re.finditer(r'"((?:[^"\\\n]|\\.)*)"', text):
        yield match.group(1)


def template_lines(path: Path) -> Iterator[str]:
    for line in path.read_text(encoding="utf-8").splitlines():
        yield re.sub(r"\{\{.*?\}\}", WILD, line)


@cache
def corpus() -> str:
    strings: list[str] = []
    for path in source_files():
        if path.suffix == ".py":
            strings += python_strings(path)
        elif path.suffix == ".go":
            strings += go_strings(path)
        else:
            strings += template_lines(path)
    return "\n".join(s.replace("\n", " ") for s in strings)


def pattern(message: str) -> re.Pattern[str]:
    """``<…>`` matches anything on the line; between any two characters of the quoted text a
    wildcard of the code may stand (a part the page spells out or leaves out)."""
    parts = re.split(r"<[^<>]*>|…", message)
    regex = "[^\\n]*?".join(f"{WILD}?".join(re.escape(c) for c in part) for part in parts)
    return re.compile(regex)


def occurs(message: str, text: str) -> bool:
    return pattern(message).search(text) is not None


MESSAGES = page_messages(PAGE.read_text(encoding="utf-8"))


def test_the_page_quotes_messages() -> None:
    assert len(MESSAGES) >= 30
    assert "refusing to start: <why>" in MESSAGES


@pytest.mark.parametrize("message", MESSAGES)
def test_quoted_message_is_in_the_code(message: str) -> None:
    assert occurs(message, corpus()), f"not found in services/, libs/, tools/, charts/: {message}"


def test_the_matching_is_strict_enough() -> None:
    text = "\n".join(
        [
            f"node {WILD} is labelled gpuslice.dev/mode=device-plugin: the device plugin",
            f"no matching GPU has {WILD} of free memory{WILD}; the largest free is {WILD}",
        ]
    )
    assert occurs("is labelled gpuslice.dev/mode=device-plugin: the device", text)
    assert occurs("no matching GPU has <m> of free memory; the largest free is <f>", text)
    assert not occurs("is labelled gpuslice.dev/mode=dra", text)
    assert not occurs("no GPU has <m> of free memory", text)
    assert "the GPU Operator's MIG manager" in corpus()  # constants and f-strings are seen


def test_page_messages_finds_both_forms() -> None:
    page = (
        "> `one <x>`\n\n"
        "| code | gpuslice says | fix |\n|---|---|---|\n| `A` | `two` | `not this` |\n\n"
        "| other | col |\n|---|---|\n| `no` | `nor this` |\n"
    )
    assert page_messages(page) == ["one <x>", "two"]
