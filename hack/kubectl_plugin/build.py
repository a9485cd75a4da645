"""Builds ``kubectl-gpuslice`` as one executable file: a zip application (stdlib ``zipapp``) that
holds the plugin, the gpuslice libraries it imports and the third-party distributions the plugin
declares (tools/kubectl-gpuslice/pyproject.toml) with what they require, vendored from an
installed environment (hack/kubectl-plugin.sh; docs/cluster-view.md, "Installing").

Python runs pure-Python code straight from the zip, and the file holds nothing else, so one
file runs on every platform with any python3 from ``bootstrap.MIN_PYTHON`` on (decision 15).
The pyproject's ``[tool.gpuslice.kubectl-plugin]`` table says what else happens: distributions
and paths left out (``leave-out``, ``leave-out-paths``) and compiled speedups dropped where the
package falls back to pure Python (``pure-fallback``: PyYAML's libyaml binding). A compiled part
in any other distribution fails the build, naming it.

usage: python build.py --site-packages DIR --out FILE
"""

from __future__ import annotations

import argparse
import compileall
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipapp
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "gpuslice-kubectl"
"""The workspace members the plugin imports, by distribution name, and their sources."""
FIRST_PARTY = {
    "gpuslice-kubectl": REPO / "tools/kubectl-gpuslice/src",
    "gpuslice-view": REPO / "libs/view/src",
    "gpuslice-kube": REPO / "libs/kube/src",
    "gpuslice-core": REPO / "libs/core/src",
    "gpuslice-api": REPO / "libs/api/src",
    "gpuslice-protos": REPO / "libs/protos/src",
}
MAIN = Path(__file__).with_name("bootstrap.py")
COMPILED_SUFFIXES = (".so", ".pyd", ".dylib")
_MIN = re.search(r"^MIN_PYTHON = \((\d+), (\d+)\)$", MAIN.read_text(), re.M)
assert _MIN, f"{MAIN}: no MIN_PYTHON"
MIN_PYTHON = f"{_MIN[1]}.{_MIN[2]}"
"""The oldest python3 the file runs with (bootstrap.py checks it at run time)."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Rules:
    """``[tool.gpuslice.kubectl-plugin]`` of the plugin's pyproject."""

    leave_out: frozenset[str] = frozenset()
    leave_out_paths: tuple[str, ...] = ()
    pure_fallback: frozenset[str] = frozenset()

    @classmethod
    def of_plugin(cls) -> Rules:
        table = _pyproject(PLUGIN).get("tool", {}).get("gpuslice", {}).get("kubectl-plugin", {})
        return cls(
            leave_out=frozenset(canonical(n) for n in table.get("leave-out", [])),
            leave_out_paths=tuple(table.get("leave-out-paths", [])),
            pure_fallback=frozenset(canonical(n) for n in table.get("pure-fallback", [])),
        )


@dataclass
class Staged:
    """What :func:`stage` left out: the compiled files dropped for their pure fallback."""

    dropped: list[str] = field(default_factory=list)


def _pyproject(name: str) -> dict[str, Any]:
    with (FIRST_PARTY[name].parent / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _requirements(requires: list[str]) -> list[tuple[str, bool]]:
    """The names a distribution requires, each with whether it is conditional (an environment
    marker), without extras-only ones. Markers are not evaluated: the environment vendored from
    was installed for the target platform, which may not be this one; a conditional requirement
    is vendored where that installation has it."""
    names = []
    for spec in requires:
        name, _, marker = spec.partition(";")
        if "extra" in marker:
            continue
        bare = re.split(r"[\s\[<>=!~(]", name.strip(), maxsplit=1)[0]
        names.append((canonical(bare), bool(marker.strip())))
    return names


def closure(site: Path, rules: Rules) -> tuple[list[str], list[metadata.Distribution]]:
    """The workspace members the plugin imports (through the members' declared workspace
    dependencies) and the third-party distributions (found in ``site``) that the plugin itself
    declares, with what they require, less ``rules.leave_out``. The members' own third-party
    dependencies are the services' and are not followed: the plugin declares what it imports."""
    found = {canonical(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}
    first: list[str] = []
    third: list[metadata.Distribution] = []
    todo: list[tuple[str, bool]] = []
    members = [PLUGIN]
    while members:
        name = members.pop()
        if name in first:
            continue
        first.append(name)
        for dep, conditional in _requirements(_pyproject(name)["project"]["dependencies"]):
            if dep in FIRST_PARTY:
                members.append(dep)
            elif name == PLUGIN:
                todo.append((dep, conditional))
    seen: set[str] = set()
    while todo:
        name, conditional = todo.pop()
        if name in seen or name in rules.leave_out:
            continue
        seen.add(name)
        if name in found:
            third.append(found[name])
            todo += _requirements(found[name].requires or [])
        elif not conditional:
            raise SystemExit(f"build.py: {name} is required but not installed in {site}")
    return first, third


def stage(site: Path, into: Path, rules: Rules) -> Staged:
    """Copies the plugin's closure into ``into``, by the rules."""
    first, third = closure(site, rules)
    for name in first:
        for package in FIRST_PARTY[name].iterdir():
            if package.is_dir():
                shutil.copytree(package, into / package.name, ignore=_no_cache)
    staged = Staged()
    for dist in third:
        name = canonical(dist.metadata["Name"])
        for file in dist.files or []:
            source = Path(str(dist.locate_file(file)))
            relative = Path(str(file))
            parts = relative.parts
            if ".." in parts or parts[0].endswith(".data") or "__pycache__" in parts:
                continue  # scripts and headers outside site-packages; caches
            if relative.as_posix().startswith(rules.leave_out_paths) or not source.is_file():
                continue
            if relative.suffix in COMPILED_SUFFIXES:
                if name in rules.pure_fallback:
                    staged.dropped.append(f"{relative} ({name})")
                    continue
                raise SystemExit(
                    f"build.py: {name} has a compiled part ({relative}) and the plugin is pure "
                    "Python, one file for every platform: keep it out of the plugin's imports, "
                    "or list it under pure-fallback in tools/kubectl-gpuslice/pyproject.toml if "
                    "the package falls back to pure Python on its own"
                )
            target = into / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    staged.dropped.sort()
    return staged


def _no_cache(_dir: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or n.endswith(".pyc")]


def _precompile(tree: Path) -> None:
    """Writes each module's bytecode next to it (``x.pyc`` beside ``x.py``, where zipimport looks
    for it), since nothing can write ``__pycache__`` into the zip: without it every run compiles
    the plugin's whole import graph again (2.5 s of a --version). The bytecode is for the CPython
    that builds; another version finds a different magic number and compiles from the source,
    which stays. Unchecked hash-based, so zip timestamps do not matter."""
    ok = compileall.compile_dir(
        tree,
        quiet=1,
        legacy=True,
        workers=1,
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    if not ok:
        raise SystemExit(f"build.py: a module under {tree} does not compile")


def _imports_alone(out: Path) -> None:
    """The file's own import graph is complete: the plugin imports with nothing but the file on
    the path (isolated mode, no site-packages)."""
    with tempfile.TemporaryDirectory() as home:
        done = subprocess.run(
            [sys.executable, "-I", "-S", str(out), "--version"],
            env={"HOME": home, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"build.py: {out} does not run on its own:\n{done.stderr}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site-packages", type=Path, required=True, help="Where to vendor from.")
    parser.add_argument("--out", type=Path, required=True, help="The executable to write.")
    args = parser.parse_args()
    rules = Rules.of_plugin()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "app"
        vendor = tree / "_vendor"
        vendor.mkdir(parents=True)
        staged = stage(args.site_packages, vendor, rules)
        _precompile(vendor)
        shutil.copy2(MAIN, tree / "__main__.py")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        zipapp.create_archive(tree, args.out, interpreter="/usr/bin/env python3", compressed=True)
    _imports_alone(args.out)
    size = args.out.stat().st_size
    print(f"{args.out}: any platform, python3 >= {MIN_PYTHON}, {size / 2**20:.1f} MiB")
    for file in staged.dropped:
        print(f"  dropped (pure-Python fallback): {file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
