"""The real ``gpuslice-device-plugin`` process on the fake NVML, against the sandbox's real
control plane with the node agent as kubelet (device manager: kubelet.sock, ListAndWatch →
node capacity/allocatable, GetPreferredAllocation and Allocate at admission). The real
scheduler places the pods; the agent starts them with the env the plugin returned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox import procs
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import wait_for, wait_pod_phase
from e2e.sandbox.procs import Proc
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml import open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_testkit.device_plugin import write_node
from gpuslice_testkit.nvml_mock import NvmlBackend, nvml_env, nvml_flags

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPU = "nvidia.com/gpu"


MODE = {"gpuslice.dev/mode": "device-plugin"}


def command() -> list[str]:
    script = BIN / "gpuslice-device-plugin"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpuslice_device_plugin"]


@dataclass
class PluginNode:
    agent: NodeAgent
    proc: Proc
    nvml_config: Path

    @property
    def control(self) -> FakeNvmlControl:
        return FakeNvmlControl.from_config_file(self.nvml_config)

    def uuids(self) -> list[str]:
        with open_nvml("fake", self.nvml_config) as nvml:
            return [g.uuid for g in nvml.gpus()]


def start_plugin(
    agent: NodeAgent,
    kubeconfig: Path,
    nvml_config: Path,
    config: str = "",
    *extra: str,
    backend: NvmlBackend = "fake",
) -> Proc:
    """The real process, as the chart runs it: its own Node by name, the API server through a
    kubeconfig (the sandbox's admin one: the chart's RBAC is tested in test_chart.py); on the
    fake backend, or with ``backend="mock"`` on the real one over the mock libnvidia-ml."""
    root = agent.config.root
    argv = [
        *command(),
        *nvml_flags(backend, nvml_config),
        f"--device-plugins-dir={agent.config.device_plugins_dir}",
        f"--cdi-root={agent.config.cdi_dir}",
        f"--node-name={agent.name}",
        f"--kubeconfig={kubeconfig}",
        "--metrics-addr=",
        "--log-level=debug",
        *extra,
    ]
    if config:
        path = root / "device-plugin.yaml"
        path.write_text(config)
        argv.append(f"--config-file={path}")
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "NODE_NAME")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(nvml_env(backend, nvml_config))
    return procs.start(
        "device-plugin", argv, root / "device-plugin.log", env, cwd=REPO_ROOT, die_with_parent=True
    )


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


def resources(kube: RawApi, node: str, name: str = GPU) -> tuple[str | None, str | None]:
    status = kube.get(resource_path("v1", "nodes", name=node))["status"]
    return status.get("capacity", {}).get(name), status.get("allocatable", {}).get(name)


def wait_resources(
    kube: RawApi, node: PluginNode, expected: tuple[str, str], name: str = GPU
) -> None:
    def check() -> bool:
        if not node.proc.alive():
            raise AssertionError(f"the plugin exited:\n{node.proc.log_tail()}")
        return resources(kube, node.agent.name, name) == expected

    wait_for(check, 20, f"{name} capacity/allocatable {expected} on {node.agent.name}")


def gpu_pod(namespace: str, name: str, count: int, resource: str = GPU) -> Obj:
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
                    "command": ["sh", "-c", "echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; sleep 60"],
                    "resources": {"limits": {resource: str(count)}},
                }
            ],
        },
    }


def run_pod(
    kube: RawApi,
    node: PluginNode,
    namespace: str,
    name: str,
    count: int,
    resource: str = GPU,
) -> list[str]:
    """Create the pod (no node selector: the scheduler places it), wait for Running on the
    plugin's node and return the devices its container saw."""
    kube.create(
        resource_path("v1", "pods", namespace=namespace),
        gpu_pod(namespace, name, count, resource),
    )
    pod = wait_pod_phase(kube, namespace, name, "Running", timeout=30)
    assert pod["spec"]["nodeName"] == node.agent.name
    uid = pod["metadata"]["uid"]

    def visible() -> list[str] | None:
        for line in node.agent.pod_log(uid, "main").splitlines():
            if line.startswith("VISIBLE="):
                return line.removeprefix("VISIBLE=").split(",")
        return None

    return wait_for(visible, 10, f"{name}'s log")


def test_pods_get_gpus_health_drops_allocatable_and_recovers(
    kube: RawApi, namespace: str, plugin_nodes: Callable[..., PluginNode]
) -> None:
    t0 = time.monotonic()
    node = plugin_nodes(8, "", "--xid-quiet-period=1", "--health-check-interval=0.2")
    wait_resources(kube, node, ("8", "8"))
    registered = time.monotonic() - t0
    uuids = node.uuids()

    one = run_pod(kube, node, namespace, "one", 1)
    two = run_pod(kube, node, namespace, "two", 2)
    assert len(one) == 1 and len(two) == 2
    assert set(one + two) <= set(uuids) and len(set(one + two)) == 3
    pods = time.monotonic() - t0

    # a critical XID: the GPU turns Unhealthy, allocatable drops, capacity stays
    free_gpu = next(i for i, u in enumerate(uuids) if u not in one + two)
    node.control.inject_xid(free_gpu, 79)
    wait_resources(kube, node, ("8", "7"))
    node.control.inject_xid(free_gpu, 13)  # an application XID changes nothing
    # no repeat for --xid-quiet-period and the GPU answers NVML: Healthy again
    wait_resources(kube, node, ("8", "8"))
    print(
        f"registered after {registered:.1f}s, both pods running after {pods:.1f}s,"
        f" XID → recovery done after {time.monotonic() - t0:.1f}s"
    )


def test_time_slicing_runs_four_pods_on_one_gpu(
    kube: RawApi, namespace: str, plugin_nodes: Callable[..., PluginNode]
) -> None:
    config = (
        "version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}"
    )
    node = plugin_nodes(1, config)
    wait_resources(kube, node, ("4", "4"))
    [uuid] = node.uuids()
    seen = [run_pod(kube, node, namespace, f"shared-{i}", 1) for i in range(4)]
    assert seen == [[uuid]] * 4
    # the node says that these replicas are not enforced
    labels, sharing = node_sharing(kube, node.agent.name)
    assert labels == {"sharing.gpuslice.dev/gpu": "time-slicing"}
    assert sharing[GPU]["enforced"] is False and sharing[GPU]["replicas"] == 4


def node_sharing(kube: RawApi, name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The node's sharing labels and its gpuslice.dev/device-plugin-sharing annotation."""
    meta = kube.get(resource_path("v1", "nodes", name=name))["metadata"]
    labels = {k: v for k, v in meta["labels"].items() if k.startswith("sharing.gpuslice.dev/")}
    return labels, json.loads(meta["annotations"]["gpuslice.dev/device-plugin-sharing"])


def test_an_unknown_config_key_stops_start_up_naming_it(tmp_path: Path) -> None:
    nvml_config = write_node(tmp_path, {"gpus": [{"model": "H100"}]}, "bad-config")
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nflags:\n  migStrategy: none\n  migStratgy: mixed\n")
    done = subprocess.run(
        [
            *command(),
            "--nvml=fake",
            f"--fake-nvml-config={nvml_config}",
            f"--device-plugins-dir={tmp_path / 'dp'}",
            f"--config-file={config}",
            "--metrics-addr=",
            "--mode-check=false",  # no API server needed to refuse a config
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "flags.migStratgy: unknown key" in done.stderr
    assert not (tmp_path / "dp").exists()  # nothing was served
