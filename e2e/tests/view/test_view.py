"""``kubectl gpuslice`` against the real control plane: a sandbox GPU node (node agent + the real
kubelet plugin, 2 H100s and one in MIG mode with a 1g.10gb instance), pods whose claims the real
scheduler allocates, cordons that the real scheduler and the real device-taint eviction
controller obey. The plugin runs as a subprocess, the console script users install, with the
sandbox's kubeconfig. One node and one namespace serve the module; the tests run in order."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    GpuNode,
    on_gpu,
    running_gpu_node,
)
from e2e.sandbox.nodeagent.testing import (
    condition,
    get_pod,
    temporary_namespace,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
)
from e2e.support.view import delete_pods, start_pod
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_view.feed import ViewFeeder
from gpuslice_view.report import gpu_rows
from gpuslice_view.resource import API_VERSION, row_of
from gpuslice_view.source import load

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)

PLUGIN = Path(sys.executable).parent / "kubectl-gpuslice"
NODE_GPUS = [
    {"model": "H100", "count": 2},
    {"model": "H100", "migEnabled": True, "migInstances": [{"profile": "1g.10gb", "placement": 0}]},
]
MIG = "gpu-2-mig-1g-10gb-0"
ON_A100 = "device.attributes['gpu.gpuslice.dev'].productName == 'NVIDIA A100-SXM4-40GB'"


@pytest.fixture(scope="module")
def node(sandbox: ControlPlane, kube: RawApi, device_classes: list[str]) -> Iterator[GpuNode]:
    with running_gpu_node(sandbox, kube, NODE_GPUS, devices=3) as gpu_node:
        yield gpu_node


@pytest.fixture(scope="module")
def ns(kube: RawApi, node: GpuNode) -> Iterator[str]:
    with temporary_namespace(kube, "view") as name:
        yield name


class Cli:
    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.base = [str(PLUGIN), "--kubeconfig", str(kubeconfig), "-n", namespace]

    def done(self, *args: str, rc: int = 0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == rc, f"{args}: rc {done.returncode}\n{done.stdout}{done.stderr}"
        return done

    def run(self, *args: str, rc: int = 0) -> str:
        done = self.done(*args, rc=rc)
        return done.stdout + done.stderr

    def json(self, *args: str) -> Any:
        # stdout only: stderr has the note that no controller is named (no APIService here)
        return json.loads(self.done(*args, "-o", "json").stdout)


@pytest.fixture(scope="module")
def cli(sandbox: ControlPlane, ns: str) -> Cli:
    return Cli(sandbox.kubeconfig, ns)


def wait_unschedulable(kube: RawApi, ns: str, name: str) -> str:
    def check() -> str | None:
        pod = get_pod(kube, ns, name)
        cond = condition(pod, "PodScheduled") if pod else None
        return str(cond.get("message")) if cond and cond["status"] == "False" else None

    return wait_for(check, 30, f"{name} to be Unschedulable")


def rows(cli: Cli, node: GpuNode) -> dict[str, Obj]:
    listed = cli.json("top", "gpus")  # a GPUList whatever the source
    assert (listed["apiVersion"], listed["kind"]) == (API_VERSION, "GPUList")
    found = [row_of(obj) for obj in listed["items"]]
    return {r["device"]: r for r in found if r["node"] == node.name}


def test_top_describe_and_claims_follow_create_and_delete(
    cli: Cli, kube: RawApi, node: GpuNode, ns: str
) -> None:
    start_pod(kube, ns, node, "share", selector=on_gpu(0), cores="30", memory="20Gi")
    wait_pod_phase(kube, ns, "share", "Running", timeout=30)

    gpu0 = rows(cli, node)["gpu-0"]
    assert gpu0["uuid"] == node.gpu_uuid(0)
    assert gpu0["cores"] == {"total": 100, "used": 30}
    assert gpu0["memory"]["used"] == 20 * 1024**3
    [share] = gpu0["allocations"]
    assert share["claim"].startswith(f"{ns}/share-") and share["pods"] == ["share"]

    table = cli.run("top", "gpus")
    lines = [line.split() for line in table.splitlines() if line.startswith(node.name)]
    assert lines[0][:2] == [node.name, "gpu-0"] and "30%" in lines[0] and "20Gi/79.6Gi" in lines[0]
    assert [line[1] for line in lines] == ["gpu-0", "gpu-1", MIG]
    assert all(line[-1] == "Ready" for line in lines)

    described = cli.run("describe", "gpu", node.gpu_uuid(0))
    assert f"Device:     {node.name}/0" in described
    assert "Cores:      30% of 100% allocated" in described
    assert share["claim"] in described and "share" in described.split(share["claim"])[1]

    listed = cli.run("claims", "-A")
    [mine] = [line.split() for line in listed.splitlines() if line.startswith(ns)]
    assert mine[2:] == ["Allocated", f"{node.name}/0", "30%", "20Gi", "-", "-", "share"]

    delete_pods(kube, ns, "share")
    wait_for(lambda: rows(cli, node)["gpu-0"]["allocations"] == [], 30, "gpu-0 free in the view")
    assert rows(cli, node)["gpu-0"]["cores"]["used"] == 0
    missing = cli.run("describe", "gpu", f"{node.name}/9", rc=1)
    assert f"no GPU '{node.name}/9'" in missing and f"Known: {node.name}/0" in missing


def test_the_watch_fed_view_matches_a_fresh_list(kube: RawApi, node: GpuNode, ns: str) -> None:
    """What the controller holds (``ViewFeeder``: list, then watch) is what a fresh list of
    every kind builds, after a create and after a delete."""
    feeder = ViewFeeder(kube)
    feeder.start()
    try:
        assert feeder.synced.wait(30), "the feeder's reflectors never synced"

        def fed() -> dict[str, Obj]:
            return {r["device"]: r for r in feeder.read(gpu_rows) if r["node"] == node.name}

        def listed() -> dict[str, Obj]:
            view = load(kube, all_pods=True)
            return {r["device"]: r for r in gpu_rows(view) if r["node"] == node.name}

        start_pod(kube, ns, node, "fed", selector=on_gpu(1), cores="40", memory="8Gi")
        wait_pod_phase(kube, ns, "fed", "Running", timeout=30)
        wait_for(lambda: fed()["gpu-1"]["allocations"], 10, "the claim in the fed view")
        # a watch may lag a fresh list by an event or two, never for good
        wait_for(lambda: fed() == listed(), 10, "the fed view to equal a fresh list")
        assert fed()["gpu-1"]["allocations"][0]["pods"] == ["fed"]

        delete_pods(kube, ns, "fed")
        wait_for(lambda: not fed()["gpu-1"]["allocations"], 30, "gpu-1 free in the fed view")
        wait_for(lambda: fed() == listed(), 10, "the fed view to equal a fresh list")
        assert feeder.events["ResourceClaim"] > 0 and feeder.events["Pod"] > 0
    finally:
        feeder.stop()


def test_why_names_the_cause(cli: Cli, kube: RawApi, node: GpuNode, ns: str) -> None:
    for i in (0, 1):
        start_pod(kube, ns, node, f"big{i}", selector=on_gpu(i), cores="10", memory="60Gi")
    start_pod(kube, ns, node, "mig", device_class="mig.gpuslice.dev")
    for name in ("big0", "big1", "mig"):
        wait_pod_phase(kube, ns, name, "Running", timeout=30)
    start_pod(kube, ns, node, "memory", cores="10", memory="30Gi")
    start_pod(kube, ns, node, "booked", device_class="mig.gpuslice.dev")
    start_pod(kube, ns, node, "a100", selector=ON_A100)
    expected = {
        "memory": (
            "NoFreeMemory",
            "no matching GPU has 30Gi of free memory; the largest free is 19.6Gi",
        ),
        "booked": (
            "FullyBooked",
            f"the one matching device is fully booked (NVIDIA H100 80GB HBM3): {node.name}/{MIG}",
        ),
        "a100": ("NoMatch", "productName is 'NVIDIA H100 80GB HBM3'"),
    }
    for name, (code, text) in expected.items():
        assert "cannot allocate all claims" in wait_unschedulable(kube, ns, name)
        got = cli.json("why", f"pod/{name}")
        assert (got["kind"], got["metadata"]["name"]) == ("GPUReason", name)
        [reason] = got["status"]["reasons"]
        assert reason["code"] == code, got
        assert text in reason["message"], got
        assert got["status"]["scheduler"]  # the scheduler's own message comes along
    running = cli.run("why", "big0")
    assert f"Allocated: claim {ns}/big0-" in running and f"gpu on {node.name}/0" in running
    delete_pods(kube, ns, "big0", "big1", "mig", "memory", "booked", "a100")


def test_cordon_keeps_new_claims_off_and_evict_evicts(
    cli: Cli, kube: RawApi, node: GpuNode, ns: str
) -> None:
    start_pod(kube, ns, node, "victim", selector=on_gpu(1), cores="10", memory="1Gi")
    wait_pod_phase(kube, ns, "victim", "Running", timeout=30)
    ref = f"{node.name}/1"
    rule = f"gpuslice-cordon-{node.name}-gpu-1"
    assert cli.run("cordon", ref) == f"{ref} cordoned (NoSchedule, DeviceTaintRule {rule})\n"
    assert cli.run("cordon", node.gpu_uuid(1)) == f"{ref} already cordoned (NoSchedule)\n"
    assert rows(cli, node)["gpu-1"]["status"] == "Cordoned"

    start_pod(kube, ns, node, "pinned", selector=on_gpu(1), cores="10", memory="1Gi")
    start_pod(kube, ns, node, "anywhere", cores="10", memory="1Gi")
    wait_unschedulable(kube, ns, "pinned")
    [reason] = cli.json("why", "pinned")["status"]["reasons"]
    assert reason["code"] == "Tainted"
    assert (
        f"{ref}: gpu.gpuslice.dev/cordon:NoSchedule (DeviceTaintRule {rule})" in reason["message"]
    )
    wait_pod_phase(kube, ns, "anywhere", "Running", timeout=30)
    assert [a["pods"] for a in rows(cli, node)["gpu-0"]["allocations"]] == [["anywhere"]]
    assert get_pod(kube, ns, "victim")["status"]["phase"] == "Running"  # type: ignore[index]

    assert "cordoned (NoExecute" in cli.run("cordon", ref, "--evict")
    wait_pod_gone(kube, ns, "victim", timeout=60)  # the device-taint eviction controller
    assert rows(cli, node)["gpu-1"]["status"] == "Cordoned(evict)"

    assert cli.run("uncordon", ref) == f"{ref} uncordoned\n"
    assert cli.run("uncordon", ref) == f"{ref} is not cordoned\n"
    wait_pod_phase(kube, ns, "pinned", "Running", timeout=30)
    assert rows(cli, node)["gpu-1"]["status"] == "Ready"
    delete_pods(kube, ns, "pinned", "anywhere")
