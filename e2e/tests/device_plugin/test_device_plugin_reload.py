"""Issue 15's live reload and the plugin's own CDI spec, with the real process against the
sandbox's control plane and the node agent as kubelet.

- The node label ``nvidia.com/device-plugin.config`` switches from a config with 2
  time-slicing replicas to one with 4: the node's allocatable of ``nvidia.com/gpu`` goes from
  2xN to 4xN without a restart (the latency is printed); a label that names a config with a
  typo is refused with a Warning Event naming the key, and the old config keeps serving.
- ``cdi-cri``: a pod gets the plugin's CDI devices (``k8s.gpu.gpuslice.dev/device-plugin-gpu``),
  which the node agent resolves from the spec in its CDI root like a runtime does.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import pytest

from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import wait_event, wait_for, wait_pod_phase
from e2e.support.device_plugin import (
    MODE,
    PluginNode,
    configs_dir,
    node_sharing,
    run_pod,
    wait_resources,
)
from gpuslice_kube.raw import RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)

LABEL = "nvidia.com/device-plugin.config"
KIND = "k8s.gpu.gpuslice.dev/device-plugin-gpu"


def ts(replicas: int) -> str:
    entry = f"{{name: gpu, replicas: {replicas}}}"
    return f"version: v1\nsharing: {{timeSlicing: {{resources: [{entry}]}}}}\n"


def set_label(kube: RawApi, node: str, value: str) -> None:
    kube.patch(resource_path("v1", "nodes", name=node), {"metadata": {"labels": {LABEL: value}}})


def test_label_change_reloads_and_a_bad_config_is_refused(
    kube: RawApi,
    namespace: str,
    node_agents: Callable[..., NodeAgent],
    plugin_nodes: Callable[..., PluginNode],
) -> None:
    agent = node_agents(labels={**MODE, LABEL: "two"})
    directory = configs_dir(
        agent.config.root, two=ts(2), four=ts(4), typo="version: v1\nflags: {migStratgy: mixed}\n"
    )
    node = plugin_nodes(2, "", f"--config-dir={directory}", agent=agent)
    wait_resources(kube, node, ("4", "4"))  # 2 GPUs x 2 replicas
    run_pod(kube, node, namespace, "before", 1)

    t0 = time.monotonic()
    set_label(kube, agent.name, "four")
    wait_resources(kube, node, ("8", "8"))  # 2 GPUs x 4 replicas
    took = time.monotonic() - t0
    print(f"label change → allocatable 8 after {took * 1000:.0f} ms")
    assert node.proc.alive()
    assert node_sharing(kube, agent.name)[1]["nvidia.com/gpu"]["replicas"] == 4
    event = wait_event(kube, "default", agent.name, "DevicePluginConfigReloaded")
    assert "four applied: nvidia.com/gpu=8" in event["message"]
    # the pod admitted under the old config keeps running
    pod = kube.get(resource_path("v1", "pods", namespace=namespace, name="before"))
    assert pod["status"]["phase"] == "Running"
    assert set(run_pod(kube, node, namespace, "after", 1)) <= set(node.uuids())

    # a label naming a config with a typo: refused naming the key, the old config serves on
    set_label(kube, agent.name, "typo")
    event = wait_event(kube, "default", agent.name, "DevicePluginConfigRefused")
    assert event["type"] == "Warning"
    assert "typo: flags.migStratgy: unknown key" in event["message"]
    assert "the previous one (four) keeps serving" in event["message"]
    assert node.proc.alive()
    wait_resources(kube, node, ("8", "8"))
    run_pod(kube, node, namespace, "still", 1)

    # a changed ConfigMap content (the label still says "typo") is picked up by the poll
    t0 = time.monotonic()
    (directory / "typo").write_text(ts(3))
    wait_resources(kube, node, ("6", "6"))
    print(f"config content change → allocatable 6 after {(time.monotonic() - t0) * 1000:.0f} ms")

    # SIGHUP: a manual reload of unchanged inputs keeps serving
    os.kill(node.proc.pid, signal.SIGHUP)
    wait_for(lambda: "reloading the configuration" in node.proc.log_tail(200), 10, "SIGHUP")
    wait_resources(kube, node, ("6", "6"))
    assert node.proc.alive()


def test_cdi_cri_pods_get_the_plugins_own_cdi_devices(
    kube: RawApi, namespace: str, plugin_nodes: Callable[..., PluginNode]
) -> None:
    node = plugin_nodes(4, "version: v1\nflags: {plugin: {deviceListStrategy: cdi-cri}}\n")
    wait_resources(kube, node, ("4", "4"))
    spec_path = node.agent.config.cdi_dir / "k8s.gpu.gpuslice.dev-device-plugin-gpu_node.json"
    spec = json.loads(spec_path.read_text())
    assert spec["kind"] == KIND and len(spec["devices"]) == 4
    got = run_pod(kube, node, namespace, "two", 2)
    assert len(got) == 2 and set(got) <= set(node.uuids())
    pod = wait_pod_phase(kube, namespace, "two", "Running")
    uid = pod["metadata"]["uid"]
    assert node.agent.container_cdi_devices(uid, "main") == [f"{KIND}=node-{u}" for u in got]
    env = node.agent.container_edits(uid, "main")["env"]
    assert isinstance(env, list)
    assert {e.split("=", 1)[1] for e in env if e.startswith("GPUSLICE_") and "_UUID=" in e} == set(
        got
    )
