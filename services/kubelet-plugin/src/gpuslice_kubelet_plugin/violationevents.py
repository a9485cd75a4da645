"""Events for what the enforcer does about a share's limits, where users look: the pod.

The enforcer kills a process over its share's memory limit, throttles a share over its SM
limit, kills a process that bypasses its share's MPS server, or reports a breach it does not
act on; it streams each as a ``Violation`` (``WatchViolations``) and does not talk to the API
server. The kubelet plugin does, so it holds that stream and writes each violation as a core/v1
Event, as the kubelet writes its own (``kubectl describe pod`` shows them):

- on the pod the share serves (the enforcer names it when the share has one pod), else on the
  ResourceClaim (its namespace and name from this node's checkpoint); a violation of a claim
  this node does not know is logged and dropped;
- ``type: Warning``, a ``reason`` per resource and action (``REASONS``), the enforcer's own
  message (what was observed, the limit, the process and the mechanism), ``source.component``
  ``gpuslice-enforcer`` and ``host`` this node;
- a repeat (same object, same reason) within ``AGGREGATE_S`` counts the Event up (``count``,
  ``lastTimestamp``, the newest message) instead of making a new one, as the kubelet's event
  correlator does; the enforcer already reports an ongoing breach at most once per interval,
  so a throttled share costs a count update now and then, not an Event per sample.

The stream is held while the plugin runs and opened again, with backoff, whenever the enforcer
restarts; violations published while it was down are lost (the enforcer replays none), which
is the stream's contract. Writing an Event never fails anything: errors are logged.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.events import MAX_MESSAGE
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb

log = get_logger(__name__)

COMPONENT = "gpuslice-enforcer"
#: Repeats within this many seconds count the same Event up.
AGGREGATE_S = 600.0

#: (resource, action) -> Event reason.
REASONS = {
    (pb.RESOURCE_MEMORY, pb.ACTION_KILLED): "GpuMemoryLimitKilled",
    (pb.RESOURCE_MEMORY, pb.ACTION_DENIED): "GpuMemoryLimitDenied",
    (pb.RESOURCE_MEMORY, pb.ACTION_REPORTED): "GpuMemoryOverLimit",
    (pb.RESOURCE_CORES, pb.ACTION_THROTTLED): "GpuCoresThrottled",
    (pb.RESOURCE_CORES, pb.ACTION_KILLED): "GpuShareBypassKilled",
    (pb.RESOURCE_CORES, pb.ACTION_REPORTED): "GpuCoresOverLimit",
}


class ViolationSource(Protocol):
    """The enforcer's stream: violations until cancelled (a gRPC server stream)."""

    def __iter__(self) -> Iterator[pb.Violation]: ...

    def cancel(self) -> bool: ...


@dataclass(frozen=True)
class ClaimName:
    namespace: str
    name: str


@dataclass
class Posted:
    name: str  # the Event's name
    count: int
    at: float  # monotonic time of the last post


def reason_of(violation: pb.Violation) -> str:
    return REASONS.get((violation.resource, violation.action), "GpuLimitViolation")


class ViolationEvents:
    """Hold the enforcer's violation stream and write each violation as an Event."""

    def __init__(
        self,
        raw: RawApi,
        watch: Callable[[], ViolationSource],
        claims: Callable[[str], ClaimName | None],
        *,
        node: str,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.raw = raw
        self.watch = watch
        self.claims = claims
        self.node = node
        self.backoff_max = backoff_max
        self.clock = clock
        self.posted = 0  # Events created or counted up (tests read it)
        self._events: dict[tuple[str, str], Posted] = {}
        self._stop = threading.Event()
        self._stream: ViolationSource | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="violation-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._stream is not None:
                self._stream.cancel()
        if self._thread is not None:
            self._thread.join(5.0)

    def run(self) -> None:
        delay = 0.5
        while not self._stop.is_set():
            try:
                stream = self.watch()
                with self._lock:
                    if self._stop.is_set():
                        stream.cancel()
                        return
                    self._stream = stream
                for violation in stream:
                    delay = 0.5  # the stream delivers: the enforcer is up
                    self.handle(violation)
            except Exception as exc:  # the enforcer restarting ends the stream: open it again
                if self._stop.is_set():
                    return
                log.info("enforcer violation stream ended; opening it again", error=str(exc))
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, self.backoff_max)

    def handle(self, violation: pb.Violation) -> None:
        """Write ``violation`` as an Event (or count one up); never raises."""
        involved = self._involved(violation)
        if involved is None:
            log.info(
                "violation of a claim this node does not know; no Event",
                claim_uid=violation.claim_uid,
                detail=violation.message,
            )
            return
        reason = reason_of(violation)
        key = (involved["uid"] or f"{involved['namespace']}/{involved['name']}", reason)
        message = violation.message
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        now = self.clock()
        last = self._events.get(key)
        try:
            if last is not None and now - last.at < AGGREGATE_S:
                try:
                    self._count_up(involved["namespace"], last, message)
                    last.at = now
                except KubeNotFoundError:  # deleted meanwhile (its TTL, or by hand)
                    self._events[key] = Posted(self._create(involved, reason, message), 1, now)
            else:
                name = self._create(involved, reason, message)
                self._events[key] = Posted(name, 1, now)
            self.posted += 1
        except GpusliceError as exc:
            log.warning(
                "cannot write the violation's Event",
                claim_uid=violation.claim_uid,
                reason=reason,
                error=str(exc),
            )
        self._forget(now)

    def _involved(self, violation: pb.Violation) -> Obj | None:
        pod = violation.pod
        if pod.name and pod.namespace:
            return {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": pod.namespace,
                "name": pod.name,
                "uid": pod.uid,
            }
        claim = self.claims(violation.claim_uid)
        if claim is None:
            return None
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "namespace": claim.namespace,
            "name": claim.name,
            "uid": violation.claim_uid,
        }

    def _create(self, involved: Obj, reason: str, message: str) -> str:
        stamp = _now()
        event: Obj = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "generateName": f"{involved['name']}.",
                "namespace": involved["namespace"],
            },
            "involvedObject": {k: v for k, v in involved.items() if v},
            "type": "Warning",
            "reason": reason,
            "message": message,
            "source": {"component": COMPONENT, "host": self.node},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node,
        }
        path = resource_path("v1", "events", namespace=involved["namespace"])
        created: Any = self.raw.create(path, event)
        return str(created["metadata"]["name"])

    def _count_up(self, namespace: str, last: Posted, message: str) -> None:
        last.count += 1
        path = resource_path("v1", "events", namespace=namespace, name=last.name)
        self.raw.patch(path, {"count": last.count, "lastTimestamp": _now(), "message": message})

    def _forget(self, now: float) -> None:
        """Drop what can no longer be counted up (the map stays as small as the breaches)."""
        for key in [k for k, p in self._events.items() if now - p.at >= AGGREGATE_S]:
            del self._events[key]


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
