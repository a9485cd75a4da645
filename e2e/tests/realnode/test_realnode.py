"""The real-node tier's own checks: two real kubelets (containerd, runc, CNI bridge) join the
sandbox, run a pod each, serve ``kubectl logs``, and leave nothing behind when stopped, also
when their owner was SIGKILLed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from e2e.sandbox import nodehost
from e2e.sandbox.binaries import REPO_ROOT
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent.testing import condition, unique, wait_for, wait_pod_phase
from e2e.sandbox.realnode import LABELS, Image, RealNodes, start_real_nodes
from gpuslice_kube.raw import RawApi, resource_path

pytest_plugins = ("e2e.sandbox.realnode_fixtures", "e2e.sandbox.nodeagent.fixtures")
pytestmark = pytest.mark.timeout(120)


def _pod(name: str, node: str, image: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "hello",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "echo hello; env; sleep 1"],
                }
            ],
        },
    }


_NODE_PATHS = ("/var/lib/kubelet", "/var/lib/containerd", "/run/containerd", "/run/netns")


def _host_state(run_dir: Path) -> dict[str, set[str]]:
    """What a node could leave on the host: veths and bridges, mounts of node paths (other
    work on the machine, e.g. image builds, mounts elsewhere), gpuslice cgroups."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    names = {line.split(":")[1].strip().split("@")[0] for line in links.stdout.splitlines()}
    mounts = {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    return {
        "links": {n for n in names if n.startswith(("veth", nodehost.BRIDGE_PREFIX))},
        "mounts": {
            m for m in mounts if m.startswith((*_NODE_PATHS, str(run_dir))) or "containerd" in m
        },
        "cgroups": {str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{nodehost.CGROUP_PREFIX}*")},
    }


def _kubectl(cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cp.binaries.path("kubectl")), "--kubeconfig", str(cp.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_two_real_nodes_are_ready(real_nodes: RealNodes, kube: RawApi) -> None:
    for node in real_nodes:
        obj = kube.get(resource_path("v1", "nodes", name=node.name))
        ready = condition(obj, "Ready")
        assert ready is not None and ready["status"] == "True", ready
        labels = obj["metadata"]["labels"]
        assert {k: labels.get(k) for k in LABELS} == LABELS
        assert obj["status"]["addresses"] == [{"type": "InternalIP", "address": "127.0.0.1"}]
        assert obj["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
        taints = [t["key"] for t in obj["spec"].get("taints") or []]
        assert taints == [], taints
        assert node.timings["ready"] < 30, node.timings


def test_pod_runs_on_each_node_and_logs_work(
    real_nodes: RealNodes,
    real_images: dict[str, Image],
    kube: RawApi,
    namespace: str,
    sandbox: ControlPlane,
) -> None:
    image = real_images["python-base"].ref
    ip_forward = Path("/proc/sys/net/ipv4/ip_forward").read_text()
    pods = {node.name: unique("hello") for node in real_nodes}
    for node, pod in pods.items():
        kube.create(resource_path("v1", "pods", namespace=namespace), _pod(pod, node, image))
    for node, pod in pods.items():
        done = wait_pod_phase(kube, namespace, pod, "Succeeded", timeout=60)
        assert done["spec"]["nodeName"] == node
        assert done["status"]["podIP"].startswith("10.244."), done["status"]
        logs = _kubectl(sandbox, "-n", namespace, "logs", pod)
        assert logs.returncode == 0, logs.stderr
        lines = logs.stdout.splitlines()
        assert lines[0] == "hello"
        assert "KUBERNETES_SERVICE_HOST=10.0.0.1" in lines
    # the kubelet wrote the container log where the chart's log readers expect it
    first = real_nodes.nodes[0]
    assert list(first.host_path("/var/log/pods").glob(f"{namespace}_*"))
    # the host's ip_forward is untouched: pods reach nothing beyond their bridge
    assert Path("/proc/sys/net/ipv4/ip_forward").read_text() == ip_forward


def test_stop_leaves_nothing_behind(
    sandbox: ControlPlane, real_images: dict[str, Image], tmp_path: Path, kube: RawApi
) -> None:
    before = _host_state(tmp_path)
    nodes = start_real_nodes(sandbox, [unique("stop")], run_dir=tmp_path, import_names=["pause"])
    node = nodes.nodes[0]
    assert node.slot is not None
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sleeper"},
        "spec": {
            "nodeName": node.name,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "p", "image": real_images["pause"].ref}],
        },
    }
    kube.create(resource_path("v1", "pods", namespace="default"), pod)
    try:
        wait_pod_phase(kube, "default", "sleeper", "Running", timeout=60)
        during = _host_state(tmp_path)
        assert node.slot.bridge in during["links"]
        assert any(link.startswith("veth") for link in during["links"] - before["links"])
        mnt_ns = node.mnt_ns
        assert mnt_ns and mnt_ns != str(Path("/proc/self/ns/mnt").readlink())
        # the node's mounts live only in its namespace
        assert during["mounts"] == before["mounts"]
    finally:
        left = nodes.stop()
        kube.delete(resource_path("v1", "pods", namespace="default", name="sleeper"))
    assert left == []
    assert _host_state(tmp_path) == before
    assert nodehost.leftovers(node.slot, mnt_ns, str(node.dir)) == []


_OWNER = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.realnode import start_real_nodes
cp = ControlPlane.load(Path({run!r}))
nodes = start_real_nodes(cp, [{name!r}], run_dir=Path({tmp!r}), import_names=["pause"])
print(nodes.nodes[0].slot.n, nodes.nodes[0].mnt_ns, flush=True)
time.sleep(3600)
"""


def test_sigkilled_owner_is_cleaned_up_by_the_next_start(
    sandbox: ControlPlane, real_images: dict[str, Image], tmp_path: Path, kube: RawApi
) -> None:
    """The owner dies with SIGKILL while a pod runs: kubelet, containerd and the holder die
    with it (PDEATHSIG), the shim and the pod's processes do not; sweeping (as every start and
    `down` does) removes them, the namespace, the cgroups and the bridge."""
    before = _host_state(tmp_path)
    name = unique("killed")
    script = _OWNER.format(
        repo=str(REPO_ROOT), run=str(sandbox.run_dir), name=name, tmp=str(tmp_path)
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        slot_n, mnt_ns = owner.stdout.readline().split()
        slot = nodehost.Slot(int(slot_n))
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeName": name,
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "p", "image": real_images["pause"].ref}],
            },
        }
        kube.create(resource_path("v1", "pods", namespace="default"), pod)
        wait_pod_phase(kube, "default", name, "Running", timeout=60)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
    time.sleep(0.5)
    marker = str(tmp_path / "nodes" / name)
    survivors = nodehost.leftovers(slot, mnt_ns, marker)
    assert survivors, "expected the pod's processes to outlive their owner"
    swept = nodehost.sweep_stale()
    assert any(s.startswith(f"slot {slot.n} ") for s in swept), swept
    assert nodehost.leftovers(slot, mnt_ns, marker) == []
    wait_for(lambda: _host_state(tmp_path) == before, 10, "the host to be as before")
    kube.delete(resource_path("v1", "pods", namespace="default", name=name), grace_period_seconds=0)
    kube.delete(resource_path("v1", "nodes", name=name))
