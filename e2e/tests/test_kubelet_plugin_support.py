"""pytest fixtures shared by the kubelet-plugin e2e suites (this module holds no tests).

The in-process plugin (``Harness``) runs against the sandbox's real API server with its admin
kubeconfig, on a fake node with a unique name per test (the pool is the node's), and claims are
created in the test's namespace with their allocation written into the status, as the
scheduler would. After a test the plugin is stopped, its node's slices and the claims deleted.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    apply_device_classes,
    create_claim,
    delete_claims,
    delete_device_classes,
    delete_node_slices,
)
from e2e.sandbox.nodeagent.testing import unique
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_nvml import open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_testkit.kubelet_plugin.harness import H100X2_MIG, Harness, Node, Running, write_node


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


class ClaimMaker(Protocol):
    def __call__(
        self,
        name: str,
        *,
        results: list[Obj] | None = None,
        config: list[Obj] | None = None,
        reserved_for: tuple[tuple[str, str], ...] = (),
    ) -> Obj: ...


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
