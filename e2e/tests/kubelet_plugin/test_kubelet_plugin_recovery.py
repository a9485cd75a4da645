"""What a restarted plugin finds and fixes: half-done claims of dead instances, lost and
orphaned CDI specs, orphaned shares, a previous boot's checkpoint, claims gone from the API
(deleted, or re-created under the same name), and an API that refuses or cannot be reached —
the plugin in-process against the sandbox's API server."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import delete_claim, unreachable_kubeconfig
from e2e.sandbox.nodeagent.credentials import node_kubeconfig
from e2e.sandbox.nodeagent.testing import unique
from e2e.support.kubelet_plugin import ClaimMaker
from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Device
from gpuslice_draplugin import ResourceApi
from gpuslice_kube.client import new_api_client
from gpuslice_kube.errors import KubeForbiddenError, KubeTransientError
from gpuslice_kube.raw import RawApi
from gpuslice_kubelet_plugin.checkpoint import (
    ClaimRecord,
    DeviceRecord,
    InstanceLock,
    PluginState,
    open_store,
)
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as epb
from gpuslice_testkit.kubelet_plugin.dra import ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness
from gpuslice_testkit.kubelet_plugin.standins import StandinEnforcer

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)


def record(uid: str, state: str, owner: str, pool: str, device: str = "gpu-0") -> ClaimRecord:
    return ClaimRecord(
        uid=uid,
        namespace="ns",
        name=f"claim-{uid}",
        state=state,  # type: ignore[arg-type]
        owner=owner,
        devices=[DeviceRecord(request="gpu", pool=pool, device=device, uuid="GPU-x", cores=100)],
    )


def orphan_spec(cdi_root: Path, uid: str) -> None:
    specs = ClaimSpecs(cdi_root)
    specs.write(
        uid,
        [Device(name=specs.device_name(uid, "gpu-0"), container_edits=ContainerEdits(env=["A=1"]))],
    )


def test_half_done_work_of_a_dead_instance_is_finished(
    harness: Harness, short_dir: Path, node_name: str
) -> None:
    enforcer = StandinEnforcer().serve(short_dir / "enforcer.sock")
    try:
        settings = harness.settings()
        live = InstanceLock(settings.state_dir)  # another pod of a rolling update, alive
        state = PluginState(
            claims={
                "started": record("started", "PrepareStarted", "dead-1", node_name),
                "unpreparing": record(
                    "unpreparing", "UnprepareStarted", "dead-2", node_name, "gpu-1"
                ),
                "done": record("done", "PrepareCompleted", "dead-1", node_name, "gpu-1"),
                "busy": record("busy", "PrepareStarted", live.id, node_name),
            }
        )
        open_store(settings.state_dir, boot_id="boot-1").save(state)
        for uid in ("started", "unpreparing", "orphan"):
            orphan_spec(settings.cdi_root, uid)
        for uid in ("started", "orphan-share"):
            enforcer.shares[uid] = ("s", epb.CreateShareRequest(claim_uid=uid))

        plugin = harness.start(enforcer_socket=short_dir / "enforcer.sock")

        claims = plugin.state.committer.read().claims
        assert sorted(claims) == ["busy", "done"]
        assert claims["busy"].owner == live.id  # a live instance's work is left alone
        cdi = plugin.state.cdi
        # rolled back, unprepared and orphaned specs are gone; the lost one is written again
        assert cdi.claim_uids() == ["done"]
        assert "started" not in enforcer.shares and "orphan-share" not in enforcer.shares
        recovered = plugin.app.metrics.recovered
        for action in (
            "rolled_back",
            "unprepared",
            "orphan_spec",
            "orphan_share",
            "spec_rewritten",
        ):
            assert recovered.labels(action=action)._value.get() == 1, action
        live.release()
    finally:
        enforcer.stop()


def test_a_claim_another_live_instance_is_preparing_is_refused(
    harness: Harness, claims: ClaimMaker, node_name: str
) -> None:
    settings = harness.settings()
    live = InstanceLock(settings.state_dir)
    claim = claims("c", results=[result("gpu-0", pool=node_name)])
    uid = claim["metadata"]["uid"]
    rec = record(uid, "PrepareStarted", live.id, node_name)
    open_store(settings.state_dir, boot_id="boot-1").save(PluginState(claims={uid: rec}))
    plugin = harness.start()
    error = plugin.client.prepare([ref(claim)])[uid].error
    assert "being worked on by another plugin instance" in error
    live.release()  # the other pod dies: its half-done prepare is rolled back and redone
    assert plugin.client.prepare([ref(claim)])[uid].error == ""
    assert plugin.state.committer.read().claims[uid].state == "PrepareCompleted"


def test_a_previous_boot_is_discarded_not_crashed_on(
    harness: Harness, claims: ClaimMaker, node_name: str
) -> None:
    settings = harness.settings()
    open_store(settings.state_dir, boot_id="boot-0").save(
        PluginState(claims={"old": record("old", "PrepareCompleted", "x", node_name)})
    )
    plugin = harness.start()
    assert plugin.state.committer.read().claims == {}
    assert list(settings.state_dir.glob("kubelet-plugin.json.stale-boot-0"))
    claim = claims("c", results=[result("gpu-0", pool=node_name)])
    assert plugin.client.prepare([ref(claim)])[claim["metadata"]["uid"]].error == ""


def test_claims_that_left_the_api_are_unprepared(
    harness: Harness,
    claims: ClaimMaker,
    node_name: str,
    kube: RawApi,
    namespace: str,
    sandbox: ControlPlane,
    short_dir: Path,
) -> None:
    plugin = harness.start()
    kept = claims("kept", results=[result("gpu-0", pool=node_name)])
    gone = claims("gone", results=[result("gpu-1", pool=node_name)])
    again = claims("again", results=[result("gpu-2-mig-1g-10gb-0", pool=node_name)])
    answers = plugin.client.prepare([ref(c) for c in (kept, gone, again)])
    assert all(a.error == "" for a in answers.values())
    delete_claim(kube, namespace, "gone")
    delete_claim(kube, namespace, "again")
    again2 = claims("again")  # same name, new UID
    assert again2["metadata"]["uid"] != again["metadata"]["uid"]
    unprepared = plugin.app.collector.run_once()
    assert sorted(unprepared) == sorted([gone["metadata"]["uid"], again["metadata"]["uid"]])
    assert list(plugin.state.committer.read().claims) == [kept["metadata"]["uid"]]

    # nothing is unprepared on doubt: the API refuses (a real 403 — the Node authorizer does
    # not let a node identity read a claim no pod of its uses) ...
    server = plugin.app.helper.api.server
    stranger = node_kubeconfig(sandbox.pki, sandbox.server, unique("stranger"), short_dir / "n")
    forbidden = RawApi(new_api_client(stranger, user_agent="gpuslice-test"), deadline=2)
    with pytest.raises(KubeForbiddenError):
        ResourceApi(forbidden, server).get_claim(namespace, "kept")
    plugin.app.helper.claims.api = ResourceApi(forbidden, server)
    assert plugin.app.collector.run_once() == []
    assert list(plugin.state.committer.read().claims) == [kept["metadata"]["uid"]]
    # ... or cannot be reached at all (the plugin's client points at a closed port)
    closed = unreachable_kubeconfig(sandbox.kubeconfig, short_dir / "closed.kubeconfig")
    unreachable = RawApi(new_api_client(closed, user_agent="gpuslice-test"), deadline=0.5)
    with pytest.raises(KubeTransientError):
        ResourceApi(unreachable, server).get_claim(namespace, "kept")
    plugin.app.helper.claims.api = ResourceApi(unreachable, server)
    assert plugin.app.collector.run_once() == []
    assert list(plugin.state.committer.read().claims) == [kept["metadata"]["uid"]]
