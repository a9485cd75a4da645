"""Every reference in the repository points at something that exists (issue 32).

- Markdown links ``[text](path)`` and ``[text](path#anchor)`` in every markdown file resolve to
  a file or directory, relative to the file that links; an anchor names a heading of the target
  (GitHub's slugs), a bare ``#anchor`` one of the same file.
- Repository paths written in backticks in markdown (```docs/helm.md```,
  ```e2e/tests/chart/test_chart.py```, ```hack/``` …) exist, relative to the repository root.
- A repository file named anywhere — ``docs/<page>.md``, ``hack/<script>.sh``,
  ``e2e/…/<test>.py`` in markdown, Python docstrings and comments, shell, YAML, templates —
  exists.
- No file names a document that is not in the repository (the design notes and reference
  facts the project was started from): a reader of a clone cannot open them.

Only tokens that look like a repository path are checked: they start with a top-level directory
of the repository and end in a file extension or ``/``; placeholders (``<name>``, ``*``, ``…``,
``{x}``) are skipped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SKIP_DIRS = {
    ".git",
    ".venv",
    ".tools",
    "node_modules",
    ".sandbox",
    ".gpustage",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    "__pycache__",
    "build",
    "dist",
}
TOP_LEVEL = ("docs", "e2e", "services", "libs", "hack", "charts", "bench", "tools", "proto")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".tpl", ".txt", ".toml", ".env", ".go"}
TEXT_NAMES = {"Makefile", "Dockerfile", "NOTES.txt"}

LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
BACKTICKED = re.compile(r"`([^`\n]+)`")
TOP = "|".join(TOP_LEVEL)
REPO_PATH = re.compile(r"^(?:" + TOP + r")/[A-Za-z0-9_./-]*(?:\.[A-Za-z0-9]+|/)$")
# A repository file named in any text (docstrings, comments, scripts, templates, prose).
REPO_FILE = re.compile(
    r"(?<![\w./<>{}*$-])(?:" + TOP + r")/[\w./-]*"
    r"\.(?:md|py|sh|yaml|yml|tpl|json|env|txt|toml|go|c|proto)\b"
)
# Documents the project was designed from, which a clone does not carry.
OUTSIDE = re.compile(
    r"\b(?:DESIGN\.md|STYLE\.md|kubelet-facts\.md|control-plane-facts\.md|toolchain-facts\.md"
    r"|device-plugin-mig-monitoring\.md|dra-drivers\.md|enforcement-mechanisms\.md|gpu-sharing\.md"
    r"|style-and-performance\.md|shared/reference)\b"
)
# Paths a page names on purpose though they do not exist yet.
FUTURE = {
    "proto/gpuslice/v2/",  # docs/protos.md: where an incompatible API would go
}
FENCE = re.compile(r"^\s*(```|~~~)")


def repo_files(suffixes: set[str] | None = None) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if suffixes is None:
                if path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                    yield path
            elif path.suffix in suffixes:
                yield path


MARKDOWN = sorted(repo_files({".md"}))
TEXT = sorted(p for p in repo_files() if p.stat().st_size < 2_000_000)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a markdown file outside fenced code blocks, numbered from 1."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return frozenset(result)


def broken_links(path: Path) -> Iterator[str]:
    for number, line in prose_lines(path):
        for match in LINK.finditer(line):
            target = match.group(1).strip("<>")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, oci:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{rel(path)}:{number}: [..]({target})"
            if not resolved.exists():
                yield f"{where}: no such file"
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                yield f"{where}: no heading with anchor #{anchor}"


def placeholder(token: str) -> bool:
    return any(mark in token for mark in ("<", ">", "*", "{", "}", "...", "…", "$"))


def broken_paths(path: Path) -> Iterator[str]:
    for number, line in prose_lines(path):
        for match in BACKTICKED.finditer(line):
            token = match.group(1).strip()
            # `path:line`, `path (something)` and `path::test` still name a path
            token = re.split(r"[:\s]", token, maxsplit=1)[0]
            if placeholder(token) or token in FUTURE or not REPO_PATH.match(token):
                continue
            if not (ROOT / token).exists():
                yield f"{rel(path)}:{number}: `{token}` does not exist"


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_markdown_links_resolve(path: Path) -> None:
    assert list(broken_links(path)) == []


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_backticked_repository_paths_exist(path: Path) -> None:
    assert list(broken_paths(path)) == []


def test_repository_files_named_anywhere_exist() -> None:
    missing = []
    for path in TEXT:
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for match in REPO_FILE.finditer(line):
                if match.group(0) not in FUTURE and not (ROOT / match.group(0)).exists():
                    missing.append(f"{rel(path)}:{number}: {match.group(0)}")
    assert missing == []


def test_no_reference_to_documents_outside_the_repository() -> None:
    this = Path(__file__).resolve()
    found = []
    for path in TEXT:
        if path == this:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{rel(path)}:{number}: {line.strip()}")
    assert found == []


def test_the_checks_see_what_they_check() -> None:
    """The walk finds the docs, and the patterns catch what they are meant to."""
    assert ROOT / "README.md" in MARKDOWN
    assert ROOT / "docs" / "helm.md" in MARKDOWN
    assert REPO_PATH.match("docs/helm.md")
    assert REPO_PATH.match("e2e/tests/chart/")
    assert not REPO_PATH.match("gpu.gpuslice.dev/mode")
    assert LINK.search("see [helm](docs/helm.md#guards).").group(1) == "docs/helm.md#guards"  # type: ignore[union-attr]
    assert (
        slug("The `kubectl gpuslice` plugin: why, cordon")
        == "the-kubectl-gpuslice-plugin-why-cordon"
    )
    assert OUTSIDE.search("see DESIGN.md section 2")
    assert REPO_FILE.search("(see hack/images.sh)").group(0) == "hack/images.sh"  # type: ignore[union-attr]
    assert not REPO_FILE.search("services/<name>/Dockerfile, libs/*/src/x.py")
