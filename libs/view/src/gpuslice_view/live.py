"""Live usage against the limit: what each node's enforcer measures, scraped from its metrics.

The source is the enforcers' own Prometheus endpoint (docs/enforcer.md, "Metrics"): per share
and GPU, ``gpuslice_enforcer_share_memory_used_bytes``, ``..._memory_limit_bytes``,
``..._sm_ratio`` and ``..._sm_limit_ratio`` (0..1; the view keeps percent, as ``kubectl
gpuslice top`` shows it) with labels ``claim_uid``, ``gpu`` (index) and ``UUID`` (the GPU's).
No new API on the node: the figures are the ones Prometheus already scrapes, and a node without
an enforcer simply has none. The enforcer names a share by its claim's UID only (its endpoint
needs no credentials); the view, which may read claims, puts the name back
(``ClusterView.live_of``).

The enforcers are found through the Kubernetes API: the node pods of the chart (a label
selector, in the release namespace), each at its pod IP and the container port named
``enforcer``. ``LivePoller`` scrapes every target each interval from a small thread pool, each
with its own timeout, so a slow node delays nothing but its own figures; a target whose last
scrape has not returned is skipped, not queued again. What it keeps is one ``NodeLive`` per
node, the latest scrape only: a failed scrape replaces the node's figures with the failure
(``unreachable``), never leaving old numbers to pass as current, and a node whose last good
scrape is older than ``stale_after`` reads as ``stale`` (``NodeLive.state_at``).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from gpuslice_core.logging import get_logger
from gpuslice_core.metrics import Subsystem, metric_name
from gpuslice_kube.errors import KubeError
from gpuslice_kube.raw import RawApi, resource_path

log = get_logger(__name__)

PORT_NAME = "enforcer"
"""The name of the enforcer's metrics port in the node pod (charts/gpuslice, daemonset.yaml)."""
NODE_SELECTOR = "app.kubernetes.io/part-of=gpuslice,app.kubernetes.io/component=node"
"""The node pods of any gpuslice release; the chart passes its own release's selector."""

_PREFIX = metric_name(Subsystem.ENFORCER, "share_")
_FIELDS = {
    "memory_used_bytes": ("memory_used", 1),
    "memory_limit_bytes": ("memory_limit", 1),
    "sm_ratio": ("sm_used", 100),
    "sm_limit_ratio": ("sm_limit", 100),
}
"""Family (after the prefix) -> (``ShareLive`` field, factor from the series' unit to it)."""

ShareKey = tuple[str, str]
"""(claim UID, device UUID): how the enforcer labels a share's series."""


@dataclass(frozen=True)
class ShareLive:
    memory_used: int = 0
    memory_limit: int = 0
    sm_used: float = 0.0
    sm_limit: float = 0.0


@dataclass(frozen=True)
class NodeLive:
    """The latest scrape of one node's enforcer."""

    node: str
    target: str
    at: float
    """Wall-clock time (``time.time()``) the scrape ended."""
    shares: Mapping[ShareKey, ShareLive] = field(default_factory=dict)
    error: str = ""
    """Why the scrape failed; empty when it succeeded."""

    def state_at(self, now: float, stale_after: float) -> str:
        """``ok``, ``unreachable`` (the last scrape failed) or ``stale`` (too old to trust)."""
        if self.error:
            return "unreachable"
        return "stale" if now - self.at > stale_after else "ok"


def parse(text: str) -> dict[ShareKey, ShareLive]:
    """The shares in one enforcer's metrics text (other families are ignored)."""
    found: dict[ShareKey, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(_PREFIX):
            continue
        field_of = _FIELDS.get(family.name[len(_PREFIX) :])
        if field_of is None:
            continue
        attr, factor = field_of
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("claim_uid", ""), labels.get("UUID", ""))
            found.setdefault(key, {})[attr] = sample.value * factor
    return {
        key: ShareLive(
            memory_used=int(v.get("memory_used", 0)),
            memory_limit=int(v.get("memory_limit", 0)),
            sm_used=float(v.get("sm_used", 0.0)),
            sm_limit=float(v.get("sm_limit", 0.0)),
        )
        for key, v in found.items()
    }


@dataclass(frozen=True)
class Target:
    node: str
    url: str


def discover(raw: RawApi, namespace: str, selector: str = NODE_SELECTOR) -> list[Target]:
    """The metrics URL of every running enforcer: node pods with an IP and a port named
    ``enforcer`` (one per node; the newest pod wins while a rollout has two)."""
    pods = raw.list(resource_path("v1", "pods", namespace=namespace), label_selector=selector)
    by_node: dict[str, tuple[str, Target]] = {}
    for pod in pods.get("items") or []:
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        node, ip = spec.get("nodeName"), status.get("podIP")
        if not node or not ip or status.get("phase") != "Running":
            continue
        port = next(
            (
                p.get("containerPort")
                for c in spec.get("containers") or []
                for p in c.get("ports") or []
                if p.get("name") == PORT_NAME
            ),
            None,
        )
        if not port:
            continue
        host = f"[{ip}]" if ":" in ip else ip
        created = str((pod.get("metadata") or {}).get("creationTimestamp", ""))
        if node not in by_node or created > by_node[node][0]:
            by_node[node] = (created, Target(node, f"http://{host}:{port}/metrics"))
    return [t for _, t in sorted(by_node.values(), key=lambda ct: ct[1].node)]


def scrape(target: Target, timeout: float, clock: Callable[[], float] = time.time) -> NodeLive:
    """One GET of an enforcer's metrics; a failure is a ``NodeLive`` with the error."""
    try:
        with urllib.request.urlopen(target.url, timeout=timeout) as response:  # noqa: S310
            shares = parse(response.read().decode("utf-8", "replace"))
    except (OSError, ValueError, urllib.error.URLError) as exc:  # HTTPError, timeouts: OSError
        return NodeLive(target.node, target.url, clock(), error=str(exc) or type(exc).__name__)
    return NodeLive(target.node, target.url, clock(), shares)


class LivePoller:
    """Scrapes every enforcer each ``interval`` seconds and hands ``publish`` the latest
    ``NodeLive`` per node (nodes no longer discovered are dropped)."""

    def __init__(
        self,
        discover: Callable[[], list[Target]],
        publish: Callable[[dict[str, NodeLive]], None],
        *,
        interval: float,
        timeout: float,
        workers: int = 8,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.discover = discover
        self.publish = publish
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="live-usage")
        self._inflight: dict[str, Future[NodeLive]] = {}
        self._latest: dict[str, NodeLive] = {}

    def poll_once(self) -> dict[str, NodeLive]:
        try:
            targets = self.discover()
        except KubeError as exc:  # keep what we have; say why nothing new came
            log.warning("cannot list the enforcers", error=str(exc))
            return dict(self._latest)
        started = {}
        for t in targets:
            running = self._inflight.get(t.node)
            if running is not None and not running.done():
                continue  # still hanging from an earlier round: do not queue another
            started[t.node] = self._inflight[t.node] = self._pool.submit(
                scrape, t, self.timeout, self.clock
            )
        # urllib's timeout is per socket operation; this bounds the round as a whole
        wait(started.values(), timeout=self.timeout + 1)
        latest: dict[str, NodeLive] = {}
        for t in targets:
            future = self._inflight[t.node]
            if future.done():
                latest[t.node] = future.result()
            else:
                error = f"no answer within {self.timeout:g}s"
                latest[t.node] = NodeLive(t.node, t.url, self.clock(), error=error)
        for node in set(self._inflight) - set(latest):
            if self._inflight[node].done():
                del self._inflight[node]
        self._latest = latest
        self.publish(dict(latest))
        return latest

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            began = time.monotonic()
            self.poll_once()
            stop.wait(max(self.interval - (time.monotonic() - began), 0.0))
        self._pool.shutdown(wait=False, cancel_futures=True)
