"""Warning Events that say why a pod with a gpuslice claim does not schedule.

When the scheduler marks a pod ``PodScheduled=False`` with reason ``Unschedulable`` and one of
its claims is ours (on our devices or asking a DeviceClass of our driver), the leader posts a
core/v1 Event with reason ``GpuUnschedulable`` on the pod and on each such claim, whose message
is the view's ``why`` (``gpuslice_view.reasons``: ``NoFreeMemory: claim ml/x, gpu: no matching
GPU has 30Gi of free memory; ...``). So ``kubectl describe pod`` says what the scheduler's
"cannot allocate all claims" does not.

Rate: per pod, the same message is posted at most once per ``interval`` (60 s): the first time
as a new Event, later as a count update of that Event (``count``, ``lastTimestamp``), as the
kubelet's event recorder does, so a pod that waits an hour has one Event per object with a
count, not sixty. A changed message is posted at once (a new Event). The pod is looked at again
every ``interval`` while it waits, so a reason that changes without a pod update (a GPU frees
up elsewhere, a cordon) is seen. When the pod schedules or is deleted it is forgotten and
nothing more is posted. When the view finds room (``Fits``) nothing is posted: the scheduler's
own FailedScheduling Event then says more than the view can.

Work is split: the feeder's listener (a reflector thread) only records which pods wait and wakes
the worker; the worker thread derives reasons (under the feeder's lock) and makes the API calls.
Every replica tracks the waiting pods; only the leader posts.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_view.model import ClusterView
from gpuslice_view.objects import ClaimKey, Pod
from gpuslice_view.reasons import why_pod

log = get_logger(__name__)

REASON = "GpuUnschedulable"
COMPONENT = "gpuslice-controller"
MAX_MESSAGE = 1024
QUIET = ("Allocated", "Fits")
"""Reason codes that explain nothing about a wait."""


def unschedulable(pod: Obj) -> bool:
    """``PodScheduled=False`` with reason ``Unschedulable``, not bound, with claims."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName") or not spec.get("resourceClaims"):
        return False
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled":
            return bool(c.get("status") == "False" and c.get("reason") == "Unschedulable")
    return False


@dataclass
class Posted:
    message: str
    at: float
    count: int
    events: dict[str, str]
    """involved object ("pod" or "claim/<name>") -> Event name, for count updates"""


class Throttle:
    """Per pod: post a message when it is new or changed, repeat it once per ``interval``."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.posted: dict[ClaimKey, Posted] = {}

    def due(self, key: ClaimKey, message: str, now: float) -> str:
        """``new`` (post a new Event), ``repeat`` (count it up) or ``wait``."""
        last = self.posted.get(key)
        if last is None or last.message != message:
            return "new"
        return "repeat" if now - last.at >= self.interval else "wait"

    def next_look(self, key: ClaimKey, now: float) -> float:
        last = self.posted.get(key)
        return now + self.interval if last is None else max(last.at + self.interval, now)

    def forget(self, key: ClaimKey) -> None:
        self.posted.pop(key, None)


@dataclass(frozen=True)
class Diagnosis:
    pod: Pod
    message: str
    claims: tuple[tuple[str, str], ...]
    """(name, uid) of the pod's claims that are ours"""


def diagnose(view: ClusterView, key: ClaimKey) -> Diagnosis | None:
    """What to say about a waiting pod; None when it is not ours or there is nothing to say."""
    pod = view.pods.get(key)
    if pod is None or pod.node:
        return None
    ours = []
    for pc in pod.claims:
        claim = view.claims.get((pod.namespace, pc.claim)) if pc.claim else None
        if claim is not None and view.ours(claim):
            ours.append((claim.name, claim.uid))
    if not ours:
        return None
    names = {f"{pod.namespace}/{name}" for name, _ in ours}
    reasons = [r for r in why_pod(view, pod) if r.code not in QUIET and r.claim in names]
    if not reasons:
        return None
    message = "; ".join(f"{r.code}: {r}" for r in reasons)
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return Diagnosis(pod, message, tuple(ours))


class Diagnostics:
    """``feeder.listen(d.on_change)``; run ``d.run(stop)`` in a thread."""

    def __init__(
        self,
        read: Callable[[Callable[[ClusterView], Diagnosis | None]], Diagnosis | None],
        raw: RawApi,
        *,
        resource_api: str,
        leading: Callable[[], bool],
        identity: str,
        interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read = read
        self.raw = raw
        self.claim_api = f"resource.k8s.io/{resource_api}"
        self.leading = leading
        self.identity = identity
        self.clock = clock
        self.throttle = Throttle(interval)
        self.tick = min(interval, 1.0)
        self._waiting: dict[ClaimKey, float] = {}  # pod -> when to look at it next
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.posted = 0  # Events created or counted up (for tests and logs)

    def on_change(self, kind: str, event: str, obj: Obj) -> None:
        """The feeder's listener: quick, no API calls, no view reads."""
        if kind != "Pod":
            return
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        with self._lock:
            if event != "DELETED" and unschedulable(obj):
                self._waiting[key] = 0.0  # look now: the scheduler has just said something
            elif self._waiting.pop(key, None) is None:
                return
        self._wake.put(None)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(queue.Empty):
                self._wake.get(timeout=self.tick)
            self.step()

    def step(self) -> None:
        """Look at every waiting pod that is due; forget those that no longer wait."""
        now = self.clock()
        with self._lock:
            due = [k for k, at in self._waiting.items() if at <= now]
            gone = [k for k in self.throttle.posted if k not in self._waiting]
        for key in gone:
            self.throttle.forget(key)
        for key in due:
            self._look(key, now)

    def _look(self, key: ClaimKey, now: float) -> None:
        found = self.read(lambda view: diagnose(view, key))
        with self._lock:
            if key not in self._waiting:
                return  # scheduled or deleted meanwhile
            self._waiting[key] = now + self.throttle.interval
        if found is None or not self.leading():
            return
        verdict = self.throttle.due(key, found.message, now)
        if verdict == "wait":
            with self._lock:
                if key in self._waiting:
                    self._waiting[key] = self.throttle.next_look(key, now)
            return
        self._post(key, found, now, repeat=verdict == "repeat")

    def _post(self, key: ClaimKey, found: Diagnosis, now: float, *, repeat: bool) -> None:
        last = self.throttle.posted.get(key)
        count = last.count + 1 if repeat and last else 1
        events = dict(last.events) if repeat and last else {}
        pod = found.pod
        involved = {"pod": {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "uid": pod.uid}}
        for name, uid in found.claims:
            involved[f"claim/{name}"] = {
                "apiVersion": self.claim_api,
                "kind": "ResourceClaim",
                "name": name,
                "uid": uid,
            }
        for what, obj in involved.items():
            events[what] = self._event(pod.namespace, obj, found.message, count, events.get(what))
        self.throttle.posted[key] = Posted(found.message, now, count, events)
        self.posted += 1
        log.info(
            "posted a diagnostic event",
            pod=f"{pod.namespace}/{pod.name}",
            reason=REASON,
            count=count,
            message=found.message,
        )

    def _event(
        self, namespace: str, involved: Obj, message: str, count: int, name: str | None
    ) -> str:
        """Create the Event, or count up ``name``; the Event's name ("" when it failed)."""
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        events = resource_path("v1", "events", namespace=namespace)
        try:
            if name:
                try:
                    self.raw.patch(
                        resource_path("v1", "events", namespace=namespace, name=name),
                        {"count": count, "lastTimestamp": stamp},
                    )
                    return name
                except KubeNotFoundError:
                    pass  # expired (the API server keeps Events an hour): a new one
            event: Obj = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
                "involvedObject": {**involved, "namespace": namespace},
                "type": "Warning",
                "reason": REASON,
                "message": message,
                "source": {"component": COMPONENT},
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": count,
                "reportingComponent": COMPONENT,
                "reportingInstance": self.identity,
            }
            return str(self.raw.create(events, event)["metadata"]["name"])
        except GpusliceError as exc:
            log.error("cannot post an event", object=involved["name"], error=str(exc))
            return ""
