"""The e2e scenarios in kind (tier 5, users' CI): run by hack/e2e-kind.sh, which creates the
cluster, builds and loads the images and passes them here through the environment. Collected
only when GPUSLICE_KIND_KUBECONFIG is set (e2e/conftest.py); the scenarios are the same code as
the sandbox's real-node tier (e2e/tests/realnode/test_realnode_scenarios.py)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.scenarios.chart import install
from e2e.scenarios.cluster import Cluster, merged
from e2e.scenarios.nodes import chart_values
from e2e.scenarios.user import SCENARIOS
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import resource_path

pytestmark = pytest.mark.timeout(600)
MODE = "gpuslice.dev/mode"  # the chart's per-node choice: DRA or device plugin


class KindOps:
    """Node operations through `docker exec` into kind's node containers."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster

    def _exec(self, node: str, *argv: str) -> None:
        subprocess.run(["docker", "exec", node, *argv], check=True, timeout=120)

    def kill_container(self, node: str, container_id: str) -> None:
        self._exec(
            node,
            "ctr",
            "-n",
            "k8s.io",
            "tasks",
            "kill",
            "-s",
            "SIGKILL",
            container_id.removeprefix("containerd://"),
        )

    def restart_kubelet(self, node: str) -> None:
        self._exec(node, "systemctl", "restart", "kubelet")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    kubeconfig = Path(os.environ["GPUSLICE_KIND_KUBECONFIG"])
    images: dict[str, str] = json.loads(os.environ["GPUSLICE_KIND_IMAGES"])
    api = new_api_client(kubeconfig, user_agent="gpuslice-e2e-kind")
    values = chart_values(images)
    values_file = tmp_path_factory.mktemp("helm") / "values.json"
    helm = Path(os.environ["GPUSLICE_HELM"])
    installed = install(helm, kubeconfig, values, values_file)

    def upgrade(changes: dict[str, Any]) -> None:
        values.update(merged(values, changes))
        install(helm, kubeconfig, values, values_file)

    assert "PASS" in installed.test_output, installed.test_output
    c = Cluster(
        api,
        [],
        images["kubelet-plugin"],
        installed.namespace,
        KindOps(os.environ["GPUSLICE_KIND_CLUSTER"]),
        upgrade,
    )
    nodes = c.kube.list(resource_path("v1", "nodes"), label_selector="nvidia.com/gpu.present=true")
    mode = {n["metadata"]["name"]: n["metadata"]["labels"].get(MODE) for n in nodes["items"]}
    c.gpu_nodes = sorted(n for n, m in mode.items() if m != "device-plugin")
    c.device_plugin_nodes = sorted(n for n, m in mode.items() if m == "device-plugin")
    yield c


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_scenario(cluster: Cluster, scenario: Callable[[Cluster], None]) -> None:
    scenario(cluster)
