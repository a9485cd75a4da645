"""pytest fixtures for tests that need sandbox nodes. They build on the session fixture
``sandbox`` (a ``ControlPlane``, e2e/conftest.py); import them into a conftest.py (or a test
module) to use them::

    from e2e.sandbox.nodeagent.fixtures import kube, namespace, node_agent, node_agents

- ``kube``: a ``RawApi`` with the sandbox's admin credentials (session);
- ``namespace``: a fresh namespace per test, deleted afterwards;
- ``node_agents``: a factory ``node_agents(labels=..., timings=..., name=...)`` that starts a
  node agent per call, each with a unique node name, its own short root dir and its own
  ``system:node:<name>`` credentials; every agent is stopped and its Node deleted after the test
  (a failing test prints the agent's root dir for the container logs);
- ``node_agent``: one such agent.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent.agent import NodeAgent
from e2e.sandbox.nodeagent.config import NodeConfig, Timings
from e2e.sandbox.nodeagent.credentials import node_kubeconfig
from e2e.sandbox.nodeagent.testing import condition, temporary_namespace, unique, wait_for
from gpuslice_kube.client import new_api_client
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import RawApi, resource_path

NodeFactory = Callable[..., NodeAgent]


def start_node_agent(
    cp: ControlPlane,
    *,
    name: str | None = None,
    root: Path | None = None,
    labels: dict[str, str] | None = None,
    timings: Timings | None = None,
    node_identity: bool = True,
    wait_schedulable: bool = True,
    **config: Any,
) -> NodeAgent:
    """Start an agent for a new node against ``cp`` (fast timings unless given); by default
    wait until the node is Ready and the lifecycle controller removed the not-ready taint, so
    the scheduler takes pods for it at once."""
    name = name or unique("node")
    root = root or Path(tempfile.mkdtemp(prefix="gsn-"))
    kubeconfig = (
        node_kubeconfig(cp.pki, cp.server, name, root / "kubelet")
        if node_identity
        else cp.kubeconfig
    )
    cfg = NodeConfig(
        name=name,
        root=root,
        labels=labels or {},
        timings=timings or Timings.fast(),
        **config,
    )
    agent = NodeAgent(cfg, kubeconfig).start()
    if wait_schedulable:
        try:
            wait_for(
                lambda: node_schedulable(agent.raw, name),
                30,
                f"node {name} to be Ready without the not-ready taint",
            )
        except BaseException:
            agent.stop()  # no caller gets it to stop: its threads would outlive the test
            raise
    return agent


def node_schedulable(raw: RawApi, name: str) -> bool:
    node = raw.get(resource_path("v1", "nodes", name=name))
    ready = condition(node, "Ready")
    taints = (node.get("spec") or {}).get("taints") or []
    return bool(ready and ready["status"] == "True") and not any(
        t.get("key") == "node.kubernetes.io/not-ready" for t in taints
    )


@pytest.fixture(scope="session")
def kube(sandbox: ControlPlane) -> RawApi:
    return RawApi(new_api_client(sandbox.kubeconfig, user_agent="gpuslice-e2e"))


@pytest.fixture
def namespace(kube: RawApi) -> Iterator[str]:
    with temporary_namespace(kube, "e2e") as name:
        yield name


@pytest.fixture
def node_agents(
    sandbox: ControlPlane, kube: RawApi, request: pytest.FixtureRequest
) -> Iterator[NodeFactory]:
    agents: list[NodeAgent] = []

    def make(**kwargs: Any) -> NodeAgent:
        agent = start_node_agent(sandbox, **kwargs)
        agents.append(agent)
        return agent

    yield make
    failed = bool(getattr(request.node, "rep_call", None) and request.node.rep_call.failed)
    for agent in agents:
        agent.stop()
        with contextlib.suppress(KubeNotFoundError):
            kube.delete(resource_path("v1", "nodes", name=agent.name))
        if failed:
            print(f"node agent {agent.name}: root dir kept at {agent.config.root}")
        else:
            shutil.rmtree(agent.config.root, ignore_errors=True)


@pytest.fixture
def node_agent(node_agents: NodeFactory) -> NodeAgent:
    return node_agents()
