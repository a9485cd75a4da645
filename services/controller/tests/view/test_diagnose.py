"""GpuUnschedulable Events: what is said, on which objects, and how often (a fake clock)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuslice_controller.view.diagnose import (
    REASON,
    Diagnosis,
    Diagnostics,
    Throttle,
    unschedulable,
)
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj
from gpuslice_testkit import view as t
from gpuslice_view.model import ClusterView

pytestmark = pytest.mark.timeout(10)
POD = ("ml", "big")


class Raw:
    def __init__(self) -> None:
        self.created: list[Obj] = []
        self.patched: list[tuple[str, Obj]] = []
        self.gone: set[str] = set()

    def create(self, path: str, obj: Obj) -> Obj:
        name = f"{obj['metadata']['generateName']}{len(self.created)}"
        self.created.append(obj)
        return {**obj, "metadata": {**obj["metadata"], "name": name}}

    def patch(self, path: str, patch: Obj, **_: Any) -> Obj:
        if path.rsplit("/", 1)[-1] in self.gone:
            raise KubeNotFoundError("gone")
        self.patched.append((path, patch))
        return patch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def waiting_pod(*, reason: str = "Unschedulable", node: str = "") -> Obj:
    pod = t.pod("ml", "big", claim="big")
    pod["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": reason, "message": "0/1 nodes"}
    ]
    if node:
        pod["spec"]["nodeName"] = node
    return pod


def cluster() -> ClusterView:
    return ClusterView.build(
        slices=[t.resource_slice("node-a", [t.gpu(0)])],
        claims=[
            t.claim(
                "ml",
                "a",
                results=[t.result("node-a", "gpu-0", cores="50", memory="70Gi")],
                pods=("a",),
            ),
            t.claim("ml", "big", cores="10", memory="30Gi"),
        ],
        classes=t.CLASSES,
    )


class Setup:
    def __init__(self, *, leading: bool = True) -> None:
        self.view = cluster()
        self.raw = Raw()
        self.clock = Clock()
        self.leader = leading
        self.diag = Diagnostics(
            self.read,
            self.raw,  # type: ignore[arg-type]
            resource_api="v1",
            leading=lambda: self.leader,
            identity="ctl-0",
            interval=60,
            clock=self.clock,
        )

    def read(self, fn: Callable[[ClusterView], Diagnosis | None]) -> Diagnosis | None:
        return fn(self.view)

    def change(self, event: str, pod: Obj) -> None:
        self.view.apply("Pod", event, pod)
        self.diag.on_change("Pod", event, pod)


def test_unschedulable_means_the_schedulers_reason_and_no_node() -> None:
    assert unschedulable(waiting_pod())
    assert not unschedulable(waiting_pod(reason="SchedulingGated"))
    assert not unschedulable(waiting_pod(node="node-a"))
    no_claims = waiting_pod()
    del no_claims["spec"]["resourceClaims"]
    assert not unschedulable(no_claims)


def test_an_unschedulable_pod_gets_the_why_on_itself_and_its_claim() -> None:
    s = Setup()
    s.change("ADDED", waiting_pod())
    s.diag.step()
    pod_event, claim_event = s.raw.created
    assert pod_event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "big",
        "uid": "uid-big",
        "namespace": "ml",
    }
    assert claim_event["involvedObject"]["kind"] == "ResourceClaim"
    assert claim_event["involvedObject"]["apiVersion"] == "resource.k8s.io/v1"
    assert claim_event["involvedObject"]["uid"] == "uid-big"
    for event in (pod_event, claim_event):
        assert event["type"] == "Warning" and event["reason"] == REASON
        assert event["message"].startswith("NoFreeMemory: claim ml/big, gpu: no matching GPU")
        assert event["count"] == 1 and event["metadata"]["namespace"] == "ml"


def test_the_same_reason_is_counted_up_once_per_interval() -> None:
    s = Setup()
    s.change("ADDED", waiting_pod())
    s.diag.step()
    for _ in range(5):  # the scheduler retries and writes the pod again: nothing new
        s.change("MODIFIED", waiting_pod())
        s.clock.now += 10
        s.diag.step()
    assert len(s.raw.created) == 2 and s.raw.patched == []
    s.clock.now += 10  # 60 s after the first
    s.diag.step()
    assert len(s.raw.created) == 2
    assert [p["count"] for _, p in s.raw.patched] == [2, 2]
    assert {path.rsplit("/", 1)[-1] for path, _ in s.raw.patched} == {"big.0", "big.1"}
    s.clock.now += 30
    s.diag.step()
    assert len(s.raw.patched) == 2


def test_a_changed_reason_is_posted_at_once_as_a_new_event() -> None:
    s = Setup()
    s.change("ADDED", waiting_pod())
    s.diag.step()
    s.view.apply("ResourceSlice", "MODIFIED", t.resource_slice("node-a", [t.gpu(0)], generation=2))
    s.view.apply("DeviceTaintRule", "ADDED", t.taint_rule("cordon", "node-a", "gpu-0"))
    s.change("MODIFIED", waiting_pod())
    s.clock.now += 1
    s.diag.step()
    assert len(s.raw.created) == 4
    assert s.raw.created[-1]["message"].startswith("Tainted: ")


def test_nothing_more_once_the_pod_schedules_or_goes() -> None:
    s = Setup()
    s.change("ADDED", waiting_pod())
    s.diag.step()
    s.change("MODIFIED", waiting_pod(node="node-a"))
    s.clock.now += 120
    s.diag.step()
    assert len(s.raw.created) == 2 and s.raw.patched == []
    assert s.diag.throttle.posted == {}
    s.change("MODIFIED", waiting_pod())  # waits again (e.g. recreated): a fresh start
    s.diag.step()
    assert len(s.raw.created) == 4
    s.change("DELETED", waiting_pod())
    s.clock.now += 120
    s.diag.step()
    assert len(s.raw.created) == 4 and s.raw.patched == []


def test_only_the_leader_posts() -> None:
    s = Setup(leading=False)
    s.change("ADDED", waiting_pod())
    s.diag.step()
    assert s.raw.created == []
    s.leader = True
    s.clock.now += 60  # looked at again within an interval
    s.diag.step()
    assert len(s.raw.created) == 2


def test_claims_of_other_drivers_and_pods_that_fit_get_nothing() -> None:
    s = Setup()
    s.view.apply("DeviceClass", "ADDED", t.device_class("other", "device.driver == 'x.io'"))
    other = t.claim("ml", "big", device_class="other")
    s.view.apply("ResourceClaim", "MODIFIED", other)
    s.change("ADDED", waiting_pod())
    s.diag.step()
    s.view.apply("ResourceClaim", "MODIFIED", t.claim("ml", "big", cores="10", memory="1Gi"))
    s.clock.now += 60
    s.diag.step()  # ours now, but the view finds room: the scheduler's message decides
    assert s.raw.created == []


def test_an_expired_event_is_created_again() -> None:
    s = Setup()
    s.change("ADDED", waiting_pod())
    s.diag.step()
    s.raw.gone = {"big.0"}
    s.clock.now += 60
    s.diag.step()
    assert len(s.raw.created) == 3 and s.raw.created[-1]["count"] == 2


def test_throttle_decisions() -> None:
    throttle = Throttle(60)
    assert throttle.due(POD, "m", 0) == "new"
    assert throttle.next_look(POD, 0) == 60
