"""The cluster view (libs/view) as users read it: ``kubectl gpuslice`` (tools/kubectl-gpuslice)
and the controller's /view/ endpoints and metrics, against sandbox GPU nodes whose claims the
real scheduler allocates.

``node`` (one H100 on a sandbox GPU node) and ``ns`` serve a whole module each; test_view.py
defines its own (two H100s and a MIG one), test_view_lifecycle.py its own nodes. The controller
process and the view pods are helpers in e2e/support/controller.py and e2e/support/view.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import GpuNode, running_gpu_node
from e2e.sandbox.nodeagent.testing import temporary_namespace
from gpuslice_kube.raw import RawApi


@pytest.fixture(scope="module")
def node(sandbox: ControlPlane, kube: RawApi, device_classes: list[str]) -> Iterator[GpuNode]:
    with running_gpu_node(sandbox, kube, [{"model": "H100", "count": 1}], devices=1) as gpu_node:
        yield gpu_node


@pytest.fixture(scope="module")
def ns(kube: RawApi, node: GpuNode) -> Iterator[str]:
    with temporary_namespace(kube, "ctlview") as name:
        yield name
