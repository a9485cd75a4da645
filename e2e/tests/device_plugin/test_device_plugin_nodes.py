"""The device plugin on the node-agent tier, beyond part 1: the per-node mode check, the config
picked by a node label, MIG strategies, an NVLinked pair for a 2-GPU pod placed by the real
scheduler, and re-registration after a kubelet restart."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import wait_event, wait_for
from e2e.support.device_plugin import (
    GPU,
    MODE,
    PluginNode,
    configs_dir,
    node_sharing,
    resources,
    run_pod,
    wait_resources,
)
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml import open_nvml
from gpuslice_testkit.device_plugin import H100_MIXED, H100X8_NVLINK

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)

RESOURCE = "resource.k8s.io/v1"


def exited(node: PluginNode, timeout: float = 30) -> int:
    code = wait_for(node.proc.returncode, timeout, "the device plugin to exit")
    assert isinstance(code, int)
    return code


def a_slice(node: str) -> Obj:
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": {"generateName": f"{node}-gpu.gpuslice.dev-"},
        "spec": {
            "driver": "gpu.gpuslice.dev",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def test_a_dra_node_refuses_the_device_plugin(
    kube: RawApi,
    sandbox: ControlPlane,
    node_agents: Callable[..., NodeAgent],
    plugin_nodes: Callable[..., PluginNode],
) -> None:
    # a node without the mode label is a DRA node (the node DaemonSet runs there)
    dra = plugin_nodes(2, agent=node_agents())
    assert exited(dra) == 3
    event = wait_event(kube, "default", dra.agent.name, "DevicePluginRefused")
    assert event["type"] == "Warning"
    assert event["involvedObject"]["kind"] == "Node"
    assert f"node {dra.agent.name} is a DRA node (no label gpuslice.dev/mode)" in event["message"]
    assert "refusing to start" in dra.proc.log_tail()
    assert dra.agent.device_plugin_resources() == []
    assert resources(kube, dra.agent.name) == (None, None)

    # labelled device-plugin, but the DRA driver still publishes slices for it
    switching = node_agents(labels=MODE)
    made = kube.create(resource_path(RESOURCE, "resourceslices"), a_slice(switching.name))
    try:
        node = plugin_nodes(2, agent=switching)
        assert exited(node) == 3
        event = wait_event(kube, "default", switching.name, "DevicePluginRefused")
        assert (
            "the DRA driver gpu.gpuslice.dev still publishes 1 ResourceSlice(s)"
            in (event["message"])
        )
    finally:
        kube.delete(resource_path(RESOURCE, "resourceslices", name=made["metadata"]["name"]))
    # once the slices are gone the same node runs the plugin (the kubelet's restart does this)
    node = plugin_nodes(2, agent=switching)
    wait_resources(kube, node, ("2", "2"))


def test_the_node_label_picks_the_config(
    kube: RawApi, node_agents: Callable[..., NodeAgent], plugin_nodes: Callable[..., PluginNode]
) -> None:
    label = "nvidia.com/device-plugin.config"
    named = {
        "plain": "version: v1\n",
        "ts3": "version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 3}]}}\n",
        "typo": "version: v1\nflags: {migStratgy: mixed}\n",
    }
    started = []
    for value in ("ts3", None, "typo"):
        agent = node_agents(labels={**MODE, **({label: value} if value else {})})
        directory = configs_dir(agent.config.root, **named)
        started.append(
            plugin_nodes(2, "", f"--config-dir={directory}", "--default-config=plain", agent=agent)
        )
    shared, default, typo = started
    wait_resources(kube, shared, ("6", "6"))
    assert node_sharing(kube, shared.agent.name)[0] == {"sharing.gpuslice.dev/gpu": "time-slicing"}
    wait_resources(kube, default, ("2", "2"))
    assert node_sharing(kube, default.agent.name)[0] == {"sharing.gpuslice.dev/gpu": "none"}
    # the config a node's label selects is decoded strictly: a typo stops start-up naming it
    assert exited(typo) == 2
    assert "typo: flags.migStratgy: unknown key" in typo.proc.log_tail()
    assert "config selected" in shared.proc.log_tail() and "ts3" in shared.proc.log_tail()


def test_mig_mixed_and_single(
    kube: RawApi, namespace: str, plugin_nodes: Callable[..., PluginNode]
) -> None:
    mixed = plugin_nodes(H100_MIXED, "version: v1\nflags: {migStrategy: mixed}\n")
    wait_resources(kube, mixed, ("2", "2"))
    wait_resources(kube, mixed, ("4", "4"), "nvidia.com/mig-1g.10gb")
    wait_resources(kube, mixed, ("2", "2"), "nvidia.com/mig-3g.40gb")
    with open_nvml("fake", mixed.nvml_config) as nvml:
        migs = {m.uuid: m.profile for g in nvml.gpus() for m in nvml.mig_devices(g.index)}
    [mig] = run_pod(kube, mixed, namespace, "mig", 1, "nvidia.com/mig-3g.40gb")
    assert migs[mig] == "3g.40gb"

    single_doc = {
        "gpus": [
            {
                "model": "H100",
                "count": 2,
                "migEnabled": True,
                "migInstances": [{"profile": "1g.10gb", "count": 7}],
            }
        ]
    }
    single = plugin_nodes(single_doc, "version: v1\nflags: {migStrategy: single}\n")
    wait_resources(kube, single, ("14", "14"))  # every MIG device is an nvidia.com/gpu
    got = run_pod(kube, single, namespace, "single", 2)
    with open_nvml("fake", single.nvml_config) as nvml:
        uuids = {m.uuid for g in nvml.gpus() for m in nvml.mig_devices(g.index)}
    assert len(got) == 2 and set(got) <= uuids


def test_a_two_gpu_pod_gets_an_nvlinked_pair(
    kube: RawApi, namespace: str, plugin_nodes: Callable[..., PluginNode]
) -> None:
    # GPUs 0-3 and 4-7 are NVLinked among themselves (two islands). A 3-GPU pod takes three
    # of one island; of the five GPUs left one is alone on its island, so any pair with it
    # would cross islands: the plugin's preferred allocation must pick two of the other four.
    node = plugin_nodes(H100X8_NVLINK)
    wait_resources(kube, node, ("8", "8"))
    uuids = node.uuids()
    first = run_pod(kube, node, namespace, "three", 3)
    islands = [set(uuids[:4]), set(uuids[4:])]
    assert any(set(first) <= island for island in islands), first
    pair = run_pod(kube, node, namespace, "pair", 2)
    assert any(set(pair) <= island for island in islands), (first, pair)
    assert not set(pair) & set(first)


def test_kubelet_restart_re_registers(
    kube: RawApi, namespace: str, plugin_nodes: Callable[..., PluginNode]
) -> None:
    node = plugin_nodes(2)
    wait_resources(kube, node, ("2", "2"))
    running = run_pod(kube, node, namespace, "before", 1)
    agent = node.agent
    agent.stop(kill_containers=False)
    t0 = time.monotonic()
    agent.start()  # removes every socket in device-plugins/ and serves a new kubelet.sock
    wait_for(lambda: GPU in agent.device_plugin_resources(), 10, "re-registration")
    took = time.monotonic() - t0
    print(f"kubelet restart → device plugin registered again after {took * 1000:.0f} ms")
    wait_resources(kube, node, ("2", "2"))
    after = run_pod(kube, node, namespace, "after", 1)
    assert after != running and len(after) == 1
