"""Per-container GPU metrics of the real ``gpuslice-device-plugin`` process: the node agent
serves the kubelet's pod resources API, pods run a fake CUDA program (a real process in the
container's cgroups that registers itself with the fake NVML), and the plugin's /metrics names
the container that uses the GPU. Time-slicing with 2 replicas of one GPU, so both attribution
paths run: one holder (every process on the GPU is its), then two (the pod UID in the
process's cgroup, against this node's pods at the API server)."""

from __future__ import annotations

import socket
import sys
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import wait_for, wait_pod_gone, wait_pod_phase
from e2e.support.device_plugin import MODE, PluginNode, wait_resources
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)

MIB = 1024 * 1024
USED = "gpuslice_container_gpu_memory_used_bytes"
TIME_SLICING = """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """``pod/container@UUID`` → memory used, from the plugin's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == USED:
                out[f"{s.labels['pod']}/{s.labels['container']}@{s.labels['UUID']}"] = s.value
    return out


def workload_pod(namespace: str, name: str, nvml_config: Path, memory_mib: int) -> Obj:
    """A pod whose container is a fake CUDA program on the GPU the plugin gave it."""
    program = (
        f"exec {sys.executable} -m gpuslice_nvml.fake.workload --config {nvml_config}"
        f" --device $NVIDIA_VISIBLE_DEVICES --memory {memory_mib * MIB}"
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "cuda",
                    "image": "busybox",
                    "command": ["sh", "-c", program],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def test_a_pods_gpu_memory_is_reported_under_its_name_and_goes_with_it(
    kube: RawApi,
    namespace: str,
    node_agents: Callable[..., NodeAgent],
    plugin_nodes: Callable[..., PluginNode],
) -> None:
    port = free_port()
    agent = node_agents(labels=MODE)
    node = plugin_nodes(
        {"gpus": [{"model": "L4", "count": 1}]},
        TIME_SLICING,
        f"--metrics-addr=127.0.0.1:{port}",
        f"--pod-resources-socket={agent.pod_resources_socket}",
        agent=agent,
    )
    wait_resources(kube, node, ("2", "2"))
    (gpu,) = node.uuids()
    pods = resource_path("v1", "pods", namespace=namespace)

    def seen(expected: Mapping[str, float]) -> Callable[[], dict[str, float] | None]:
        def check() -> dict[str, float] | None:
            if not node.proc.alive():
                raise AssertionError(f"the plugin exited:\n{node.proc.log_tail()}")
            got = scrape(port)
            return got if got == expected else None

        return check

    # one holder of the GPU: every process on it is the pod's
    kube.create(pods, workload_pod(namespace, "alpha", node.nvml_config, 1024))
    wait_pod_phase(kube, namespace, "alpha", "Running", timeout=30)
    wait_for(seen({f"alpha/cuda@{gpu}": 1024 * MIB}), 20, "alpha's memory in /metrics")

    # two holders (the two replicas): told apart by the pod UID in each process's cgroup
    kube.create(pods, workload_pod(namespace, "beta", node.nvml_config, 3072))
    wait_pod_phase(kube, namespace, "beta", "Running", timeout=30)
    both = {f"alpha/cuda@{gpu}": 1024 * MIB, f"beta/cuda@{gpu}": 3072 * MIB}
    wait_for(seen(both), 20, "alpha's and beta's memory in /metrics")

    # a deleted pod's series are gone with it
    kube.delete(resource_path("v1", "pods", namespace=namespace, name="alpha"))
    wait_pod_gone(kube, namespace, "alpha")
    wait_for(seen({f"beta/cuda@{gpu}": 3072 * MIB}), 20, "only beta in /metrics")
