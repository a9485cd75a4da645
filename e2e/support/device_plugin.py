"""Helpers the device-plugin tests share that are not fixtures (``plugin_nodes``, a node agent
with the real device plugin running on it, is a fixture in
e2e/tests/device_plugin/conftest.py)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.sandbox import procs
from e2e.sandbox.binaries import REPO_ROOT
from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import wait_for, wait_pod_phase
from e2e.sandbox.procs import Proc
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml import open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_testkit.nvml_mock import NvmlBackend, nvml_env, nvml_flags

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
        "--health-addr=",
        "--log-level=debug",
        *extra,
    ]
    if config:
        path = root / "device-plugin.yaml"
        path.write_text(config)
        argv.append(f"--config-file={path}")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KUBECONFIG", "NODE_NAME", "GPUSLICE_NODE_NAME")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(nvml_env(backend, nvml_config))
    return procs.start(
        "device-plugin", argv, root / "device-plugin.log", env, cwd=REPO_ROOT, die_with_parent=True
    )


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


def node_sharing(kube: RawApi, name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The node's sharing labels and its gpuslice.dev/device-plugin-sharing annotation."""
    meta = kube.get(resource_path("v1", "nodes", name=name))["metadata"]
    labels = {k: v for k, v in meta["labels"].items() if k.startswith("sharing.gpuslice.dev/")}
    return labels, json.loads(meta["annotations"]["gpuslice.dev/device-plugin-sharing"])


def configs_dir(root: Path, **named: str) -> Path:
    """The named configs as a ConfigMap volume lays them out (one file per key)."""
    directory = root / "device-plugin-configs"
    directory.mkdir()
    for name, text in named.items():
        (directory / name).write_text(text)
    return directory
