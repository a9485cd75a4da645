"""The real ``gpuslice-device-plugin`` process on the fake NVML, against the sandbox's real
control plane with the node agent as kubelet (device manager: kubelet.sock, ListAndWatch →
node capacity/allocatable, GetPreferredAllocation and Allocate at admission). The real
scheduler places the pods; the agent starts them with the env the plugin returned."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.support.device_plugin import (
    GPU,
    PluginNode,
    command,
    node_sharing,
    run_pod,
    wait_resources,
)
from gpuslice_kube.raw import RawApi
from gpuslice_testkit.device_plugin import write_node

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)


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
            "--health-addr=",
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
