"""The cluster view against the real control plane through a node's life: pods created and
deleted, the kubelet plugin killed (-9) and started again, a node lost. Two sandbox GPU nodes
(node agent + the real kubelet plugin, one H100 each); the view is the controller's
(``ViewFeeder``: list, then watch), checked against the allocations and against a fresh list.
And live usage: the real enforcer of a node pod measures a fake CUDA process in a pod's
container, and the view (``LivePoller`` finding the enforcer through the node pod's labels and
port, as in the chart) shows it against the share's limit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import GpuNode, start_gpu_node, stop_gpu_node
from e2e.sandbox.nodeagent.testing import wait_for, wait_pod_phase
from e2e.sandbox.nodeservices import NodePod, serve_node_pod, start_node_pod
from e2e.sandbox.procs import free_port
from e2e.support.view import delete_pods, start_pod
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.enforcer import Workload
from gpuslice_view import live
from gpuslice_view.feed import ViewFeeder
from gpuslice_view.report import claim_rows, gpu_rows
from gpuslice_view.source import load

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(180)

GIB = 1024**3
ONE_H100 = [{"model": "H100", "count": 1}]
Rows = dict[tuple[str, str], Obj]


@pytest.fixture
def feeder(kube: RawApi) -> Iterator[ViewFeeder]:
    fed = ViewFeeder(kube)
    fed.start()
    try:
        assert fed.synced.wait(30), "the feeder's reflectors never synced"
        yield fed
    finally:
        fed.stop()


@pytest.fixture
def nodes(
    sandbox: ControlPlane, kube: RawApi, device_classes: list[str]
) -> Iterator[list[GpuNode]]:
    started = [start_gpu_node(sandbox, ONE_H100) for _ in range(2)]
    try:
        for node in started:
            wait_for(lambda n=node: len(n.devices(kube)) == 1, 20, f"{node.name}'s GPU")  # type: ignore[misc]
        yield started
    finally:
        for node in started:
            stop_gpu_node(node, kube)


def rows_of(all_rows: list[Obj], names: set[str]) -> Rows:
    return {(r["node"], r["device"]): r for r in all_rows if r["node"] in names}


def test_the_view_follows_create_delete_plugin_restart_and_node_loss(
    kube: RawApi, feeder: ViewFeeder, nodes: list[GpuNode], namespace: str
) -> None:
    a, b = nodes
    names = {a.name, b.name}

    def fed() -> Rows:
        return rows_of(feeder.read(gpu_rows), names)

    def settled(what: str) -> Rows:
        """The fed view once it equals a fresh list of every kind (a watch may lag a list by an
        event or two, never for good)."""

        def same() -> Rows | None:
            now = fed()
            return now if now == rows_of(gpu_rows(load(kube, all_pods=True)), names) else None

        return wait_for(same, 15, f"the fed view to equal a fresh list {what}")

    def holders(rows: Rows, node: GpuNode) -> list[tuple[int, int, list[str]]]:
        return [
            (s["cores"], s["memory"], s["pods"]) for s in rows[(node.name, "gpu-0")]["allocations"]
        ]

    # create: each pod's share on its node's GPU, with its pod
    start_pod(kube, namespace, a, "on-a", cores="30", memory="20Gi")
    start_pod(kube, namespace, b, "on-b", cores="50", memory="8Gi")
    for name in ("on-a", "on-b"):
        wait_pod_phase(kube, namespace, name, "Running", timeout=30)
    wait_for(lambda: all(holders(fed(), n) for n in nodes), 10, "both shares in the view")
    rows = settled("after the create")
    assert holders(rows, a) == [(30, 20 * GIB, ["on-a"])]
    assert holders(rows, b) == [(50, 8 * GIB, ["on-b"])]
    assert rows[(a.name, "gpu-0")]["cores"] == {"total": 100, "used": 30}

    # the kubelet plugin crashes and starts again: the same view, nothing twice
    generation = a.slices(kube)[0]["spec"]["pool"]["generation"]
    a.plugin.kill9()
    a.plugin.start()
    assert a.agent is not None
    wait_for(lambda: "gpu.gpuslice.dev" in a.agent.registered_drivers(), 20, "re-registration")  # type: ignore[union-attr]
    assert (
        len(a.slices(kube)) == 1 and a.slices(kube)[0]["spec"]["pool"]["generation"] >= generation
    )
    assert settled("after the plugin restart") == rows
    refs = [r["ref"] for r in feeder.read(gpu_rows)]
    assert len(refs) == len(set(refs)), f"a device twice in the view: {refs}"
    assert wait_pod_phase(kube, namespace, "on-a", "Running", timeout=5)

    # delete: the GPU is free again
    delete_pods(kube, namespace, "on-a")
    wait_for(lambda: not holders(fed(), a), 30, f"{a.name}'s GPU free in the view")
    rows = settled("after the delete")
    assert rows[(a.name, "gpu-0")]["memory"]["used"] == 0
    assert holders(rows, b) == [(50, 8 * GIB, ["on-b"])]

    # node loss: its kubelet (agent) and plugin die, the Node object is deleted. The pool's
    # slices name the Node as their owner, so the garbage collector deletes them with it: the
    # lost node's GPU leaves the view; the claim that was on it stays allocated (nothing
    # deallocates a claim whose pod still exists), on a device that no longer has a row.
    assert {o["uid"] for s in b.slices(kube) for o in s["metadata"]["ownerReferences"]} == {
        kube.get(resource_path("v1", "nodes", name=b.name))["metadata"]["uid"]
    }
    b.plugin.kill9()
    assert b.agent is not None
    b.agent.stop()
    kube.delete(resource_path("v1", "nodes", name=b.name))
    wait_for(lambda: kube_missing(kube, resource_path("v1", "nodes", name=b.name)), 20, "Node gone")
    wait_for(lambda: not b.slices(kube), 30, f"{b.name}'s slices collected with the Node")
    wait_for(lambda: (b.name, "gpu-0") not in fed() or None, 20, f"{b.name}'s GPU gone")
    rows = settled("after the node loss")
    assert holders(rows, a) == []
    [on_b] = [r for r in feeder.read(lambda v: claim_rows(v, namespace)) if r["pods"] == ["on-b"]]
    assert on_b["devices"][0]["device"] == f"{b.name}/gpu-0"  # still allocated, no device row


def kube_missing(kube: RawApi, path: str) -> bool:
    try:
        kube.get(path)
    except KubeNotFoundError:
        return True
    return False


@pytest.fixture
def enforcer_node(
    sandbox: ControlPlane, kube: RawApi, device_classes: list[str], request: pytest.FixtureRequest
) -> Iterator[tuple[NodePod, int]]:
    """A node pod (plugin + real enforcer, watchdog only) whose enforcer serves metrics."""
    port = free_port()
    pod = start_node_pod(
        sandbox,
        [{"model": "L4", "count": 1}],
        enforcer_args=("--mps=off", f"--metrics-addr=127.0.0.1:{port}", "--sample-interval=0.1"),
        nvml={"driverVersion": "615.20"},
    )
    yield from ((p, port) for p in serve_node_pod(pod, kube, lambda: request.session.testsfailed))


def node_pod_object(namespace: str, node: str, port: int) -> Obj:
    """The DaemonSet pod's stand-in in the API: the chart's labels and the port named
    ``enforcer``; the node agent runs it and gives it the node's IP, where the enforcer
    process listens."""
    labels = dict(kv.split("=") for kv in live.NODE_SELECTOR.split(","))
    container: dict[str, Any] = {
        "name": "enforcer",
        "image": "busybox",
        "command": ["sh", "-c", "sleep 300"],
        "ports": [{"name": live.PORT_NAME, "containerPort": port}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"node-{node}"[:60], "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [container]},
    }


def test_live_usage_from_a_real_enforcer_shows_in_the_view(
    kube: RawApi,
    feeder: ViewFeeder,
    enforcer_node: tuple[NodePod, int],
    namespace: str,
) -> None:
    pod, port = enforcer_node
    node = pod.node
    assert node.agent is not None
    kube.create(
        resource_path("v1", "pods", namespace=namespace),
        node_pod_object(namespace, node.name, port),
    )
    start_pod(kube, namespace, node, "busy", cores="30", memory="4Gi")
    running = wait_pod_phase(kube, namespace, "busy", "Running", timeout=30)
    container = node.agent.runtime.adopt(running["metadata"]["uid"], "main")
    assert container is not None and container.cgroups
    poller = live.LivePoller(
        lambda: live.discover(kube, namespace), feeder.set_live, interval=0.5, timeout=2
    )

    def row() -> Obj:
        [found] = [r for r in feeder.read(gpu_rows) if r["node"] == node.name]
        return found

    # before anything runs: the node is measured, the share uses nothing yet
    poller.poll_once()
    assert row()["live"]["state"] == "ok"
    # a fake CUDA process in the pod's container: 1 GiB and 20% SM on the L4
    workload = Workload(node.nvml_config, memory=GIB, sm=20, cgroup_dirs=container.cgroups)
    try:

        def measured() -> Obj | None:
            poller.poll_once()
            [share] = row()["allocations"]
            return share if share["memoryUsed"] == GIB else None

        share = wait_for(measured, 20, "the process's memory in the view")
        assert share["memory"] == 4 * GIB and share["cores"] == 30  # against the limit
        assert 0 < share["smUsed"] <= 30
        gpu = row()
        assert gpu["live"]["memoryUsed"] == GIB and gpu["live"]["state"] == "ok"
        [claim] = [r for r in feeder.read(lambda v: claim_rows(v, namespace))]
        assert claim["devices"][0]["memoryUsed"] == GIB
    finally:
        workload.stop()

    # the enforcer goes away: the node's figures become unknown, not the last numbers
    pod.services.stop()
    poller.poll_once()
    gone = row()
    assert gone["live"]["state"] == "unreachable" and gone["live"]["memoryUsed"] is None
    assert gone["allocations"][0]["memoryUsed"] is None
    with contextlib.suppress(KubeNotFoundError):
        kube.delete(resource_path("v1", "pods", namespace=namespace, name="busy"))
