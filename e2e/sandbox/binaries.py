"""Where the control-plane binaries are: resolved by hack/kube-binaries.sh (the single source
of truth for the pinned versions, the cache layout and KUBEBUILDER_ASSETS)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "hack" / "kube-binaries.sh"
VERSIONS_FILE = REPO_ROOT / "hack" / "kube" / "versions.env"
# what hack/kube-binaries.sh builds (BINARIES there); the kubelet is for the real-node tier
NAMES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kubelet",
)
_VERSION_RE = re.compile(r"^Kubernetes (v1\.(\d+)\.\d+\S*)$")


class BinariesMissingError(RuntimeError):
    """The binaries are not built (the message says how to build them)."""


def pinned_versions() -> dict[str, str]:
    """KUBE_VERSION and ETCD_VERSION: the environment wins over hack/kube/versions.env."""
    pins: dict[str, str] = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        m = re.match(r"^([A-Z_]+)=([^\s#]*)", line)
        if m:
            pins[m.group(1)] = m.group(2)
    for key in ("KUBE_VERSION", "ETCD_VERSION"):
        if os.environ.get(key):
            pins[key] = os.environ[key]
        if key in pins:
            pins[key] = "v" + pins[key].removeprefix("v")
    return pins


@dataclass(frozen=True)
class KubeBinaries:
    bin_dir: Path
    kube_version: str  # what kube-apiserver --version reports, e.g. v1.37.1
    minor: int

    def path(self, name: str) -> Path:
        if name not in NAMES:
            raise KeyError(name)
        return self.bin_dir / name

    @classmethod
    def in_dir(cls, bin_dir: Path) -> KubeBinaries:
        out = subprocess.run(
            [str(bin_dir / "kube-apiserver"), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        m = _VERSION_RE.match(out.stdout.strip())
        if out.returncode != 0 or m is None:
            raise BinariesMissingError(
                f"{bin_dir}/kube-apiserver --version did not print a Kubernetes version: "
                f"rc={out.returncode} {out.stdout.strip()} {out.stderr.strip()}"
            )
        return cls(bin_dir=bin_dir, kube_version=m.group(1), minor=int(m.group(2)))


def find_binaries() -> KubeBinaries:
    """The usable binaries (GPUSLICE_KUBE_BIN_DIR, KUBEBUILDER_ASSETS, or the pinned build in
    the cache); raises BinariesMissingError saying how to build them."""
    out = subprocess.run(
        ["bash", str(SCRIPT), "--print-dir"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise BinariesMissingError(out.stderr.strip() or f"{SCRIPT} --print-dir failed")
    return KubeBinaries.in_dir(Path(lines[-1]))
