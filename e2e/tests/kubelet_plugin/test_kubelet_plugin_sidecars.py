"""The enforcer and the MIG manager as real gRPC servers (stand-ins) on unix sockets, the plugin
in-process against the sandbox's API server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import create_gated_pod, delete_node_slices
from e2e.support.kubelet_plugin import ClaimMaker
from gpuslice_core.cdi import load_spec
from gpuslice_kube.raw import RawApi, resource_path
from gpuslice_kubelet_plugin.cdispecs import device_env
from gpuslice_nvml import open_nvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as epb
from gpuslice_testkit.kubelet_plugin.dra import gpu_config, ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness, Node, Running, write_node
from gpuslice_testkit.kubelet_plugin.standins import StandinEnforcer, StandinMigManager

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def enforcer(short_dir: Path, fake_node: Node) -> Iterator[StandinEnforcer]:
    uuids = tuple(fake_node.nvml.gpu(i).uuid for i in range(2))
    standin = StandinEnforcer(gpus=uuids).serve(short_dir / "enforcer.sock")
    yield standin
    standin.stop()


def test_a_share_is_enforced_through_the_enforcer(
    harness: Harness,
    claims: ClaimMaker,
    fake_node: Node,
    node_name: str,
    enforcer: StandinEnforcer,
    short_dir: Path,
    kube: RawApi,
    namespace: str,
) -> None:
    plugin = harness.start(enforcer_socket=short_dir / "enforcer.sock")
    gpu0 = plugin.app.devices.inventory.get("gpu-0")
    assert gpu0 is not None and gpu0.attributes["enforcement"] == {"string": "hard"}
    # the claim is reserved for a pod that exists (the resource-claim controller drops
    # reservations of pods it cannot find); a scheduling gate keeps it off every node
    pod = create_gated_pod(kube, namespace, "p1", claim="share")
    try:
        pod_uid = pod["metadata"]["uid"]
        claim = claims(
            "share",
            results=[result("gpu-0", pool=node_name, cores="30", memory="20Gi")],
            config=[gpu_config(enforcement={"mode": "Soft", "workConserving": True})],
            reserved_for=(("p1", pod_uid),),
        )
        uid = claim["metadata"]["uid"]
        assert plugin.client.prepare([ref(claim)])[uid].error == ""
        share_id, request = enforcer.shares[uid]
        assert request.cores_percent == 30
        assert request.memory_bytes == 20 * 1024**3
        assert list(request.device_uuids) == [fake_node.nvml.gpu(0).uuid]
        assert request.mode == epb.ENFORCEMENT_MODE_SOFT and request.work_conserving
        assert [(p.name, p.uid) for p in request.pods] == [("p1", pod_uid)]
        spec = load_spec(plugin.state.cdi.specs.spec_path(uid))
        assert spec.container_edits.is_empty()  # the enforcer's edits are the device's
        [device] = spec.devices
        env = dict(e.split("=", 1) for e in device.container_edits.env)
        [(key, fields)] = device_env(env).items()
        assert key.startswith("GPU_0_")  # + the allocation's share ID
        assert fields == {
            "UUID": fake_node.nvml.gpu(0).uuid,
            "DEVICE": "gpu-0",
            "CLAIM": f"{namespace}/share",
            "CLAIM_UID": uid,
            "REQUEST": "gpu",
            "CORES": "30",
            "MEMORY": str(20 * 1024**3),
            "ENFORCEMENT": "hard",
            "SHARE_ID": share_id,
            "MEMORY_MECHANISM": "mps-protocol3",
            "CORES_MECHANISM": "mps-protocol3",
        }
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"/run/gpuslice/mps/{share_id}"
        assert [m.container_path for m in device.container_edits.mounts] == [
            f"/run/gpuslice/mps/{share_id}"
        ]

        assert plugin.client.prepare([ref(claim)])[uid].error == ""  # idempotent
        assert enforcer.created[uid] == 1
        assert plugin.client.unprepare([ref(claim)]) == {uid: ""}
        assert uid not in enforcer.shares and enforcer.released[uid] == 1
    finally:
        kube.delete(resource_path("v1", "pods", namespace=namespace, name="p1"))


def test_an_exclusive_gpu_needs_no_share(
    harness: Harness,
    claims: ClaimMaker,
    node_name: str,
    enforcer: StandinEnforcer,
    short_dir: Path,
) -> None:
    plugin = harness.start(enforcer_socket=short_dir / "enforcer.sock")
    claim = claims(
        "whole", results=[result("gpu-1", pool=node_name, cores="100", memory="81559Mi")]
    )
    assert plugin.client.prepare([ref(claim)])[claim["metadata"]["uid"]].error == ""
    assert enforcer.shares == {}


def test_an_enforcer_refusal_fails_the_claim_and_leaves_nothing(
    harness: Harness,
    claims: ClaimMaker,
    node_name: str,
    enforcer: StandinEnforcer,
    short_dir: Path,
) -> None:
    plugin = harness.start(enforcer_socket=short_dir / "enforcer.sock")
    enforcer.fail = lambda req: "MPS is not available on GPU-x (strict)"
    claim = claims("s", results=[result("gpu-0", pool=node_name, cores="10", memory="1Gi")])
    uid = claim["metadata"]["uid"]
    error = plugin.client.prepare([ref(claim)])[uid].error
    assert "enforcer CreateShare" in error and "MPS is not available" in error
    assert uid not in plugin.state.committer.read().claims
    assert not plugin.state.cdi.exists(uid)
    enforcer.fail = None
    assert plugin.client.prepare([ref(claim)])[uid].error == ""


@pytest.fixture
def dyn(
    sandbox: ControlPlane, kube: RawApi, short_dir: Path, node_name: str
) -> Iterator[tuple[Running, StandinMigManager]]:
    config = write_node(short_dir, [{"model": "H100", "count": 2, "migEnabled": True}], "dyn")
    with open_nvml("fake", config) as nvml, open_nvml("fake", config) as manager_nvml:
        mig = StandinMigManager(manager_nvml).serve(short_dir / "mig.sock")
        harness = Harness(short_dir, sandbox.kubeconfig, nvml, node_name=node_name)
        try:
            yield harness.start(dynamic_mig=True, mig_manager_socket=short_dir / "mig.sock"), mig
        finally:
            harness.stop_all()
            mig.stop()
            delete_node_slices(kube, node_name)


def test_dynamic_mig_creates_the_instance_at_prepare_and_destroys_it_at_unprepare(
    dyn: tuple[Running, StandinMigManager], claims: ClaimMaker, node_name: str
) -> None:
    plugin, mig = dyn
    nvml = plugin.app.nvml
    claim = claims("m", results=[result("gpu-1-mig-3g-40gb-4", pool=node_name)])
    uid = claim["metadata"]["uid"]
    answer = plugin.client.prepare([ref(claim)])[uid]
    assert answer.error == ""
    [instance] = nvml.mig_devices(1)
    assert instance.profile == "3g.40gb" and instance.placement.start == 4
    [device] = load_spec(plugin.state.cdi.specs.spec_path(uid)).devices
    env = dict(e.split("=", 1) for e in device.container_edits.env)
    assert env["GPUSLICE_GPU_1_MIG_3G_40GB_4_UUID"] == instance.uuid
    assert mig.owners == {
        (nvml.gpu(1).uuid, instance.gpu_instance_id): f"gpuslice-kubelet-plugin/{uid}"
    }
    assert plugin.client.prepare([ref(claim)])[uid] == answer
    assert len([c for c in mig.calls if c[0] == "create"]) == 1
    assert plugin.client.unprepare([ref(claim)]) == {uid: ""}
    assert nvml.mig_devices(1) == []


def test_a_failed_prepare_destroys_the_instance_it_created(
    dyn: tuple[Running, StandinMigManager], claims: ClaimMaker, node_name: str
) -> None:
    plugin, _mig = dyn
    claim = claims(
        "two",
        results=[
            result("gpu-0-mig-1g-10gb-0", pool=node_name, request="a"),
            result("gpu-0-mig-7g-80gb-0", pool=node_name, request="b"),  # overlaps the first
        ],
    )
    uid = claim["metadata"]["uid"]
    error = plugin.client.prepare([ref(claim)])[uid].error
    assert "mig-manager CreateInstance" in error
    assert plugin.app.nvml.mig_devices(0) == []
    assert uid not in plugin.state.committer.read().claims
