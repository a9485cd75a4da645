"""The version check of hack/node-binaries.sh (hack/lib/node-verify.sh), run as the script runs it:
bash with ``set -euo pipefail``, against stand-in binaries that answer like containerd 2.4, its
shim, runc 1.5 and crictl (no Go, no build). The stand-in runc prints its version line first and
then far more than a pipe holds, so a check that pipes into a reader that stops early fails on it
(see test_kube_binaries.py for the race). When the real binaries are in the cache, the same check
runs against them.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "node-binaries.sh"
LIB = ROOT / "hack" / "lib" / "node-verify.sh"
VERSIONS = ROOT / "hack" / "kube" / "versions.env"
CONTAINERD, RUNC, CRICTL = "v2.4.2", "v1.5.2", "v1.37.0"
RUNS = 200
PADDING = 6000  # ~340 KB after runc's version line: more than a pipe buffer plus grep's first read

# what the real binaries print (containerd's revision is empty when the proxy gave no commit)
CONTAINERD_LINE = "containerd github.com/containerd/containerd/v2 v2.4.2 "
CTR_LINE = "ctr github.com/containerd/containerd/v2 v2.4.2"
SHIM_LINES = (
    "containerd-shim-runc-v2:",
    "  Version:  v2.4.2",
    "  Revision: ",
    "  Go version: go1.26.8",
    "",
)
RUNC_LINES = ("runc version 1.5.2", "spec: 1.3.0", "go: go1.26.8", "libseccomp: 2.5.4")
CRICTL_LINE = "crictl version v1.37.0"


def _executable(path: Path, flag: str, lines: tuple[str, ...], exit_code: int = 0) -> None:
    out = path.with_suffix(".out")
    out.write_text("".join(f"{line}\n" for line in lines))
    # exec: the process that writes is the one the shell reports on, as with the real binaries
    write = f'exec cat "{out}"' if exit_code == 0 else f'cat "{out}"; exit {exit_code}'
    path.write_text(f'#!/bin/sh\n[ "$1" = {flag} ] || exit 2\n{write}\n')
    path.chmod(0o755)


def standins(
    directory: Path,
    *,
    containerd: str = CONTAINERD_LINE,
    ctr: str = CTR_LINE,
    shim: tuple[str, ...] = SHIM_LINES,
    runc: tuple[str, ...] = RUNC_LINES,
    runc_exit: int = 0,
    crictl: str = CRICTL_LINE,
) -> Path:
    """The five binaries, answering their version flags like the real ones (runc at length)."""
    directory.mkdir()
    padding = tuple(f"log line {i}: runc keeps writing after its version" for i in range(PADDING))
    _executable(directory / "containerd", "--version", (containerd,))
    _executable(directory / "ctr", "--version", (ctr,))
    _executable(directory / "containerd-shim-runc-v2", "-v", shim)
    _executable(directory / "runc", "--version", runc + padding, runc_exit)
    _executable(directory / "crictl", "--version", (crictl,))
    return directory


def bash(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` under the options of hack/node-binaries.sh, with hack/lib/node-verify.sh."""
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail\nsource "{LIB}"\n{script}', "bash", *args],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )


LOOP = """
failures=0
for _ in $(seq "$1"); do
  {check} || failures=$((failures + 1))
done
echo "$failures"
"""
CHECK = 'verify_node_versions "$2" "$3" "$4" "$5"'
OLD_CHECK = '"$2/runc" --version 2>&1 | grep -q "runc version ${4#v}"'


def test_the_version_check_never_fails_on_a_binary_that_outlives_its_reader(
    tmp_path: Path,
) -> None:
    bins = str(standins(tmp_path / "bin"))
    runs = bash(LOOP.format(check=CHECK), str(RUNS), bins, CONTAINERD, RUNC, CRICTL)
    assert runs.returncode == 0, runs.stderr
    assert runs.stdout.strip() == "0", f"{runs.stdout.strip()} of {RUNS} runs failed"
    assert runs.stderr == ""
    # The stand-in does provoke the race: a `| grep -q` check fails on it.
    old = bash(LOOP.format(check=OLD_CHECK), "20", bins, CONTAINERD, RUNC, CRICTL)
    assert old.returncode == 0, old.stderr
    assert int(old.stdout) > 0, "the stand-in no longer outlives grep -q; make it print more"


NO_SECCOMP = RUNC_LINES[:3]


@pytest.mark.parametrize(
    ("standin", "versions", "error"),
    [
        (
            {"containerd": "containerd github.com/containerd/containerd/v2 v2.4.1 abc"},
            (CONTAINERD, RUNC, CRICTL),
            "containerd reports 'containerd github.com/containerd/containerd/v2 v2.4.1 abc', "
            "expected version v2.4.2",
        ),
        # v2.4.2 is not v2.4.20, for containerd as for runc
        (
            {"containerd": "containerd github.com/containerd/containerd/v2 v2.4.20 "},
            (CONTAINERD, RUNC, CRICTL),
            "containerd reports 'containerd github.com/containerd/containerd/v2 v2.4.20 ', "
            "expected version v2.4.2",
        ),
        (
            {"shim": ("containerd-shim-runc-v2:", "  Version:  v2.4.1")},
            (CONTAINERD, RUNC, CRICTL),
            "containerd-shim-runc-v2 -v does not report v2.4.2: "
            "'containerd-shim-runc-v2:   Version:  v2.4.1'",
        ),
        (
            {},
            (CONTAINERD, "v1.5.20", CRICTL),
            "runc --version does not report 1.5.20: 'runc version 1.5.2'",
        ),
        (
            {"runc": NO_SECCOMP},
            (CONTAINERD, RUNC, CRICTL),
            "runc was built without seccomp (no libseccomp line in runc --version)",
        ),
        (
            {"runc_exit": 1},
            (CONTAINERD, RUNC, CRICTL),
            "runc --version failed: runc version 1.5.2",
        ),
        (
            {"crictl": "crictl version v1.36.0"},
            (CONTAINERD, RUNC, CRICTL),
            "crictl reports 'crictl version v1.36.0', expected 'crictl version v1.37.0'",
        ),
    ],
    ids=[
        "containerd",
        "containerd-prefix",
        "shim",
        "runc-prefix",
        "runc-no-seccomp",
        "runc-fails",
        "crictl",
    ],
)
def test_a_binary_that_does_not_report_the_pin_is_refused_with_what_it_said(
    tmp_path: Path, standin: dict[str, object], versions: tuple[str, str, str], error: str
) -> None:
    bins = standins(tmp_path / "bin", **standin)  # type: ignore[arg-type]
    out = bash('verify_node_versions "$1" "$2" "$3" "$4"', str(bins), *versions)
    assert out.returncode == 1
    assert out.stderr.strip() == error


def test_the_pins_are_in_versions_env() -> None:
    pins = dict(re.findall(r"^([A-Z_]+)=(\S*)", VERSIONS.read_text(), re.MULTILINE))
    assert re.fullmatch(r"v2\.\d+\.\d+", pins["CONTAINERD_VERSION"])
    assert re.fullmatch(r"v1\.\d+\.\d+", pins["RUNC_VERSION"])
    # crictl speaks the CRI of the kubelet it sits beside: the same minor
    kube_minor = pins["KUBE_VERSION"].split(".")[1]
    assert pins["CRICTL_VERSION"].split(".")[1] == kube_minor


def _script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        env={**os.environ, **env},
    )


def test_missing_binaries_fail_with_how_to_build(tmp_path: Path) -> None:
    env = {"GPUSLICE_KUBE_CACHE": str(tmp_path), "GPUSLICE_NODE_BIN_DIR": ""}
    out = _script("--check", env=env)
    assert out.returncode == 1
    assert out.stdout == ""
    assert "make node-binaries" in out.stderr
    assert str(tmp_path / "node-v2") in out.stderr


def test_a_bin_dir_the_user_names_is_used_without_a_build(tmp_path: Path) -> None:
    bins = standins(tmp_path / "bin")
    out = _script(
        "--print-dir",
        env={"GPUSLICE_KUBE_CACHE": str(tmp_path / "cache"), "GPUSLICE_NODE_BIN_DIR": str(bins)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(bins)


def test_the_built_binaries_report_the_pins() -> None:
    """The real containerd, shim, runc and crictl in the cache (skipped where none is built)."""
    found = _script("--print-dir", env={"GPUSLICE_NODE_BIN_DIR": ""})
    if found.returncode != 0:
        pytest.skip("containerd/runc are not built here (make node-binaries builds them)")
    pins = dict(re.findall(r"^([A-Z_]+)=(\S*)", VERSIONS.read_text(), re.MULTILINE))
    out = bash(
        'verify_node_versions "$1" "$2" "$3" "$4"',
        found.stdout.strip(),
        os.environ.get("CONTAINERD_VERSION") or pins["CONTAINERD_VERSION"],
        os.environ.get("RUNC_VERSION") or pins["RUNC_VERSION"],
        os.environ.get("CRICTL_VERSION") or pins["CRICTL_VERSION"],
    )
    assert out.returncode == 0, out.stderr
