"""Generate the Python protobuf and gRPC code in libs/protos from the .proto files under proto/.

Usage (from the repository root)::

    .venv/bin/python hack/gen_protos.py           # regenerate in place (what `make proto` runs)
    .venv/bin/python hack/gen_protos.py --check   # exit 1 if the checked-in code is stale

For every ``proto/<path>/<name>.proto`` it writes, under
``libs/protos/src/gpuslice_protos/<path>/``, ``<name>_pb2.py`` and ``<name>_pb2_grpc.py`` (protoc
and grpcio-tools), ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.pyi`` (mypy-protobuf), and an
``__init__.py`` in every package directory.

The Python import path follows the directory under ``-I``: the sources are staged in a temporary
directory as ``gpuslice_protos/<path>/<name>.proto`` and that directory is the include root, so
``proto/kubelet/dra/v1/api.proto`` becomes ``gpuslice_protos.kubelet.dra.v1.api_pb2`` and the
generated ``_pb2_grpc.py`` imports its ``_pb2`` by that full path. The gRPC method paths follow
each file's ``package`` line, which this script never touches.

The output is a pure function of the sources and the pinned tool versions: the same bytes on
every run. The top-level ``__init__.py`` and ``py.typed`` of the package are written by hand and
left alone; every other file under the package is generated, and files that the sources no
longer produce are deleted (or, with ``--check``, reported as extra).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_NAME = "gpuslice_protos"
PACKAGE_DIR = REPO_ROOT / "libs" / "protos" / "src" / PACKAGE_NAME

# Files of the package that are maintained by hand, relative to PACKAGE_DIR.
HAND_WRITTEN = frozenset({"__init__.py", "py.typed"})
# Paths that are never part of the comparison (interpreter and tool caches).
IGNORED_PARTS = frozenset({"__pycache__", ".mypy_cache"})

# mypy-protobuf options: no "Writing mypy to" chatter on stderr; sync-only gRPC stubs, because the
# services use grpc's sync server and the generated async overloads add nothing they call.
MYPY_OPTS = "quiet"
MYPY_GRPC_OPTS = "quiet,only_sync"

INIT_TEMPLATE = '"""Generated from proto/{rel}/ by hack/gen_protos.py; never edit by hand."""\n'


class GenerationError(RuntimeError):
    """Generation cannot proceed (bad proto path, missing plugin, protoc failure); says why."""


@dataclass(frozen=True)
class Diff:
    """Differences between the generated files and the files in the tree."""

    stale: tuple[str, ...]
    missing: tuple[str, ...]
    extra: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not (self.stale or self.missing or self.extra)


def find_protos(proto_root: Path) -> list[Path]:
    """All .proto files under proto_root, relative to it, in a stable order.

    Every directory and file stem must be a Python identifier, because it becomes a module name
    (upstream's ``dra-health`` directory is ``dra_health`` here).
    """
    protos = sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))
    for rel in protos:
        bad = [part for part in (*rel.parent.parts, rel.stem) if not part.isidentifier()]
        if bad:
            raise GenerationError(
                f"proto/{rel.as_posix()}: {', '.join(map(repr, bad))} is not a valid Python "
                "module name; rename it (letters, digits and underscores only)"
            )
    return protos


def _protoc_main() -> Callable[[list[str]], int]:
    # grpc_tools ships no type information; bind its entry point to the signature it has.
    module = importlib.import_module("grpc_tools.protoc")
    return cast(Callable[[list[str]], int], module.main)


def _well_known_include() -> Path:
    """The include directory of the well-known types that grpcio-tools bundles."""
    module = importlib.import_module("grpc_tools")
    return Path(cast(str, module.__file__)).resolve().parent / "_proto"


def _plugin(name: str) -> Path:
    """Path of a protoc plugin installed in the running interpreter's environment."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / name,
        Path(sys.executable).parent / name,
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    found = shutil.which(name)
    if found is None:
        raise GenerationError(
            f"protoc plugin {name!r} not found next to {sys.executable}; "
            "install mypy-protobuf in this environment (run `make setup`)"
        )
    return Path(found)


def generate(proto_root: Path, out_dir: Path) -> list[str]:
    """Generate the package for every proto under proto_root into out_dir/<PACKAGE_NAME>.

    Returns the generated files, relative to out_dir/<PACKAGE_NAME>, sorted.
    """
    protos = find_protos(proto_root)
    if not protos:
        raise GenerationError(f"no .proto files under {proto_root}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gen-protos-") as tmp:
        include_root = Path(tmp)
        for rel in protos:
            staged = include_root / PACKAGE_NAME / rel
            staged.parent.mkdir(parents=True, exist_ok=True)
            staged.write_bytes((proto_root / rel).read_bytes())
        args = [
            "grpc_tools.protoc",
            f"-I{include_root}",
            f"-I{_well_known_include()}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--mypy_out={MYPY_OPTS}:{out_dir}",
            f"--mypy_grpc_out={MYPY_GRPC_OPTS}:{out_dir}",
            *(f"{PACKAGE_NAME}/{rel.as_posix()}" for rel in protos),
        ]
        status = _protoc_main()(args)
        if status != 0:
            raise GenerationError(f"protoc exited with status {status} (its errors are above)")

    package_out = out_dir / PACKAGE_NAME
    for rel in protos:
        directory = rel.parent
        while directory != Path():
            init = package_out / directory / "__init__.py"
            if not init.exists():
                init.write_text(INIT_TEMPLATE.format(rel=directory.as_posix()), encoding="utf-8")
            directory = directory.parent
    return _managed_files(package_out)


def _managed_files(package_dir: Path) -> list[str]:
    """Files under package_dir that the generator owns, relative to it, sorted."""
    if not package_dir.is_dir():
        return []
    found = []
    for path in package_dir.rglob("*"):
        rel = path.relative_to(package_dir)
        if path.is_dir() or IGNORED_PARTS.intersection(rel.parts) or path.suffix == ".pyc":
            continue
        if rel.as_posix() in HAND_WRITTEN:
            continue
        found.append(rel.as_posix())
    return sorted(found)


def compare(generated_dir: Path, generated: Sequence[str], tree_dir: Path) -> Diff:
    """Compare freshly generated files with the ones checked in under tree_dir."""
    in_tree = set(_managed_files(tree_dir))
    wanted = set(generated)
    stale = [
        rel
        for rel in sorted(wanted & in_tree)
        if (generated_dir / rel).read_bytes() != (tree_dir / rel).read_bytes()
    ]
    return Diff(
        stale=tuple(stale),
        missing=tuple(sorted(wanted - in_tree)),
        extra=tuple(sorted(in_tree - wanted)),
    )


def sync(generated_dir: Path, diff: Diff, tree_dir: Path) -> None:
    """Make tree_dir match the generated files: write changed and new ones, delete extra ones."""
    for rel in (*diff.stale, *diff.missing):
        target = tree_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((generated_dir / rel).read_bytes())
    for rel in diff.extra:
        (tree_dir / rel).unlink()
    # Remove directories left empty (or holding only caches) by deleted protos, deepest first.
    for directory in sorted(
        (p for p in tree_dir.rglob("*") if p.is_dir() and not IGNORED_PARTS.intersection(p.parts)),
        key=lambda p: len(p.parts),
        reverse=True,
    ):
        leftovers = [p for p in directory.iterdir() if p.name not in IGNORED_PARTS]
        if not leftovers:
            shutil.rmtree(directory)


def _describe(diff: Diff, tree_dir: Path) -> str:
    shown = tree_dir.relative_to(REPO_ROOT) if tree_dir.is_relative_to(REPO_ROOT) else tree_dir
    lines = [f"generated protobuf code in {shown} is out of date with proto/:"]
    for label, files in (
        ("stale (content differs)", diff.stale),
        ("missing (not generated yet)", diff.missing),
        ("extra (no proto produces it)", diff.extra),
    ):
        lines.extend(f"  {label}: {rel}" for rel in files)
    lines.append("regenerate with `make proto` (hack/gen_protos.py) and commit the result")
    return "\n".join(lines)


def run(check: bool, proto_root: Path = PROTO_ROOT, tree_dir: Path = PACKAGE_DIR) -> int:
    """Regenerate (or, with check, verify) tree_dir from proto_root. Returns the exit status."""
    with tempfile.TemporaryDirectory(prefix="gen-protos-out-") as tmp:
        out_dir = Path(tmp)
        generated = generate(proto_root, out_dir)
        generated_dir = out_dir / PACKAGE_NAME
        diff = compare(generated_dir, generated, tree_dir)
        if check:
            if diff.clean:
                print(f"generated protobuf code is up to date ({len(generated)} files)")
                return 0
            print(_describe(diff, tree_dir), file=sys.stderr)
            return 1
        sync(generated_dir, diff, tree_dir)
    changed = len(diff.stale) + len(diff.missing) + len(diff.extra)
    print(
        f"generated {len(generated)} files from {len(find_protos(proto_root))} protos: "
        f"{len(diff.stale)} updated, {len(diff.missing)} new, {len(diff.extra)} deleted"
        + ("" if changed else " (already up to date)")
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(
            "Generate Python protobuf and gRPC code (with mypy stubs) in "
            "libs/protos/src/gpuslice_protos from the .proto files under proto/."
        )
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help=(
            "Regenerate into a temporary directory and exit with status 1, listing stale, "
            "missing and extra files, if the checked-in code differs; change nothing."
        ),
    )
    args = parser.parse_args(argv)
    try:
        return run(check=args.check)
    except GenerationError as exc:
        print(f"gen_protos: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
