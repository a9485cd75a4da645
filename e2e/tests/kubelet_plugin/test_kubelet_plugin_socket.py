"""gpuslice-kubelet-plugin through its DRA socket, against the real API server: claims are
created in the API with their allocation written into the status (as the scheduler writes it),
and a test plays the kubelet. Per-claim errors, idempotence, background garbage collection,
slices that vanish, XID taints and their recovery, kill -9 in the middle of a prepare loop."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    RESOURCE,
    GpuNode,
    create_claim,
    start_gpu_node,
    stop_gpu_node,
)
from e2e.sandbox.nodeagent.testing import wait_for
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2 as hpb
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2_grpc as hpb_grpc
from gpuslice_testkit.kubelet_plugin.dra import (
    ClaimAnswer,
    ClaimTuple,
    DraClient,
    gpu_config,
    result,
)

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)

H100X4 = [
    {"model": "H100", "count": 3},
    {"model": "H100", "migEnabled": True, "migInstances": [{"profile": "3g.40gb"}]},
]
FLAGS = ("--xid-quiet-period", "2", "--health-check-interval", "0.5", "--gc-interval", "1")


@pytest.fixture(scope="module")
def node(sandbox: ControlPlane, kube: RawApi) -> Iterator[GpuNode]:
    gpu_node = start_gpu_node(sandbox, H100X4, with_agent=False, extra=FLAGS)
    yield gpu_node
    stop_gpu_node(gpu_node, kube)


@pytest.fixture
def client(node: GpuNode) -> Iterator[DraClient]:
    c = DraClient(node.plugin.sockets.dra)
    yield c
    c.close()


def ref(claim: Obj) -> ClaimTuple:
    meta = claim["metadata"]
    return meta["namespace"], meta["name"], meta["uid"]


def test_every_bad_claim_gets_its_own_error_and_the_good_one_succeeds(
    node: GpuNode, kube: RawApi, namespace: str, client: DraClient
) -> None:
    good = create_claim(kube, namespace, "good", results=[result("gpu-0", pool=node.name)])
    unallocated = create_claim(kube, namespace, "unallocated")
    other_driver = create_claim(
        kube,
        namespace,
        "other-driver",
        results=[result("dev-0", pool=node.name, driver="other.example.com")],
    )
    other_pool = create_claim(
        kube, namespace, "other-pool", results=[result("gpu-1", pool="some-other-node")]
    )
    bad_config = create_claim(
        kube,
        namespace,
        "bad-config",
        results=[result("gpu-1", pool=node.name)],
        config=[gpu_config(limits={"cores": 150}, sharing={"stratgy": "MPS"})],
    )
    missing: ClaimTuple = (namespace, "missing", "11111111-2222-3333-4444-555555555555")
    claims = [good, unallocated, other_driver, other_pool, bad_config]
    answers = client.prepare([ref(c) for c in claims] + [missing])
    assert len(answers) == 6

    def error(claim: Obj) -> str:
        return answers[claim["metadata"]["uid"]].error

    assert error(good) == ""
    assert answers[good["metadata"]["uid"]].devices[0]["device"] == "gpu-0"
    assert error(unallocated) == f"ResourceClaim {namespace}/unallocated is not allocated"
    assert "no device allocated by driver gpu.gpuslice.dev" in error(other_driver)
    assert "allocated from pool some-other-node" in error(other_pool)
    assert "limits.cores: 150 is not allowed" in error(bad_config)
    assert "unknown field 'stratgy' in sharing" in error(bad_config)
    assert answers[missing[2]].error == f"ResourceClaim {namespace}/missing does not exist"


def test_repeats_are_no_ops_and_unknown_claims_unprepare(
    node: GpuNode, kube: RawApi, namespace: str, client: DraClient
) -> None:
    claim = create_claim(
        kube, namespace, "c", results=[result("gpu-2", pool=node.name, cores="40", memory="8Gi")]
    )
    uid = claim["metadata"]["uid"]
    first = client.prepare([ref(claim)])[uid]
    assert first.error == ""
    spec = next(node.plugin.cdi_root.glob(f"*{uid}*"))
    written = spec.stat().st_mtime_ns
    assert client.prepare([ref(claim)])[uid] == first
    assert spec.stat().st_mtime_ns == written
    assert client.unprepare([ref(claim)]) == {uid: ""}
    assert client.unprepare([ref(claim)]) == {uid: ""}
    assert client.unprepare([(namespace, "never", "never-prepared")]) == {"never-prepared": ""}
    assert not spec.exists()


def test_a_claim_that_leaves_the_api_is_unprepared_in_the_background(
    node: GpuNode, kube: RawApi, namespace: str, client: DraClient
) -> None:
    claim = create_claim(kube, namespace, "gone", results=[result("gpu-1", pool=node.name)])
    uid = claim["metadata"]["uid"]
    assert client.prepare([ref(claim)])[uid].error == ""
    assert uid in node.checkpoint_claims()
    kube.delete(resource_path(RESOURCE, "resourceclaims", namespace=namespace, name="gone"))
    wait_for(lambda: uid not in node.checkpoint_claims(), 15, "the background unprepare")
    assert not list(node.plugin.cdi_root.glob(f"*{uid}*"))


def test_deleted_slices_come_back(node: GpuNode, kube: RawApi) -> None:
    before = wait_for(lambda: node.slices(kube), 20, "the slices")
    generation = before[0]["spec"]["pool"]["generation"]
    for s in before:
        kube.delete(resource_path(RESOURCE, "resourceslices", name=s["metadata"]["name"]))
    back = wait_for(
        lambda: [s for s in node.slices(kube) if s["spec"]["pool"]["generation"] > generation],
        15,
        "the slices to be published again",
    )
    assert {d["name"] for d in back[0]["spec"]["devices"]} == set(node.devices(kube))
    assert len(node.devices(kube)) == 4


def test_an_xid_taints_the_device_and_recovery_clears_it(node: GpuNode, kube: RawApi) -> None:
    channel = grpc.insecure_channel(f"unix://{node.plugin.sockets.dra}")
    stream = hpb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
        hpb.NodeWatchResourcesRequest(), timeout=60
    )
    updates: queue.Queue[dict[str, int]] = queue.Queue()

    def read() -> None:
        try:
            for message in stream:
                updates.put({d.device.device_name: d.health for d in message.devices})
        except grpc.RpcError:
            pass

    threading.Thread(target=read, daemon=True).start()
    try:
        assert updates.get(timeout=10)["gpu-1"] == hpb.HEALTHY
        node.control.inject_xid(1, 79)
        node.control.inject_xid(2, 13)  # an application error: informational only

        def taints() -> dict[str, list[Obj]]:
            return {n: d.get("taints") or [] for n, d in node.devices(kube).items()}

        def both_tainted() -> dict[str, list[Obj]] | None:
            found = taints()
            return found if found["gpu-1"] and found["gpu-2"] else None

        tainted = wait_for(both_tainted, 15, "the taints")
        assert [(x["key"], x["value"], x["effect"]) for x in tainted["gpu-1"]] == [
            ("gpu.gpuslice.dev/xid", "79", "NoSchedule")
        ]
        assert [x["effect"] for x in tainted["gpu-2"]] == ["None"]
        assert tainted["gpu-0"] == []
        while (health := updates.get(timeout=10))["gpu-1"] != hpb.UNHEALTHY:
            pass
        assert health["gpu-2"] == hpb.HEALTHY

        # quiet for 2 s and the GPU answers: the taints go away
        wait_for(lambda: not any(taints().values()), 20, "recovery to clear the taints")
        while updates.get(timeout=10)["gpu-1"] != hpb.HEALTHY:
            pass
    finally:
        stream.cancel()
        channel.close()


@pytest.mark.timeout(150)
def test_kill_9_in_the_middle_of_a_prepare_loop_then_restart(
    sandbox: ControlPlane, kube: RawApi, namespace: str
) -> None:
    victim = start_gpu_node(sandbox, [{"model": "H100", "count": 4}], with_agent=False)
    try:
        claims = []
        for i in range(24):
            c = create_claim(
                kube,
                namespace,
                f"k{i}",
                results=[result(f"gpu-{i % 4}", pool=victim.name, cores="4", memory="2Gi")],
            )
            claims.append(ref(c))
        acked: dict[str, ClaimAnswer] = {}
        interrupted = 0
        rng = random.Random(11)
        for _round in range(3):
            if all(c[2] in acked for c in claims):
                break
            stop = threading.Event()
            pending = [c for c in claims if c[2] not in acked]
            loop = threading.Thread(target=_prepare_loop, args=(victim, pending, acked, stop))
            loop.start()
            time.sleep(rng.uniform(0.05, 0.3))
            victim.plugin.kill9()
            stop.set()
            loop.join(15)
            interrupted += sum(
                r["state"] != "PrepareCompleted" for r in victim.plugin.checkpoint_claims().values()
            )
            victim.plugin.start()
        client = DraClient(victim.plugin.sockets.dra)
        try:
            final = client.prepare(claims)
            assert all(a.error == "" for a in final.values()), final
            for uid, answer in acked.items():
                assert final[uid] == answer, "an acknowledged claim changed after the restart"
            records = victim.checkpoint_claims()
            assert set(records) == {c[2] for c in claims}
            assert {r["state"] for r in records.values()} == {"PrepareCompleted"}
            assert len(list(victim.plugin.cdi_root.glob("*.json"))) == len(claims)
            # no device is over-committed: 6 claims x 4 cores / 2Gi per GPU
            per_gpu: dict[str, int] = {}
            for r in records.values():
                for d in r["devices"]:
                    per_gpu[d["device"]] = per_gpu.get(d["device"], 0) + d["cores"]
            assert per_gpu == {f"gpu-{i}": 24 for i in range(4)}
            print(
                f"kills mid-prepare: {interrupted}; acknowledged before the restart: {len(acked)}"
            )
            assert set(client.unprepare(claims).values()) == {""}
            assert list(victim.plugin.cdi_root.glob("*.json")) == []
        finally:
            client.close()
    finally:
        stop_gpu_node(victim, kube)


def _prepare_loop(
    node: GpuNode, pending: list[ClaimTuple], acked: dict[str, ClaimAnswer], stop: threading.Event
) -> None:
    client = DraClient(node.plugin.sockets.dra, timeout=10)
    try:
        for claim in pending:
            if stop.is_set():
                return
            try:
                answer = client.prepare([claim])[claim[2]]
            except grpc.RpcError:  # killed under the call: no answer, the kubelet retries
                return
            if not answer.error:
                acked[claim[2]] = answer
    finally:
        client.close()
