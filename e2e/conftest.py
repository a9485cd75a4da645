"""Fixtures for the end-to-end suites: one real control plane per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # pytest runs with --import-mode=importlib
    sys.path.insert(0, str(REPO_ROOT))

# The kind tier (e2e/kind) runs only from hack/e2e-kind.sh, which makes the cluster it needs.
collect_ignore = [] if os.environ.get("GPUSLICE_KIND_KUBECONFIG") else ["kind"]

from e2e.sandbox.binaries import BinariesMissingError, KubeBinaries, find_binaries  # noqa: E402
from e2e.sandbox.controlplane import (  # noqa: E402
    ControlPlane,
    StartError,
    install_signal_handlers,
)
from gpuslice_testkit.enforcer import HOOK_KINDS, hook_missing  # noqa: E402


@pytest.fixture(params=HOOK_KINDS)
def hook_kind(request: pytest.FixtureRequest) -> str:
    """The CDI hook a test runs, each in turn: the static Go binary the chart installs and the
    Python hook; the Go one skips, saying why, only where there is no Go to build it."""
    kind: str = request.param
    reason = hook_missing(kind)
    if reason:
        pytest.skip(reason)
    return kind


@pytest.fixture(scope="session")
def kube_binaries() -> KubeBinaries:
    """The pinned control-plane binaries; FAILS (never skips) with how to build them."""
    try:
        return find_binaries()
    except BinariesMissingError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def sandbox(
    kube_binaries: KubeBinaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """A control plane for the whole session; tests isolate themselves by namespace and node
    names. Stopped at session end, and the stop is checked: no process, no bound port."""
    install_signal_handlers()
    cp = ControlPlane(tmp_path_factory.mktemp("sandbox"), binaries=kube_binaries)
    try:
        cp.start()
    except StartError as exc:
        pytest.fail(f"the sandbox control plane did not start: {exc}", pytrace=False)
    try:
        yield cp
    finally:
        left = cp.stop()
        assert not left, f"sandbox left behind after stop: {', '.join(left)} (logs: {cp.logs})"
