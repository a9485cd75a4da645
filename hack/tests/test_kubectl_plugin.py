"""hack/kubectl-plugin.sh builds one self-contained kubectl-gpuslice file, and
plugins/gpuslice.yaml is a krew manifest the release fills completely."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

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
    spec.loader.exec_module(module)
    return module


def system_python() -> str:
    """A python3 outside any virtual environment, of this one's version (the file's compiled
    parts are for it): the interpreter this venv was made from."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    assert base.is_file(), base
    return str(base)


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
    assert "compiled: grpc/" in built.stdout  # named, since the file is per platform for them
    sha = (tmp_path / "dist" / "kubectl-gpuslice.sha256").read_text().split()
    assert len(sha[0]) == 64 and sha[1] == "kubectl-gpuslice"
    assert (tmp_path / "dist" / "kubectl-gpuslice_linux_amd64.tar.gz.sha256").is_file()
    with zipfile.ZipFile(out) as zf:
        names = set(zf.namelist())
    assert "__main__.py" in names and "_vendor/gpuslice_kubectl/cli.py" in names
    assert "_vendor/kubernetes/__init__.py" in names and "_vendor/yaml/__init__.py" in names
    assert os.access(out, os.X_OK)

    # no PYTHONPATH, no venv, an empty home for its cache: only what the file holds
    clean = {"PATH": f"{Path(system_python()).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    for args, says in [
        (["--version"], "kubectl-gpuslice 0.1.0"),
        (["top", "gpus", "--help"], "usage: kubectl gpuslice top"),
    ]:
        done = subprocess.run(
            [system_python(), str(out), *args],
            env=clean,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert says in done.stdout
    unpacked = list((tmp_path / ".cache" / "kubectl-gpuslice").iterdir())
    assert len(unpacked) == 1 and (unpacked[0] / "gpuslice_view").is_dir()
    # a missing kubeconfig fails as the plugin does, not with an import error
    done = subprocess.run(
        [system_python(), str(out), "--kubeconfig", str(tmp_path / "nope"), "top", "gpus"],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and "no such file" in done.stderr, done.stderr


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
