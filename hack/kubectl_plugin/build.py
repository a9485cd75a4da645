"""Builds ``kubectl-gpuslice`` as one executable file: a zip application (stdlib ``zipapp``) that
holds the plugin, the gpuslice libraries it imports and every third-party distribution they
declare, vendored from an installed environment (hack/kubectl-plugin.sh; docs/cluster-view.md,
"Installing").

Some of those distributions have compiled parts, which Python cannot import from inside a zip:
``grpcio`` (``gpuslice_core.errors`` carries gRPC status codes) and ``pydantic-core``
(``gpuslice_core.untrusted``) have no pure-Python form; ``pyyaml`` and ``charset-normalizer``
ship optional speedups and fall back to pure Python. So the file is built for one platform and
one CPython minor version (those of the environment it vendors from), and on its first run it
unpacks itself into ``${XDG_CACHE_HOME:-~/.cache}/kubectl-gpuslice/<build id>/`` and runs from
there; a run under another Python or platform fails with a message that names both.

usage: python build.py --site-packages DIR --out FILE [--platform OS-ARCH] [--python X.Y]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import re
import shutil
import sys
import tempfile
import zipapp
from importlib import metadata
from pathlib import Path

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


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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


def _first_party_requires(name: str) -> list[str]:
    text = (FIRST_PARTY[name].parent / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M)
    return re.findall(r'"([^"]+)"', block.group(1)) if block else []


def closure(site: Path) -> tuple[list[str], list[metadata.Distribution]]:
    """The workspace members and the third-party distributions (found in ``site``) the plugin
    needs, by walking declared requirements from ``gpuslice-kubectl``."""
    found = {canonical(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}
    first: list[str] = []
    third: list[metadata.Distribution] = []
    todo: list[tuple[str, bool]] = [(PLUGIN, False)]
    seen: set[str] = set()
    while todo:
        name, conditional = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in FIRST_PARTY:
            first.append(name)
            todo += _requirements(_first_party_requires(name))
        elif name in found:
            third.append(found[name])
            todo += _requirements(found[name].requires or [])
        elif not conditional:
            raise SystemExit(f"build.py: {name} is required but not installed in {site}")
    return first, third


def stage(site: Path, into: Path) -> list[str]:
    """Copies the plugin's closure into ``into``; returns the compiled files it holds."""
    first, third = closure(site)
    for name in first:
        for package in FIRST_PARTY[name].iterdir():
            if package.is_dir():
                shutil.copytree(package, into / package.name, ignore=_no_cache)
    compiled = []
    for dist in third:
        for file in dist.files or []:
            source = Path(str(dist.locate_file(file)))
            parts = Path(str(file)).parts
            if ".." in parts or parts[0].endswith(".data") or "__pycache__" in parts:
                continue  # scripts and headers outside site-packages; caches
            if not source.is_file():
                continue
            target = into / Path(str(file))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            if target.suffix in (".so", ".pyd", ".dylib"):
                compiled.append(str(file))
    return sorted(compiled)


def _no_cache(_dir: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or n.endswith(".pyc")]


def build_id(tree: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site-packages", type=Path, required=True, help="Where to vendor from.")
    parser.add_argument("--out", type=Path, required=True, help="The executable to write.")
    parser.add_argument(
        "--platform",
        default=None,
        help="The OS-ARCH the vendored compiled parts are for (default: this machine's).",
    )
    parser.add_argument(
        "--python", default=None, help="Their CPython X.Y (default: this interpreter's)."
    )
    args = parser.parse_args()
    target = args.platform or f"{sys.platform}-{platform.machine()}"
    python = args.python or f"{sys.version_info[0]}.{sys.version_info[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "app"
        vendor = tree / "_vendor"
        vendor.mkdir(parents=True)
        compiled = stage(args.site_packages, vendor)
        bid = build_id(vendor)
        main_py = MAIN.read_text()
        for key, value in (("BUILD_ID", bid), ("PLATFORM", target), ("PYTHON", python)):
            main_py = re.sub(rf'^{key} = ".*"$', f'{key} = "{value}"', main_py, count=1, flags=re.M)
        (tree / "__main__.py").write_text(main_py)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        zipapp.create_archive(tree, args.out, interpreter="/usr/bin/env python3", compressed=True)
    print(f"{args.out}: build {bid}, {target}, CPython {python}")
    for file in compiled:
        print(f"  compiled: {file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
