"""The per-GPU and per-claim metrics, from a ClusterView built of API-shaped dicts: the open
collector names no claim or namespace; the claim collector (behind /view/metrics) does."""

from __future__ import annotations

import time
from typing import TypeVar

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuslice_controller.view.metrics import ClaimCollector, ViewCollector
from gpuslice_testkit import view as t
from gpuslice_view.live import NodeLive, ShareLive
from gpuslice_view.model import ClusterView

pytestmark = pytest.mark.timeout(10)
T = TypeVar("T")
GIB = 1024**3
H100 = t.H100_MIB * 1024**2
UUID0 = "GPU-00000000-aaaa"
EVENTS = {"ResourceSlice": 2, "ResourceClaim": 5}


def cluster() -> ClusterView:
    return ClusterView.build(
        slices=[
            t.resource_slice("node-a", [t.gpu(0), t.gpu(1), t.mig(2, "1g.10gb", 0, 9856)]),
            t.resource_slice("node-b", [t.gpu(0, model="NVIDIA L4", mib=22528)]),
        ],
        claims=[
            t.claim(
                "ml",
                "a",
                results=[t.result("node-a", "gpu-0", cores="30", memory="20Gi")],
                pods=("pa",),
            ),
            t.claim(
                "ml",
                "b",
                results=[t.result("node-a", "gpu-0", cores="50", memory="40Gi")],
                pods=("pb",),
            ),
            t.claim("web", "whole", results=[t.result("node-b", "gpu-0")], pods=("w",)),
            t.claim("ml", "m", results=[t.result("node-a", "gpu-2-mig-1g-10gb-0")]),
            t.claim("ml", "pending"),
        ],
        classes=t.CLASSES,
        rules=[t.taint_rule("gpuslice-cordon-node-b-gpu-0", "node-b", "gpu-0")],
    )


def registry(source: t.FixedFeeder) -> CollectorRegistry:
    """Both collectors in one registry, as Prometheus sees them after scraping both doors."""
    reg = CollectorRegistry()
    reg.register(ViewCollector(source))
    reg.register(ClaimCollector(source))
    return reg


def open_registry(source: t.FixedFeeder) -> CollectorRegistry:
    """What the open /metrics port serves."""
    reg = CollectorRegistry()
    reg.register(ViewCollector(source))
    return reg


def on(node: str, device: str, uuid: str, profile: str = "") -> dict[str, str]:
    """A device's labels as dcgm-exporter's (the GPU's index, from ``gpu-<index>…``) and its
    DRA name."""
    index = device.split("-")[1]
    return {
        "Hostname": node,
        "gpu": index,
        "UUID": uuid,
        "GPU_I_PROFILE": profile,
        "dra_device": device,
    }


def gpu(
    node: str, device: str, uuid: str, model: str, kind: str = "gpu", profile: str = ""
) -> dict[str, str]:
    return {**on(node, device, uuid, profile), "model": model, "type": kind}


def claim(
    ns: str, name: str, node: str, device: str, uuid: str, profile: str = ""
) -> dict[str, str]:
    return {"namespace": ns, "claim": name, **on(node, device, uuid, profile)}


UUID1 = "GPU-00000001-aaaa"
UUID2 = "GPU-00000002-aaaa"


def test_per_gpu_rows_are_derived_from_the_view() -> None:
    reg = registry(t.FixedFeeder(cluster(), events=EVENTS))
    a0 = gpu("node-a", "gpu-0", UUID0, "NVIDIA H100 80GB HBM3")
    assert reg.get_sample_value("gpuslice_gpu_cores_allocated_ratio", a0) == 0.8
    assert reg.get_sample_value("gpuslice_gpu_memory_allocated_bytes", a0) == 60 * GIB
    assert reg.get_sample_value("gpuslice_gpu_memory_total_bytes", a0) == H100
    assert reg.get_sample_value("gpuslice_gpu_allocations", a0) == 2
    assert reg.get_sample_value("gpuslice_gpu_cordoned", a0) == 0
    a1 = gpu("node-a", "gpu-1", UUID1, "NVIDIA H100 80GB HBM3")
    assert reg.get_sample_value("gpuslice_gpu_cores_allocated_ratio", a1) == 0
    b0 = gpu("node-b", "gpu-0", UUID0, "NVIDIA L4")
    assert reg.get_sample_value("gpuslice_gpu_cores_allocated_ratio", b0) == 1
    assert reg.get_sample_value("gpuslice_gpu_memory_allocated_bytes", b0) == 22528 * 1024**2
    assert reg.get_sample_value("gpuslice_gpu_cordoned", b0) == 1
    assert reg.get_sample_value("gpuslice_gpu_tainted", b0) == 0  # a cordon is not "tainted"
    # a MIG device: its parent GPU's index and UUID, and its profile, as dcgm-exporter's
    mig = gpu("node-a", "gpu-2-mig-1g-10gb-0", UUID2, "NVIDIA H100 80GB HBM3", "mig", "1g.10gb")
    assert reg.get_sample_value("gpuslice_gpu_cores_allocated_ratio", mig) is None
    assert reg.get_sample_value("gpuslice_gpu_memory_allocated_bytes", mig) == 9856 * 1024**2


def test_per_claim_rows_sum_a_claims_shares_on_one_device() -> None:
    view = cluster()
    two = t.claim(
        "ml",
        "two",
        results=[
            t.result("node-a", "gpu-1", "x", cores="10", memory="1Gi"),
            t.result("node-a", "gpu-1", "y", cores="5", memory="2Gi"),
        ],
    )
    view.apply("ResourceClaim", "ADDED", two)
    reg = registry(t.FixedFeeder(view, events=EVENTS))

    assert (
        reg.get_sample_value(
            "gpuslice_claim_cores_ratio", claim("ml", "a", "node-a", "gpu-0", UUID0)
        )
        == 0.3
    )
    assert (
        reg.get_sample_value(
            "gpuslice_claim_memory_bytes", claim("ml", "a", "node-a", "gpu-0", UUID0)
        )
        == 20 * GIB
    )
    assert (
        reg.get_sample_value(
            "gpuslice_claim_cores_ratio", claim("ml", "two", "node-a", "gpu-1", UUID1)
        )
        == 0.15
    )
    assert (
        reg.get_sample_value(
            "gpuslice_claim_memory_bytes", claim("ml", "two", "node-a", "gpu-1", UUID1)
        )
        == 3 * GIB
    )
    whole = claim("web", "whole", "node-b", "gpu-0", UUID0)
    assert reg.get_sample_value("gpuslice_claim_cores_ratio", whole) == 1
    mig = claim("ml", "m", "node-a", "gpu-2-mig-1g-10gb-0", UUID2, "1g.10gb")
    assert reg.get_sample_value("gpuslice_claim_cores_ratio", mig) is None
    assert reg.get_sample_value("gpuslice_claim_memory_bytes", mig) == 9856 * 1024**2
    text = generate_latest(reg).decode()
    assert 'claim="pending"' not in text


def test_a_deleted_claim_or_gpu_leaves_the_next_scrape() -> None:
    view = cluster()
    source = t.FixedFeeder(view, events=EVENTS)
    reg = registry(source)
    a = claim("ml", "a", "node-a", "gpu-0", UUID0)
    assert reg.get_sample_value("gpuslice_claim_memory_bytes", a) == 20 * GIB
    view.apply("ResourceClaim", "DELETED", t.claim("ml", "a"))
    view.apply("ResourceSlice", "DELETED", t.resource_slice("node-b", []))
    assert reg.get_sample_value("gpuslice_claim_memory_bytes", a) is None
    a0 = gpu("node-a", "gpu-0", UUID0, "NVIDIA H100 80GB HBM3")
    assert reg.get_sample_value("gpuslice_gpu_cores_allocated_ratio", a0) == 0.5
    gpu_lines = [
        line for line in generate_latest(reg).decode().splitlines() if "gpuslice_gpu_" in line
    ]
    assert not [line for line in gpu_lines if "node-b" in line]
    # A claim still allocated on a device that is no longer published keeps its row, named by
    # its allocation only (no index or UUID to tell).
    whole = {"namespace": "web", "claim": "whole", "Hostname": "node-b", "gpu": "", "UUID": ""}
    whole |= {"GPU_I_PROFILE": "", "dra_device": "gpu-0"}
    assert reg.get_sample_value("gpuslice_claim_cores_ratio", whole) is None
    assert reg.get_sample_value("gpuslice_claim_memory_bytes", whole) == 0


def test_until_synced_only_the_view_counters_are_given() -> None:
    source = t.FixedFeeder(cluster(), synced=False, events=EVENTS)
    reg = registry(source)
    text = generate_latest(reg).decode()
    assert "gpuslice_gpu_" not in text and "gpuslice_claim_" not in text
    assert reg.get_sample_value("gpuslice_view_synced") == 0
    assert reg.get_sample_value("gpuslice_view_events_total", {"kind": "ResourceClaim"}) == 5
    assert source.reads == 0
    source.synced.set()
    assert reg.get_sample_value("gpuslice_view_synced") == 1
    assert "gpuslice_gpu_memory_total_bytes" in generate_latest(reg).decode()


def test_one_read_of_the_view_per_scrape() -> None:
    source = t.FixedFeeder(cluster(), events=EVENTS)
    generate_latest(open_registry(source))
    assert source.reads == 1


def test_the_open_port_names_no_claim_and_no_namespace() -> None:
    """Issue 27: /metrics needs no credentials, so it carries no tenant data; the per-claim
    series are only in the claim collector (served behind the view's authorization)."""
    view = cluster()
    now = time.time()
    view.live = {"node-a": NodeLive("node-a", "u", now, {("uid-a", UUID0): ShareLive(1, 0, 5)})}
    source = t.FixedFeeder(view, events=EVENTS)
    open_text = generate_latest(open_registry(source)).decode()
    assert "gpuslice_gpu_memory_used_bytes" in open_text  # the GPU's live figures stay
    labels = {
        name
        for family in open_registry(source).collect()
        for sample in family.samples
        for name in sample.labels
    }
    assert labels == {
        "Hostname",
        "gpu",
        "UUID",
        "GPU_I_PROFILE",
        "dra_device",
        "model",
        "type",
        "state",
        "kind",
    }
    assert "gpuslice_claim_" not in open_text and '"ml"' not in open_text
    claims = CollectorRegistry()
    claims.register(ClaimCollector(source))
    claim_families = {family.name for family in claims.collect()}
    assert claim_families == {
        "gpuslice_claim_cores_ratio",
        "gpuslice_claim_memory_bytes",
        "gpuslice_claim_memory_used_bytes",
        "gpuslice_claim_sm_used_ratio",
        "gpuslice_claim_pending",
    }
    unsynced = t.FixedFeeder(cluster(), synced=False)
    claims = CollectorRegistry()
    claims.register(ClaimCollector(unsynced))
    assert generate_latest(claims) == b"" and unsynced.reads == 0


def test_live_usage_rows_only_while_the_enforcers_figures_are_current() -> None:
    view = cluster()
    now = time.time()
    view.live = {
        "node-a": NodeLive("node-a", "u", now, {("uid-a", UUID0): ShareLive(3 * GIB, 0, 25)}),
        "node-b": NodeLive("node-b", "u", now, error="timed out"),
    }
    reg = registry(t.FixedFeeder(view, events=EVENTS))
    a0 = gpu("node-a", "gpu-0", UUID0, "NVIDIA H100 80GB HBM3")
    assert reg.get_sample_value("gpuslice_gpu_memory_used_bytes", a0) == 3 * GIB
    assert reg.get_sample_value("gpuslice_gpu_sm_used_ratio", a0) == 0.25
    a = claim("ml", "a", "node-a", "gpu-0", UUID0)
    assert reg.get_sample_value("gpuslice_claim_memory_used_bytes", a) == 3 * GIB
    assert reg.get_sample_value("gpuslice_claim_sm_used_ratio", a) == 0.25
    b = claim("ml", "b", "node-a", "gpu-0", UUID0)
    assert reg.get_sample_value("gpuslice_claim_memory_used_bytes", b) is None  # not measured
    b0 = gpu("node-b", "gpu-0", UUID0, "NVIDIA L4")
    assert reg.get_sample_value("gpuslice_gpu_memory_used_bytes", b0) is None  # unreachable
    up = "gpuslice_view_usage_up"
    assert reg.get_sample_value(up, {"Hostname": "node-a", "state": "ok"}) == 1
    assert reg.get_sample_value(up, {"Hostname": "node-b", "state": "unreachable"}) == 0


def test_a_pod_waiting_for_an_unallocated_claim_of_ours_is_pending() -> None:
    view = cluster()
    view.apply("ResourceClaim", "ADDED", t.claim("ml", "other", device_class="other.example.com"))
    for pod in (
        t.pod("ml", "waits", claim="pending"),  # unscheduled, our claim has no allocation
        t.pod("ml", "runs", claim="a"),  # its claim is allocated
        t.pod("ml", "elsewhere", claim="other"),  # a claim of another driver's class
        t.pod("ml", "early", template="tpl"),  # its claim is not created yet
    ):
        view.apply("Pod", "ADDED", pod)
    bound = t.pod("ml", "bound", claim="pending")
    bound["spec"]["nodeName"] = "node-a"
    view.apply("Pod", "ADDED", bound)
    reg = registry(t.FixedFeeder(view, events=EVENTS))
    text = generate_latest(reg).decode()
    pending = [line for line in text.splitlines() if line.startswith("gpuslice_claim_pending{")]
    assert pending == ['gpuslice_claim_pending{claim="pending",namespace="ml",pod="waits"} 1.0']
    assert (
        "gpuslice_claim_pending" not in generate_latest(open_registry(t.FixedFeeder(view))).decode()
    )
    allocated = t.claim("ml", "pending", results=[t.result("node-a", "gpu-1")], pods=("waits",))
    view.apply("ResourceClaim", "MODIFIED", allocated)
    assert "gpuslice_claim_pending{" not in generate_latest(reg).decode()
