"""What the enforcer does about a share's limits, as Events a user sees with `kubectl describe
pod` (``gpuslice_kubelet_plugin.violationevents``): the plugin, in-process against the sandbox's
API server, holds the WatchViolations stream of a stand-in enforcer on a real unix socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.sandbox.gpunode import create_gated_pod
from e2e.sandbox.nodeagent.testing import wait_for
from e2e.support.kubelet_plugin import ClaimMaker
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as epb
from gpuslice_testkit.kubelet_plugin.dra import ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness, Node, Running
from gpuslice_testkit.kubelet_plugin.standins import StandinEnforcer

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(45)

GIB = 1024**3


@pytest.fixture
def enforcer(short_dir: Path, fake_node: Node) -> Iterator[StandinEnforcer]:
    uuids = tuple(fake_node.nvml.gpu(i).uuid for i in range(2))
    standin = StandinEnforcer(gpus=uuids).serve(short_dir / "enforcer.sock")
    yield standin
    standin.stop()


@pytest.fixture
def plugin(harness: Harness, enforcer: StandinEnforcer, short_dir: Path) -> Running:
    running = harness.start(enforcer_socket=short_dir / "enforcer.sock")
    wait_for(lambda: enforcer.watchers == 1, 10, "the plugin's violation stream")
    return running


def events(kube: RawApi, namespace: str) -> list[Obj]:
    return list(kube.list(resource_path("v1", "events", namespace=namespace))["items"])


def killed(claim_uid: str, pod: Obj | None, pid: int = 4242) -> epb.Violation:
    meta = (pod or {}).get("metadata") or {}
    return epb.Violation(
        claim_uid=claim_uid,
        share_id="share-1",
        device_uuid="GPU-0",
        pod=epb.PodReference(
            uid=meta.get("uid", ""), namespace=meta.get("namespace", ""), name=meta.get("name", "")
        ),
        pid=pid,
        resource=epb.RESOURCE_MEMORY,
        observed=6 * GIB,
        limit=4 * GIB,
        action=epb.ACTION_KILLED,
        mechanism=epb.MECHANISM_WATCHDOG,
        message=f"share share-1 uses 6 GiB on GPU-0, over its limit of 4 GiB; killed pid {pid}",
    )


def test_a_kill_is_an_event_on_the_pod_and_a_repeat_counts_it_up(
    plugin: Running, enforcer: StandinEnforcer, kube: RawApi, namespace: str, node_name: str
) -> None:
    pod = create_gated_pod(kube, namespace, "p1", claim="share")
    enforcer.violate(killed("claim-uid-1", pod))
    wait_for(lambda: len(events(kube, namespace)) == 1, 10, "the Event")
    [event] = events(kube, namespace)
    assert event["type"] == "Warning"
    assert event["reason"] == "GpuMemoryLimitKilled"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": namespace,
        "name": "p1",
        "uid": pod["metadata"]["uid"],
    }
    assert "killed pid 4242" in event["message"] and "over its limit" in event["message"]
    assert event["source"] == {"component": "gpuslice-enforcer", "host": node_name}
    assert event["count"] == 1
    # the same breach again: the Event counts up, with the newest message; no second Event
    enforcer.violate(killed("claim-uid-1", pod, pid=4343))
    wait_for(lambda: events(kube, namespace)[0]["count"] == 2, 10, "count 2")
    [event] = events(kube, namespace)
    assert "killed pid 4343" in event["message"]
    # another kind of action is another Event
    throttled = killed("claim-uid-1", pod)
    throttled.resource, throttled.action = epb.RESOURCE_CORES, epb.ACTION_THROTTLED
    enforcer.violate(throttled)
    wait_for(lambda: len(events(kube, namespace)) == 2, 10, "the second Event")
    reasons = sorted(e["reason"] for e in events(kube, namespace))
    assert reasons == ["GpuCoresThrottled", "GpuMemoryLimitKilled"]


def test_a_share_of_several_pods_reports_on_its_claim_and_an_unknown_claim_on_nothing(
    plugin: Running,
    enforcer: StandinEnforcer,
    claims: ClaimMaker,
    kube: RawApi,
    namespace: str,
    node_name: str,
) -> None:
    claim = claims("shared", results=[result("gpu-0", pool=node_name, cores="30", memory="4Gi")])
    uid = claim["metadata"]["uid"]
    assert plugin.client.prepare([ref(claim)])[uid].error == ""
    enforcer.violate(killed("not-prepared-here", None))  # dropped, logged
    enforcer.violate(killed(uid, None))  # the enforcer names no pod: the claim
    wait_for(lambda: len(events(kube, namespace)) == 1, 10, "the Event")
    [event] = events(kube, namespace)
    assert event["involvedObject"]["kind"] == "ResourceClaim"
    assert (event["involvedObject"]["name"], event["involvedObject"]["uid"]) == ("shared", uid)
    assert plugin.app.violations is not None and plugin.app.violations.posted == 1


def test_the_stream_is_opened_again_when_the_enforcer_restarts(
    plugin: Running, enforcer: StandinEnforcer, kube: RawApi, namespace: str, short_dir: Path
) -> None:
    pod = create_gated_pod(kube, namespace, "p1", claim="share")
    enforcer.stop()
    again = StandinEnforcer(gpus=enforcer.gpus).serve(short_dir / "enforcer.sock")
    try:
        wait_for(lambda: again.watchers == 1, 20, "the stream on the new enforcer")
        again.violate(killed("claim-uid-1", pod))
        wait_for(lambda: len(events(kube, namespace)) == 1, 10, "the Event")
    finally:
        again.stop()
