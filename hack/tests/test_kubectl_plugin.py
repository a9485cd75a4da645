"""hack/kubectl-plugin.sh builds one self-contained kubectl-gpuslice file that runs from the zip
(only pydantic-core's compiled core is unpacked), and plugins/gpuslice.yaml is a krew manifest the
release fills completely."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "kubectl-plugin.sh"
MANIFEST = ROOT / "plugins" / "gpuslice.yaml"
PLATFORMS = {"linux_amd64", "linux_arm64", "darwin_amd64", "darwin_arm64"}


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "hack" / "kubectl_plugin" / f"{name}.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


OLD_SIZE = 24_064_741
"""The file's size when it vendored grpcio and unpacked itself whole (commit e782187)."""


def interpreters() -> list[str]:
    """The pythons the file is run with: the system's /usr/bin/python3, and this venv's base
    interpreter where its version differs."""
    found = ["/usr/bin/python3"]
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    version = subprocess.run(
        [found[0], "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    if base.is_file() and version != sys.version:
        found.append(str(base))
    return found


def minor(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()


@pytest.mark.timeout(240)
def test_the_file_runs_alone_with_a_system_python(tmp_path: Path) -> None:
    out = tmp_path / "dist" / "kubectl-gpuslice"
    built = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            "--python",
            sys.executable,
            "--out",
            str(out),
            "--archive",
            "linux_amd64",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    # the one compiled part, named (kubernetes 37's client is built on pydantic); no grpc
    compiled = [line for line in built.stdout.splitlines() if "compiled: " in line]
    assert len(compiled) == 1 and "compiled: pydantic_core/" in compiled[0], built.stdout
    assert "grpc" not in built.stdout
    sha = (tmp_path / "dist" / "kubectl-gpuslice.sha256").read_text().split()
    assert len(sha[0]) == 64 and sha[1] == "kubectl-gpuslice"
    assert (tmp_path / "dist" / "kubectl-gpuslice_linux_amd64.tar.gz.sha256").is_file()
    with zipfile.ZipFile(out) as zf:
        names = set(zf.namelist())
    assert "__main__.py" in names and "_vendor/gpuslice_kubectl/cli.py" in names
    assert "_vendor/kubernetes/__init__.py" in names and "_vendor/yaml/__init__.py" in names
    assert "_vendor/gpuslice_kubectl/cli.pyc" in names  # bytecode beside it, for zipimport
    extensions = {n for n in names if n.endswith((".so", ".pyd", ".dylib"))}
    assert extensions and all(n.startswith("_vendor/pydantic_core/") for n in extensions)
    for left_out in ("grpc/", "grpc_tools/", "aiohttp/", "kubernetes/aio/", "rich/", "pygments/"):
        assert not any(n.startswith(f"_vendor/{left_out}") for n in names), left_out
    size = out.stat().st_size
    print(f"kubectl-gpuslice: {size / 2**20:.1f} MiB (was {OLD_SIZE / 2**20:.1f} MiB)")
    assert size < 0.8 * OLD_SIZE
    assert os.access(out, os.X_OK)

    built_for = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for python in interpreters():
        # env -i: no PYTHONPATH, no venv, an empty home for its cache; only what the file holds
        home = tmp_path / Path(python).name
        home.mkdir()
        clean = {"PATH": "/usr/bin:/bin", "HOME": str(home)}

        def run(*args: str, python: str = python, clean: dict[str, str] = clean) -> Any:
            return subprocess.run(
                ["env", "-i", *(f"{k}={v}" for k, v in clean.items()), python, str(out), *args],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        if minor(python) != built_for:  # e.g. a runner whose /usr/bin/python3 is 3.12
            done = run("--version")
            assert done.returncode == 1 and f"built for CPython {built_for}" in done.stderr
            continue
        for args, says in [
            (["--version"], "kubectl-gpuslice 0.1.0"),
            (["top", "gpus", "--help"], "usage: kubectl gpuslice top"),
        ]:
            done = run(*args)
            assert done.returncode == 0, done.stderr
            assert says in done.stdout
        # only the compiled package is unpacked; the rest is imported from the zip
        unpacked = list((home / ".cache" / "kubectl-gpuslice").iterdir())
        assert len(unpacked) == 1
        assert sorted(p.name for p in unpacked[0].iterdir()) == ["pydantic_core"]
        # a missing kubeconfig fails as the plugin does, not with an import error
        done = run("--kubeconfig", str(tmp_path / "nope"), "top", "gpus")
        assert done.returncode == 1 and "no such file" in done.stderr, done.stderr


@pytest.mark.timeout(120)
def test_a_compiled_part_not_declared_fails_the_build(tmp_path: Path) -> None:
    build = load("build")
    rules = build.Rules.of_plugin()
    assert rules.compiled == {"pydantic-core"}
    site = Path(sysconfig.get_paths()["purelib"])
    undeclared = build.Rules(
        leave_out=rules.leave_out,
        leave_out_paths=rules.leave_out_paths,
        pure_fallback=rules.pure_fallback,
        compiled=frozenset(),
    )
    with pytest.raises(SystemExit, match=r"pydantic-core has a compiled part \(pydantic_core/"):
        build.stage(site, tmp_path, undeclared)


def test_the_krew_manifest(tmp_path: Path) -> None:
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert manifest["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2"
    assert manifest["kind"] == "Plugin" and manifest["metadata"]["name"] == "gpuslice"
    spec = manifest["spec"]
    for field in ("version", "homepage", "shortDescription", "description", "caveats"):
        assert spec[field], field
    seen = set()
    for platform in spec["platforms"]:
        labels = platform["selector"]["matchLabels"]
        name = f"{labels['os']}_{labels['arch']}"
        seen.add(name)
        assert platform["uri"].endswith(f"/kubectl-gpuslice_{name}.tar.gz")
        assert platform["uri"].startswith("https://github.com/__REPOSITORY__/releases/download/")
        assert platform["sha256"] == f"__SHA256_{name.upper()}__"
        assert platform["bin"] == "kubectl-gpuslice"
        assert platform["files"] == [{"from": "kubectl-gpuslice", "to": "."}]
    assert seen == PLATFORMS

    krew = load("krew_manifest")
    digests = dict(zip(sorted(PLATFORMS), ("a" * 64, "b" * 64, "c" * 64, "d" * 64), strict=True))
    for name, digest in digests.items():
        (tmp_path / f"kubectl-gpuslice_{name}.tar.gz.sha256").write_text(
            f"{digest}  kubectl-gpuslice_{name}.tar.gz\n"
        )
    filled = yaml.safe_load(
        krew.fill(MANIFEST.read_text(), "v1.2.3", "gpuslice/gpuslice", tmp_path)
    )
    assert filled["spec"]["version"] == "v1.2.3"
    by_name = {
        "{os}_{arch}".format(**p["selector"]["matchLabels"]): p for p in filled["spec"]["platforms"]
    }
    assert {name: p["sha256"] for name, p in by_name.items()} == digests
    linux = by_name["linux_arm64"]
    assert linux["uri"] == (
        "https://github.com/gpuslice/gpuslice/releases/download/v1.2.3/kubectl-gpuslice_linux_arm64.tar.gz"
    )
    assert "__" not in yaml.safe_dump(filled)
    with pytest.raises(SystemExit, match="left unfilled: __NEW__"):
        krew.fill(MANIFEST.read_text() + "# __NEW__\n", "1.2.3", "gpuslice/gpuslice", tmp_path)
    (tmp_path / "kubectl-gpuslice_darwin_arm64.tar.gz.sha256").unlink()
    with pytest.raises(SystemExit, match=r"no .*darwin_arm64"):
        krew.fill(MANIFEST.read_text(), "1.2.3", "gpuslice/gpuslice", tmp_path)
