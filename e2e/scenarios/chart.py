"""Install the gpuslice chart into a scenario cluster the way a user does, and `helm test` it.

Both real-cluster tiers call ``install``: the sandbox's real nodes (the chart and images pushed to
a loopback registry, installed from ``oci://`` and pulled by every node's containerd) and kind
(the chart from the tree, images built with docker and `kind load`ed).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.sandbox.binaries import REPO_ROOT

CHART = REPO_ROOT / "charts" / "gpuslice"
RELEASE = "gpuslice"
NAMESPACE = "gpuslice-system"


class HelmError(RuntimeError):
    """helm failed; the message has its output."""


@dataclass(frozen=True)
class Installed:
    release: str
    namespace: str
    seconds: float  # helm install --wait: until every node pod is ready
    test_output: str  # what `helm test --logs` printed


def helm(helm_bin: Path, kubeconfig: Path, *args: str, timeout: float = 300) -> str:
    argv = [str(helm_bin), "--kubeconfig", str(kubeconfig), *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise HelmError(f"{' '.join(args[:2])} did not finish within {timeout:.0f} s") from exc
    if done.returncode != 0:
        raise HelmError(
            f"helm {' '.join(args)} failed (rc {done.returncode}):\n{done.stdout}\n{done.stderr}"
        )
    return done.stdout


def install(
    helm_bin: Path,
    kubeconfig: Path,
    values: dict[str, Any],
    values_file: Path,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    wait: str = "360s",
    chart: str = str(CHART),
    chart_args: Sequence[str] = (),
) -> Installed:
    """`helm upgrade --install --wait` of ``chart`` (the tree's chart, or an ``oci://`` reference
    with ``chart_args`` such as ``--version``) with ``values`` (written to ``values_file``, as a
    user keeps them), then `helm test --logs`, whose validation pod asks for a GPU share."""
    values_file.write_text(json.dumps(values, indent=1))
    t0 = time.monotonic()
    helm(
        helm_bin,
        kubeconfig,
        "upgrade",
        "--install",
        release,
        chart,
        *chart_args,
        "--namespace",
        namespace,
        "--create-namespace",
        "--values",
        str(values_file),
        "--wait",
        "--timeout",
        wait,
    )
    seconds = time.monotonic() - t0
    out = helm(helm_bin, kubeconfig, "test", release, "--namespace", namespace, "--logs")
    return Installed(release, namespace, seconds, out)


def uninstall(
    helm_bin: Path, kubeconfig: Path, *, release: str = RELEASE, namespace: str = NAMESPACE
) -> None:
    helm(helm_bin, kubeconfig, "uninstall", release, "--namespace", namespace, "--wait")
