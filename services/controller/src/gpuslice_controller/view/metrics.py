"""Prometheus metrics per GPU and per claim, derived from the cluster view at scrape time.

Custom collectors: nothing is counted or stored between scrapes. Each scrape takes one
consistent snapshot of the view (under the feeder's lock, as plain tuples), then builds the
families outside the lock. So the metrics cost no memory beyond the view itself, a GPU or claim
that disappears disappears from the next scrape (no stale series to forget), and the numbers
are those ``kubectl gpuslice top gpus -o json`` shows.

Two collectors, for two doors (docs/controller.md, "Metrics per GPU and per claim"):

``ViewCollector`` (the open ``/metrics`` port): what the cluster's GPUs are and how full they
are, nothing that names a tenant. Every per-device series is labelled as dcgm-exporter labels
the GPU (docs/metrics.md), so they join its series on ``(Hostname, gpu, UUID)`` without
``label_replace``: ``Hostname`` (the device's node, not the controller's: the monitor honours
it), ``gpu`` (the GPU's index), ``UUID`` (the GPU's; a MIG device's parent GPU, as dcgm-exporter
writes it for MIG), ``GPU_I_PROFILE`` (a MIG device's profile, e.g. ``1g.10gb``; empty, so
absent, on whole GPUs), and ours: ``dra_device`` (the device's name in its ResourceSlice),
``model``, ``type`` (gpu or mig):

- ``gpuslice_gpu_cores_allocated_ratio``: the share of the GPU's cores (SMs) allocated to
  claims, 0..1; whole GPUs only (a MIG device has no cores capacity);
- ``gpuslice_gpu_memory_allocated_bytes``, ``gpuslice_gpu_memory_total_bytes``: same labels,
  GPUs and MIG devices;
- ``gpuslice_gpu_allocations``: allocation results on the device;
- ``gpuslice_gpu_cordoned``: 1 while a cordon (``kubectl gpuslice cordon``) is on it;
- ``gpuslice_gpu_tainted``: 1 while another NoSchedule/NoExecute taint is on it (the plugin's
  health taints, other DeviceTaintRules);
- ``gpuslice_gpu_memory_used_bytes``, ``gpuslice_gpu_sm_used_ratio``: same labels, what the
  node's enforcer measures on the device (the sum over its shares; SMs 0..1), only while that
  figure is current (``gpuslice_view.live``: no series for a node whose enforcer is unknown,
  stale or unreachable, never a 0 that is not measured);
- ``gpuslice_view_usage_up{Hostname,state}``: per node with an enforcer, 1 when its latest
  scrape is current, 0 otherwise, ``state`` ``ok``, ``stale`` or ``unreachable``;
- ``gpuslice_view_events_total{kind}``: changes the view applied, by kind;
- ``gpuslice_view_synced``: 1 once every kind's first list is in.

``ClaimCollector`` (``GET /view/metrics`` on the HTTPS server, for callers the view's
authorization admits): the series labelled with a claim's ``namespace`` and name (``claim``),
and the device labels above but ``model`` and ``type``:

- ``gpuslice_claim_cores_ratio``, ``gpuslice_claim_memory_bytes``: what an allocated claim
  holds of one device (a claim with two requests on one device: their sum; a whole device: all
  of it; cores 0..1 of the GPU's);
- ``gpuslice_claim_memory_used_bytes``, ``gpuslice_claim_sm_used_ratio``: claim labels, what
  the enforcer measures of the claim's share on the device, likewise only while current;
- ``gpuslice_claim_pending{namespace,claim,pod}``: 1 for each pod that is not scheduled yet
  and waits for one of our claims that has no allocation, as kube-state-metrics'
  ``kube_pod_status_phase{phase="Pending"}`` (the alert ``GpusliceClaimPending`` says how long
  through its ``for``). A claim no pod uses is not pending: the scheduler allocates a claim only
  for a pod.

The claim series carry no ``pod``: a claim is the unit that holds a device, and a shared claim
has several pods (docs/decisions.md, "One label scheme for every metric").

Until the view has synced only the view's two series are given (a half-listed cluster would
show GPUs as free that are not) and no claim series.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuslice_core.metrics import Subsystem, metric_name
from gpuslice_view.model import ClusterView
from gpuslice_view.objects import CORDON_KEY, Device

T = TypeVar("T")
DEVICE_LABELS = ("Hostname", "gpu", "UUID", "GPU_I_PROFILE", "dra_device")
"""A device as dcgm-exporter labels it (node, GPU index, GPU UUID, MIG profile), and its name
in the ResourceSlice."""
GPU_LABELS = (*DEVICE_LABELS, "model", "type")
CLAIM_LABELS = ("namespace", "claim", *DEVICE_LABELS)
BLOCKING = ("NoSchedule", "NoExecute")

DeviceLabels = tuple[str, str, str, str, str]


def device_labels(device: Device | None, node: str, name: str) -> DeviceLabels:
    """``DEVICE_LABELS`` of a device (``None``: one the view does not know, named by its
    allocation only). A MIG device is its parent GPU's index and UUID, and its profile, as
    dcgm-exporter labels a MIG instance's series."""
    if device is None:
        return (node, "", "", "", name)
    index = "" if device.index is None else str(device.index)
    if device.kind == "mig":
        return (node, index, device.parent_uuid or device.uuid, device.profile, name)
    return (node, index, device.uuid, "", name)


class ViewSource(Protocol):
    """What the collector needs of a ``ViewFeeder`` (tests give a plain view)."""

    synced: threading.Event
    events: dict[str, int]

    def read(self, fn: Callable[[ClusterView], T]) -> T: ...


@dataclass(frozen=True)
class GpuSample:
    labels: tuple[str, ...]
    """``GPU_LABELS``"""
    cores_total: int
    cores_used: int
    memory_total: int
    memory_used: int
    allocations: int
    cordoned: bool
    tainted: bool
    memory_live: int | None = None
    sm_live: float | None = None


ClaimLabels = tuple[str, str, str, str, str, str, str]
"""``CLAIM_LABELS``: namespace, claim, then ``DeviceLabels``"""
PendingLabels = tuple[str, str, str]
PENDING_LABELS = ("namespace", "claim", "pod")


@dataclass(frozen=True)
class Snapshot:
    gpus: tuple[GpuSample, ...]
    claims: Mapping[ClaimLabels, tuple[int, int]]
    """claim labels -> (cores percent, memory bytes)"""
    claims_live: Mapping[ClaimLabels, tuple[int, float]] = field(default_factory=dict)
    """claim labels -> (memory used, SM percent used), current ones only"""
    nodes_live: Mapping[str, str] = field(default_factory=dict)
    """node -> state of its enforcer's latest scrape"""
    pending: tuple[PendingLabels, ...] = ()
    """(namespace, claim, pod) of each unscheduled pod's unallocated claim of ours"""


def snapshot(view: ClusterView, now: float | None = None) -> Snapshot:
    """Everything one scrape reports, read from ``view`` (call it under the feeder's lock)."""
    now = time.time() if now is None else now
    gpus = []
    claims_live: dict[ClaimLabels, tuple[int, float]] = {}
    for usage in view.usage().values():
        d = usage.device
        labels = device_labels(d, d.node, d.name)
        live = view.live_of(d, now)
        for (namespace, name), measured in live.shares.items():
            claims_live[(namespace, name, *labels)] = (
                measured.memory_used,
                measured.sm_used,
            )
        taints = view.taints(d)
        cordoned = any(t.key == CORDON_KEY and t.rule for t in taints)
        tainted = any(t.effect in BLOCKING and not (t.key == CORDON_KEY and t.rule) for t in taints)
        gpus.append(
            GpuSample(
                labels=(*labels, d.model, d.kind),
                cores_total=d.cores,
                cores_used=usage.cores,
                memory_total=d.memory,
                memory_used=usage.memory,
                allocations=len(usage.shares),
                cordoned=cordoned,
                tainted=tainted,
                memory_live=live.memory_used,
                sm_live=live.sm_used,
            )
        )
    claims: dict[ClaimLabels, tuple[int, int]] = {}
    for claim in view.claims.values():
        for share in claim.shares:
            if share.device[0] != view.driver:
                continue
            device = view.device_of(share.device)
            node = device.node if device else share.device[1]
            total_cores, total_memory = (device.cores, device.memory) if device else (0, 0)
            cores = total_cores if share.cores is None else share.cores
            memory = total_memory if share.memory is None else share.memory
            key = (claim.namespace, claim.name, *device_labels(device, node, share.device[2]))
            had = claims.get(key, (0, 0))
            claims[key] = (had[0] + cores, had[1] + memory)
    nodes = {node: n.state_at(now, view.live_stale_after) for node, n in view.live.items()}
    return Snapshot(tuple(gpus), claims, claims_live, nodes, pending_claims(view))


def pending_claims(view: ClusterView) -> tuple[PendingLabels, ...]:
    """(namespace, claim, pod) for every pod not bound to a node that waits for a claim of
    ours without an allocation (a claim being deleted is not waited for)."""
    found = set()
    for pod in view.pods.values():
        if pod.node or pod.phase not in ("", "Pending"):
            continue
        for ref in pod.claims:
            claim = view.claims.get((pod.namespace, ref.claim)) if ref.claim else None
            if claim and not claim.allocated and not claim.deleting and view.ours(claim):
                found.add((pod.namespace, claim.name, pod.name))
    return tuple(sorted(found))


class ViewCollector(Collector):
    """The open series: ``REGISTRY.register(ViewCollector(feeder))``."""

    def __init__(self, source: ViewSource) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []  # families depend on the view; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily(
            metric_name(Subsystem.VIEW, "events"),
            "Changes the cluster view applied, by kind.",
            labels=["kind"],
        )
        for kind, n in sorted(dict(self.source.events).items()):
            events.add_metric([kind], n)
        yield events
        synced = self.source.synced.is_set()
        yield GaugeMetricFamily(
            metric_name(Subsystem.VIEW, "synced"),
            "1 once the cluster view has listed every kind it watches.",
            value=1 if synced else 0,
        )
        if synced:
            yield from gpu_families(self.source.read(snapshot))


class ClaimCollector(Collector):
    """The series that name claims (tenant data): served only behind the view's authorization
    (``view.api``, ``GET /view/metrics``), never on the open metrics port."""

    def __init__(self, source: ViewSource) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.source.synced.is_set():
            yield from claim_families(self.source.read(snapshot))


def gauge(name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def gpu_families(snap: Snapshot) -> Iterator[Metric]:
    """The per-GPU and per-node families: no claim, namespace or pod in any label."""
    cores = gauge(
        metric_name(Subsystem.GPU, "cores_allocated_ratio"),
        "The share of a whole GPU's cores (SMs) allocated to claims, 0..1.",
        GPU_LABELS,
    )
    memory = gauge(
        metric_name(Subsystem.GPU, "memory_allocated_bytes"),
        "Bytes of a device's memory allocated to claims.",
        GPU_LABELS,
    )
    total = gauge(
        metric_name(Subsystem.GPU, "memory_total_bytes"),
        "Bytes of memory the device publishes.",
        GPU_LABELS,
    )
    allocations = gauge(
        metric_name(Subsystem.GPU, "allocations"), "Allocation results on the device.", GPU_LABELS
    )
    cordoned = gauge(
        metric_name(Subsystem.GPU, "cordoned"),
        "1 while the device is cordoned (DeviceTaintRule).",
        GPU_LABELS,
    )
    tainted = gauge(
        metric_name(Subsystem.GPU, "tainted"),
        "1 while a NoSchedule or NoExecute taint other than a cordon is on the device.",
        GPU_LABELS,
    )
    memory_used = gauge(
        metric_name(Subsystem.GPU, "memory_used_bytes"),
        "Bytes of the device's memory the processes of its shares use (the node's enforcer).",
        GPU_LABELS,
    )
    sm_used = gauge(
        metric_name(Subsystem.GPU, "sm_used_ratio"),
        "The share of the device's SMs the processes of its shares use, 0..1 (the node's "
        "enforcer).",
        GPU_LABELS,
    )
    for g in snap.gpus:
        labels = list(g.labels)
        if g.memory_live is not None:
            memory_used.add_metric(labels, g.memory_live)
        if g.sm_live is not None:
            sm_used.add_metric(labels, g.sm_live / 100)
        if g.cores_total:
            cores.add_metric(labels, g.cores_used / g.cores_total)
        memory.add_metric(labels, g.memory_used)
        total.add_metric(labels, g.memory_total)
        allocations.add_metric(labels, g.allocations)
        cordoned.add_metric(labels, 1 if g.cordoned else 0)
        tainted.add_metric(labels, 1 if g.tainted else 0)
    up = gauge(
        metric_name(Subsystem.VIEW, "usage_up"),
        "1 while the node's enforcer metrics are current, 0 when stale or unreachable.",
        ("Hostname", "state"),
    )
    for node, state in sorted(snap.nodes_live.items()):
        up.add_metric([node, state], 1 if state == "ok" else 0)
    yield from (cores, memory, total, allocations, cordoned, tainted, memory_used, sm_used, up)


def claim_families(snap: Snapshot) -> Iterator[Metric]:
    """The per-claim families, labelled with the claim's namespace and name."""
    claim_cores = gauge(
        metric_name(Subsystem.CLAIM, "cores_ratio"),
        "The share of a GPU's cores an allocated claim holds on it, 0..1.",
        CLAIM_LABELS,
    )
    claim_memory = gauge(
        metric_name(Subsystem.CLAIM, "memory_bytes"),
        "Bytes of a device's memory an allocated claim holds on it.",
        CLAIM_LABELS,
    )
    for key, (c, m) in sorted(snap.claims.items()):
        if c:
            claim_cores.add_metric(list(key), c / 100)
        claim_memory.add_metric(list(key), m)
    claim_memory_used = gauge(
        metric_name(Subsystem.CLAIM, "memory_used_bytes"),
        "Bytes of a device's memory a claim's processes use (the node's enforcer).",
        CLAIM_LABELS,
    )
    claim_sm_used = gauge(
        metric_name(Subsystem.CLAIM, "sm_used_ratio"),
        "The share of a device's SMs a claim's processes use, 0..1 (the node's enforcer).",
        CLAIM_LABELS,
    )
    for key, (m, sm) in sorted(snap.claims_live.items()):
        claim_memory_used.add_metric(list(key), m)
        claim_sm_used.add_metric(list(key), sm / 100)
    pending = gauge(
        metric_name(Subsystem.CLAIM, "pending"),
        "1 for each unscheduled pod waiting for a claim of this driver that has no allocation.",
        PENDING_LABELS,
    )
    for labels in snap.pending:
        pending.add_metric(list(labels), 1)
    yield from (claim_cores, claim_memory, claim_memory_used, claim_sm_used, pending)
