"""hack/kubectl-plugin.sh builds one self-contained, pure-Python kubectl-gpuslice file that runs
from the zip with every python3 from 3.10 on, and plugins/gpuslice.yaml is a krew manifest of
that one file for every platform, which the release fills completely."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
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
PER_PLATFORM_SIZE = int(16.9 * 2**20)
"""About its size while it carried the kubernetes client and pydantic-core (one per platform)."""
MIN_PYTHON = (3, 10)


def interpreters() -> dict[tuple[int, int], str]:
    """The pythons the file is run with, one per minor version: the system's /usr/bin/python3,
    this venv's base interpreter, and those uv or pyenv installed here."""
    found = ["/usr/bin/python3", str(Path(sys.base_prefix) / "bin" / "python3")]
    uv = ROOT / ".tools" / "uv" / "bin" / "uv"
    if uv.is_file():
        listed = subprocess.run(
            [str(uv), "python", "list", "--only-installed", "--output-format", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if listed.returncode == 0:
            found += [str(p["path"]) for p in json.loads(listed.stdout) if p.get("path")]
    found += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.*/bin/python3"))
    by_version: dict[tuple[int, int], str] = {}
    for python in found:
        version = minor(python) if Path(python).is_file() else None
        if version is not None:
            by_version.setdefault(version, python)
    return by_version


def minor(python: str) -> tuple[int, int] | None:
    done = subprocess.run(
        [python, "-c", "import sys; print('%d %d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        return None
    major, minor_ = done.stdout.split()
    return int(major), int(minor_)


def kubeconfig_at_a_closed_port(path: Path, port: int) -> Path:
    server = {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}
    path.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": server}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


@pytest.mark.timeout(240)
def test_one_file_runs_alone_with_every_python_from_3_10(tmp_path: Path) -> None:
    out = tmp_path / "dist" / "kubectl-gpuslice"
    built = subprocess.run(
        ["bash", str(SCRIPT), "--python", sys.executable, "--out", str(out), "--archive"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    assert "any platform, python3 >= 3.10" in built.stdout, built.stdout
    assert "grpc" not in built.stdout and "compiled" not in built.stdout
    sha = (tmp_path / "dist" / "kubectl-gpuslice.sha256").read_text().split()
    assert len(sha[0]) == 64 and sha[1] == "kubectl-gpuslice"
    archive = tmp_path / "dist" / "kubectl-gpuslice.tar.gz.sha256"
    assert archive.read_text().split()[1] == "kubectl-gpuslice.tar.gz"
    with zipfile.ZipFile(out) as zf:
        names = set(zf.namelist())
    assert "__main__.py" in names and "_vendor/gpuslice_kubectl/cli.py" in names
    assert "_vendor/yaml/__init__.py" in names and "_vendor/urllib3/__init__.py" in names
    assert "_vendor/gpuslice_kubectl/cli.pyc" in names  # bytecode beside it, for zipimport
    assert not {n for n in names if n.endswith((".so", ".pyd", ".dylib"))}
    for left_out in ("kubernetes/", "pydantic/", "pydantic_core/", "grpc/", "aiohttp/", "rich/"):
        assert not any(n.startswith(f"_vendor/{left_out}") for n in names), left_out
    size = out.stat().st_size
    print(f"kubectl-gpuslice: {size / 2**20:.1f} MiB (was {PER_PLATFORM_SIZE / 2**20:.1f} MiB)")
    assert size < 0.2 * PER_PLATFORM_SIZE
    assert os.access(out, os.X_OK)

    pythons = interpreters()
    print("run with:", ", ".join(f"{v[0]}.{v[1]} ({p})" for v, p in sorted(pythons.items())))
    with socket.socket() as closed:  # bound, never listening: a refused connection
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        config = kubeconfig_at_a_closed_port(tmp_path / "config", port)
        for version, python in sorted(pythons.items()):
            # env -i: no PYTHONPATH, no venv, an empty home; only what the file holds
            home = tmp_path / f"home-{version[0]}.{version[1]}"
            home.mkdir()
            clean = {"PATH": "/usr/bin:/bin", "HOME": str(home)}

            def run(*args: str, python: str = python, clean: dict[str, str] = clean) -> Any:
                env = [f"{k}={v}" for k, v in clean.items()]
                return subprocess.run(
                    ["env", "-i", *env, python, str(out), *args],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )

            if version < MIN_PYTHON:
                done = run("--version")
                assert done.returncode == 1 and "needs Python 3.10 or later" in done.stderr
                continue
            for args, says in [
                (["--version"], "kubectl-gpuslice 0.1.0"),
                (["top", "gpus", "--help"], "usage: kubectl gpuslice top"),
            ]:
                done = run(*args)
                assert done.returncode == 0, (python, done.stderr)
                assert says in done.stdout
            # a missing kubeconfig and an API server nobody listens at fail as the plugin
            # says, not with an import error: the loader, TLS and urllib3 ran
            done = run("--kubeconfig", str(tmp_path / "nope"), "top", "gpus")
            assert done.returncode == 1 and "no such file" in done.stderr, done.stderr
            done = run("--kubeconfig", str(config), "top", "gpus")
            assert done.returncode == 1, done.stderr
            assert f"the connection to the server 127.0.0.1:{port} was refused" in done.stderr
            assert list(home.iterdir()) == []  # nothing unpacked, nothing cached


@pytest.mark.timeout(120)
def test_a_compiled_part_fails_the_build_unless_it_has_a_pure_fallback(tmp_path: Path) -> None:
    build = load("build")
    rules = build.Rules.of_plugin()
    assert rules.pure_fallback == {"pyyaml"}
    site = Path(sysconfig.get_paths()["purelib"])
    undeclared = build.Rules(leave_out=rules.leave_out, leave_out_paths=rules.leave_out_paths)
    with pytest.raises(SystemExit, match=r"pyyaml has a compiled part \(yaml/_yaml"):
        build.stage(site, tmp_path, undeclared)


def test_the_krew_manifest(tmp_path: Path) -> None:
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert manifest["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2"
    assert manifest["kind"] == "Plugin" and manifest["metadata"]["name"] == "gpuslice"
    spec = manifest["spec"]
    for field in ("version", "homepage", "shortDescription", "description", "caveats"):
        assert spec[field], field
    # one archive for every platform krew runs the plugin on (python3 is not on Windows' PATH
    # as kubectl finds plugins there)
    [platform] = spec["platforms"]
    assert platform["selector"] == {
        "matchExpressions": [{"key": "os", "operator": "In", "values": ["linux", "darwin"]}]
    }
    assert platform["uri"] == (
        "https://github.com/__REPOSITORY__/releases/download/v__VERSION__/kubectl-gpuslice.tar.gz"
    )
    assert platform["sha256"] == "__SHA256__"
    assert platform["bin"] == "kubectl-gpuslice"
    assert platform["files"] == [{"from": "kubectl-gpuslice", "to": "."}]
    assert "3.10" in spec["caveats"]

    krew = load("krew_manifest")
    with pytest.raises(SystemExit, match=r"no .*kubectl-gpuslice\.tar\.gz\.sha256"):
        krew.fill(MANIFEST.read_text(), "1.2.3", "gpuslice/gpuslice", tmp_path)
    (tmp_path / "kubectl-gpuslice.tar.gz.sha256").write_text(
        f"{'a' * 64}  kubectl-gpuslice.tar.gz\n"
    )
    filled = yaml.safe_load(
        krew.fill(MANIFEST.read_text(), "v1.2.3", "gpuslice/gpuslice", tmp_path)
    )
    assert filled["spec"]["version"] == "v1.2.3"
    [filled_platform] = filled["spec"]["platforms"]
    assert filled_platform["sha256"] == "a" * 64
    assert filled_platform["uri"] == (
        "https://github.com/gpuslice/gpuslice/releases/download/v1.2.3/kubectl-gpuslice.tar.gz"
    )
    assert "__" not in yaml.safe_dump(filled)
    with pytest.raises(SystemExit, match="left unfilled: __NEW__"):
        krew.fill(MANIFEST.read_text() + "# __NEW__\n", "1.2.3", "gpuslice/gpuslice", tmp_path)
    (tmp_path / "kubectl-gpuslice.tar.gz.sha256").write_text("\n")
    with pytest.raises(SystemExit, match="holds no sha256"):
        krew.fill(MANIFEST.read_text(), "1.2.3", "gpuslice/gpuslice", tmp_path)
