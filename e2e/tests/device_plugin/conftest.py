"""The device-plugin tier (services/device-plugin): the real ``gpuslice-device-plugin`` process on
a node agent (the simulated kubelet's device manager) against the sandbox's control plane.

``plugin_nodes`` starts such nodes; the helpers that are not fixtures (``PluginNode``,
``wait_resources``, ``run_pod``, ...) are in e2e/support/device_plugin.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox import procs
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent import NodeAgent
from e2e.support.device_plugin import MODE, PluginNode, start_plugin
from gpuslice_testkit.device_plugin import write_node
from gpuslice_testkit.nvml_mock import NvmlBackend


@pytest.fixture
def plugin_nodes(
    sandbox: ControlPlane, node_agents: Callable[..., NodeAgent]
) -> Iterator[Callable[..., PluginNode]]:
    """``make(gpus or a fake NVML doc, config, *flags, labels=..., nvml_config=...,
    backend=...)``: a node agent labelled for device-plugin mode (plus ``labels``) with the
    plugin running on it (on the fake backend, or ``backend="mock"``)."""
    started: list[PluginNode] = []

    def make(
        gpus: int | dict[str, Any],
        config: str = "",
        *extra: str,
        labels: dict[str, str] | None = None,
        nvml_config: Path | None = None,
        agent: NodeAgent | None = None,
        backend: NvmlBackend = "fake",
    ) -> PluginNode:
        agent = agent or node_agents(labels={**MODE, **(labels or {})})
        if nvml_config is None:
            doc = {"gpus": [{"model": "H100", "count": gpus}]} if isinstance(gpus, int) else gpus
            nvml_config = write_node(agent.config.root, doc, agent.name)
        proc = start_plugin(agent, sandbox.kubeconfig, nvml_config, config, *extra, backend=backend)
        node = PluginNode(agent, proc, nvml_config)
        started.append(node)
        return node

    yield make
    for node in started:
        left = procs.stop([node.proc], grace=5)
        assert not left, f"device plugin outlived its stop: {left}"
