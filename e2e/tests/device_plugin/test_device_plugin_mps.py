"""sharing.mps on the node-agent tier: the real device plugin and the real enforcer (the node
services of e2e/sandbox/nodeservices.py, driver 615: memory partitioning and MPS protocol 3) on
one fake-NVML node; the real scheduler places pods that write ``nvidia.com/gpu: 1``, and each
container gets a replica whose limits the enforcer holds and states in the pod's log."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import wait_for, wait_pod_phase
from e2e.sandbox.nodeservices import NodeServices
from e2e.support.device_plugin import GPU, MODE, PluginNode, node_sharing, wait_resources
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml import open_nvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as epb

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
MPS4 = "version: v1\nsharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}\n"


@pytest.fixture
def services(sandbox: ControlPlane) -> Iterator[NodeServices]:
    running = NodeServices.start(
        sandbox, [{"model": "L4", "count": 1}], enforcer=True, nvml={"driverVersion": "615.20"}
    )
    yield running
    left = running.stop()
    assert left == [], running.logs()
    shutil.rmtree(running.root, ignore_errors=True)


def printing_pod(namespace: str, name: str, count: int) -> Obj:
    show = "env | grep -E '^(GPUSLICE_|CUDA_MPS_|NVIDIA_VISIBLE_DEVICES=)' | sort; echo END"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "command": ["sh", "-c", f"{show}; sleep 60"],
                    "resources": {"limits": {GPU: str(count)}},
                }
            ],
        },
    }


def pod_env(kube: RawApi, node: PluginNode, namespace: str, name: str) -> dict[str, str]:
    kube.create(resource_path("v1", "pods", namespace=namespace), printing_pod(namespace, name, 1))
    pod = wait_pod_phase(kube, namespace, name, "Running", timeout=30)
    uid = pod["metadata"]["uid"]

    def logged() -> dict[str, str] | None:
        lines = node.agent.pod_log(uid, "main").splitlines()
        if "END" not in lines:
            return None
        return dict(line.split("=", 1) for line in lines if "=" in line)

    env = wait_for(logged, 10, f"{name}'s log")
    assert isinstance(env, dict)
    # the container got exactly its replica's CDI device, whose createContainer hook (the
    # enforcer's: it binds the container to the share and fails the container when it
    # cannot) ran before the container started
    [cdi_id] = node.agent.container_cdi_devices(uid, "main")
    assert cdi_id.startswith("k8s.gpu.gpuslice.dev/device-plugin=gpu-0-")
    hooks = node.agent.container_edits(uid, "main")["hooks"]
    assert isinstance(hooks, list)
    assert [h["hookName"] for h in hooks if "gpuslice-enforcer-hook" in h["path"]] == [
        "createContainer",
        "poststop",
    ]
    return env


def field(env: dict[str, str], name: str) -> str:
    """The one GPUSLICE_<device>_<name> variable of a container with one replica."""
    [value] = [v for k, v in env.items() if k.startswith("GPUSLICE_") and k.endswith(f"_{name}")]
    return value


def test_mps_replicas_run_with_enforced_equal_shares(
    kube: RawApi,
    namespace: str,
    services: NodeServices,
    node_agents: Callable[..., NodeAgent],
    plugin_nodes: Callable[..., PluginNode],
) -> None:
    agent = node_agents(labels=MODE)
    node = plugin_nodes(
        1,
        MPS4,
        f"--enforcer-socket={services.enforcer_socket}",
        agent=agent,
        nvml_config=services.nvml_config,
    )
    wait_resources(kube, node, ("4", "4"))
    with open_nvml("fake", services.nvml_config) as nvml:
        [gpu] = nvml.gpus()
    quarter = gpu.memory_total_bytes // 4 // MIB * MIB

    seen = [pod_env(kube, node, namespace, f"mps-{i}") for i in range(2)]
    for env in seen:
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid
        assert (field(env, "CORES"), field(env, "MEMORY")) == ("25", str(quarter))
        assert field(env, "ENFORCEMENT") == "hard"
        assert field(env, "MEMORY_MECHANISM") == "memory-partition"
        assert field(env, "CORES_MECHANISM") == "mps-protocol3"
        assert "CUDA_MPS_PIPE_DIRECTORY" in env  # a client of its replica's MPS namespace
    assert field(seen[0], "SHARE_ID") != field(seen[1], "SHARE_ID")

    # the enforcer holds one share per replica, each a quarter of the GPU
    with services.enforcer() as stub:
        shares = stub.GetUsage(epb.GetUsageRequest(), timeout=10).shares
    ours = [s for s in shares if s.claim_uid.startswith("dp-")]
    assert len(ours) == 4
    assert {(s.devices[0].sm_limit_percent, s.devices[0].memory_limit_bytes) for s in ours} == {
        (25, quarter)
    }
    assert {field(env, "SHARE_ID") for env in seen} <= {s.share_id for s in ours}

    # the node says how nvidia.com/gpu is shared, and that it is enforced
    labels, sharing = node_sharing(kube, agent.name)
    assert labels == {"sharing.gpuslice.dev/gpu": "mps"}
    assert sharing[GPU] | {} == {
        "sharing": "mps",
        "devices": 4,
        "replicas": 4,
        "enforced": True,
        "enforcement": "hard",
        "cores": 25,
        "memoryBytes": quarter,
        "memoryMechanism": "memory-partition",
        "coresMechanism": "mps-protocol3",
    }

    # one container, one MPS share: two replicas are refused at admission
    kube.create(resource_path("v1", "pods", namespace=namespace), printing_pod(namespace, "two", 2))
    pod = wait_pod_phase(kube, namespace, "two", "Failed", timeout=30)
    assert pod["status"]["reason"] == "UnexpectedAdmissionError"
    assert "failRequestsGreaterThanOne allows 1 per container" in pod["status"]["message"]
