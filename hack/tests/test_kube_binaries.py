"""The last step of hack/kube-binaries.sh, the version check, run as the script runs it: bash with
``set -euo pipefail`` and hack/lib/kube-verify.sh sourced, against stand-in binaries (no Go, no
ten-minute build).

The stand-in etcd prints its version line first and then far more than a pipe holds, so a reader
that stops at its first match always leaves etcd with lines still to write. That is the SIGPIPE
race that failed one first build in nine (``etcd --version | grep -q`` under pipefail), made
certain instead of likely.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "hack" / "lib" / "kube-verify.sh"
KUBE, ETCD = "v1.37.1", "v3.6.16"
RUNS = 300
# what etcd 3.6 prints for --version
ETCD_LINES = (
    "etcd Version: 3.6.16",
    "Git SHA: 5e6a1b2c",
    "Go Version: go1.26.8",
    "Go OS/Arch: linux/amd64",
)
# ~340 KB after the version line: more than a pipe buffer (64 KiB) plus grep's first read
PADDING = 6000

# $1 runs, $2 bin dir, $3 kube version, $4 etcd version; prints how many runs failed
LOOP = """
failures=0
for _ in $(seq "$1"); do
  {check} || failures=$((failures + 1))
done
echo "$failures"
"""
CHECK = 'verify_versions "$2" "$3" "$4"'
OLD_CHECK = '"$2/etcd" --version 2>&1 | grep -q "etcd Version: ${4#v}"'


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def standins(
    directory: Path,
    *,
    kube: str = KUBE,
    etcd_lines: tuple[str, ...] = ETCD_LINES,
    etcd_exit: int = 0,
) -> Path:
    """kube-apiserver and etcd that answer --version like the real ones, etcd at length."""
    directory.mkdir()
    out = directory / "etcd-version.txt"
    padding = (f"log line {i}: etcd keeps writing after its version line\n" for i in range(PADDING))
    out.write_text("".join(f"{line}\n" for line in etcd_lines) + "".join(padding))
    # exec: the process that writes is the one the shell reports on, as with the real etcd
    write = f'exec cat "{out}"' if etcd_exit == 0 else f'cat "{out}"; exit {etcd_exit}'
    _executable(directory / "etcd", f'#!/bin/sh\n[ "$1" = --version ] || exit 2\n{write}\n')
    _executable(
        directory / "kube-apiserver",
        f'#!/bin/sh\n[ "$1" = --version ] || exit 2\necho "Kubernetes {kube}"\n',
    )
    return directory


def bash(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` under the options of hack/kube-binaries.sh, with hack/lib/kube-verify.sh."""
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail\nsource "{LIB}"\n{script}', "bash", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_version_check_never_fails_on_a_binary_that_outlives_its_reader(
    tmp_path: Path,
) -> None:
    bins = str(standins(tmp_path / "bin"))
    runs = bash(LOOP.format(check=CHECK), str(RUNS), bins, KUBE, ETCD)
    assert runs.returncode == 0, runs.stderr
    assert runs.stdout.strip() == "0", f"{runs.stdout.strip()} of {RUNS} runs failed"
    assert runs.stderr == ""
    # The stand-in does provoke the race: the check the script had before fails on it.
    old = bash(LOOP.format(check=OLD_CHECK), "20", bins, KUBE, ETCD)
    assert old.returncode == 0, old.stderr
    assert int(old.stdout) > 0, "the stand-in no longer outlives grep -q; make it print more"


@pytest.mark.parametrize(
    ("kube", "etcd", "apiserver", "etcd_exit", "error"),
    [
        (
            KUBE,
            ETCD,
            "v1.37.0",
            0,
            "kube-apiserver reports 'Kubernetes v1.37.0', expected 'Kubernetes v1.37.1'",
        ),
        # a whole line must match: 3.6.1 is not 3.6.16
        (KUBE, "v3.6.1", KUBE, 0, "etcd --version does not report 3.6.1: 'etcd Version: 3.6.16'"),
        (KUBE, ETCD, KUBE, 1, "etcd --version failed: etcd Version: 3.6.16"),
    ],
    ids=["kube-apiserver", "etcd-prefix", "etcd-fails"],
)
def test_a_binary_that_does_not_report_the_pin_is_refused_with_what_it_said(
    tmp_path: Path, kube: str, etcd: str, apiserver: str, etcd_exit: int, error: str
) -> None:
    bins = standins(tmp_path / "bin", kube=apiserver, etcd_exit=etcd_exit)
    out = bash('verify_versions "$1" "$2" "$3"', str(bins), kube, etcd)
    assert out.returncode == 1
    assert out.stderr.strip() == error


EARLY_READER = re.compile(r"\|\s*(head\b|grep\s+(-\w*[qm]|--quiet|--silent|--max-count))")


def test_no_pipefail_script_pipes_into_a_reader_that_stops_early() -> None:
    """`cmd | grep -q`/`| head` under pipefail fails whenever cmd writes after the reader left;
    capture the output first (``out=$(cmd)``), then match it."""
    scripts = [p for p in [*ROOT.glob("hack/**/*.sh"), ROOT / ".ci" / "run"] if p.is_file()]
    found = []
    for script in scripts:
        text = script.read_text()
        if "pipefail" not in text:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            code = re.sub(r"(^|\s)#.*$", "", line)
            if EARLY_READER.search(code):
                found.append(f"{script.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
