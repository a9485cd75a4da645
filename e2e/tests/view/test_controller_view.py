"""The controller's cluster view against the real control plane: metrics per GPU (open) and
per claim (/view/metrics, only for a token the view admits), the /view/ JSON for
ServiceAccount tokens the real API server reviews (with the chart's own gpuslice-view
ClusterRole), and GpuUnschedulable Events on a pod the real scheduler cannot place. A sandbox
GPU node (node agent + the real kubelet plugin, one H100) serves the module; the controller runs
as a process without webhooks (admission has its own suite)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    RESOURCE,
    GpuNode,
    claim_template,
    gpu_pod,
)
from e2e.sandbox.nodeagent.testing import (
    unique,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
)
from e2e.support.chart import render
from e2e.support.controller import Controller, running_controller, token
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)


GIB = 1024**3


@pytest.fixture(scope="module")
def controller(
    sandbox: ControlPlane, kube: RawApi, ns: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Controller]:
    with running_controller(sandbox, ns, tmp_path_factory.mktemp("controller-view")) as ctl:
        yield ctl


@pytest.fixture(scope="module")
def tokens(kube: RawApi, ns: str, helm_bin: Path) -> Iterator[tuple[str, str]]:
    """(a token of a ServiceAccount bound to the chart's gpuslice-view ClusterRole, one
    without)."""
    [role] = [
        o
        for o in render(helm_bin, "--show-only", "templates/controller.yaml")
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "gpuslice-view"
    ]
    name = unique("gpuslice-view")
    role["metadata"] = {"name": name}
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create(resource_path(rbac, "clusterroles"), role)
    binding = {
        "apiVersion": rbac,
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
    }
    kube.create(resource_path(rbac, "clusterrolebindings"), binding)
    try:
        yield token(kube, ns, "reader"), token(kube, ns, "stranger")
    finally:
        for plural in ("clusterrolebindings", "clusterroles"):
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(resource_path(rbac, plural, name=name))


def start_pod(kube: RawApi, ns: str, node: GpuNode, name: str, **capacity: str) -> None:
    template = claim_template(ns, name, "gpu.gpuslice.dev", **capacity)
    kube.create(resource_path(RESOURCE, "resourceclaimtemplates", namespace=ns), template)
    kube.create(
        resource_path("v1", "pods", namespace=ns), gpu_pod(ns, name, node.name, template=name)
    )


def test_metrics_follow_a_share_and_its_delete(
    controller: Controller, kube: RawApi, node: GpuNode, ns: str, tokens: tuple[str, str]
) -> None:
    """The GPU's figures on the open port; the claim's (namespace and name: tenant data) only
    on /view/metrics, for a token the real API server says may read the view (issue 27)."""
    reader, stranger = tokens
    start_pod(kube, ns, node, "share", cores="30", memory="20Gi")
    wait_pod_phase(kube, ns, "share", "Running", timeout=30)
    gpu = (  # as dcgm-exporter labels the GPU, and its DRA name (sorted, as parsed)
        ("GPU_I_PROFILE", ""),
        ("Hostname", node.name),
        ("UUID", node.gpu_uuid(0)),
        ("dra_device", "gpu-0"),
        ("gpu", "0"),
        ("model", "NVIDIA H100 80GB HBM3"),
        ("type", "gpu"),
    )

    def allocated() -> float | None:
        return controller.metrics().get(("gpuslice_gpu_cores_allocated_ratio", gpu))

    wait_for(lambda: allocated() == 0.3 or None, 10, "30% of gpu-0 in the metrics")
    samples = controller.metrics()
    assert samples[("gpuslice_gpu_memory_allocated_bytes", gpu)] == 20 * GIB
    assert samples[("gpuslice_gpu_memory_total_bytes", gpu)] == 81559 * 1024**2
    assert samples[("gpuslice_gpu_cordoned", gpu)] == 0
    assert samples[("gpuslice_view_events_total", (("kind", "ResourceClaim"),))] > 0
    # Nothing on the open port names a claim or a namespace.
    assert not [key for key in samples if key[0].startswith("gpuslice_claim_")]
    assert not [key for key in samples if {"namespace", "claim", "pod"} & dict(key[1]).keys()]

    status, claims = controller.claim_metrics(reader)
    assert status == 200
    [claim_row] = [
        (labels, v)
        for (name, labels), v in claims.items()
        if name == "gpuslice_claim_cores_ratio" and ("namespace", ns) in labels
    ]
    assert claim_row[1] == 0.3 and ("dra_device", "gpu-0") in claim_row[0]
    assert ("UUID", node.gpu_uuid(0)) in claim_row[0] and ("gpu", "0") in claim_row[0]
    assert not [key for key in claims if key[0].startswith("gpuslice_gpu_")]
    assert controller.claim_metrics(stranger)[0] == 403
    assert controller.claim_metrics(None)[0] == 401
    assert controller.claim_metrics("not-a-token")[0] == 401

    kube.delete(resource_path("v1", "pods", namespace=ns, name="share"))
    wait_pod_gone(kube, ns, "share", timeout=30)
    wait_for(lambda: allocated() == 0 or None, 20, "gpu-0 free in the metrics")
    status, claims = controller.claim_metrics(reader)
    assert status == 200
    assert not [key for key in claims if ("namespace", ns) in key[1]]


def test_view_json_needs_a_token_with_the_permission(
    controller: Controller, node: GpuNode, tokens: tuple[str, str]
) -> None:
    reader, stranger = tokens
    status, rows = controller.get("/view/gpus", reader)
    assert status == 200
    [row] = [r for r in rows if r["node"] == node.name]
    assert row["uuid"] == node.gpu_uuid(0) and row["cores"]["total"] == 100
    status, one = controller.get(f"/view/gpus/{node.name}/0", reader)
    assert status == 200 and one["uuid"] == node.gpu_uuid(0)
    status, _ = controller.get("/view/claims", reader)
    assert status == 200

    status, error = controller.get("/view/gpus", stranger)
    assert status == 403 and 'cannot get resource "gpus"' in error["error"]
    assert controller.get("/view/gpus", None)[0] == 401
    assert controller.get("/view/gpus", "not-a-token")[0] == 401


def test_an_unschedulable_pod_gets_the_reason_as_an_event(
    controller: Controller, kube: RawApi, node: GpuNode, ns: str, tokens: tuple[str, str]
) -> None:
    start_pod(kube, ns, node, "huge", cores="10", memory="100Gi")

    def events() -> list[Obj]:
        listed = kube.list(resource_path("v1", "events", namespace=ns))["items"]
        return [e for e in listed if e.get("reason") == "GpuUnschedulable"]

    def both() -> list[Obj] | None:
        found = events()
        return (
            found
            if {e["involvedObject"]["kind"] for e in found} == {"Pod", "ResourceClaim"}
            else None
        )

    found = wait_for(
        both,
        30,
        "GpuUnschedulable on the pod and its claim",
    )
    for event in found:
        assert event["type"] == "Warning"
        assert event["message"].startswith(f"NoFreeMemory: claim {ns}/huge-")
        assert "no matching GPU has 100Gi of free memory" in event["message"]
    [on_pod] = [e for e in found if e["involvedObject"]["kind"] == "Pod"]
    assert on_pod["involvedObject"]["name"] == "huge"
    # The same reason through the view's JSON.
    status, why = controller.get(f"/view/why/{ns}/huge", tokens[0])
    assert status == 200 and why["reasons"][0]["code"] == "NoFreeMemory"
    # Counted up (interval 5 s here), not posted again.
    wait_for(lambda: all(e.get("count", 1) >= 2 for e in events()) or None, 20, "a count update")
    assert len(events()) == 2
    kube.delete(resource_path("v1", "pods", namespace=ns, name="huge"))
    wait_pod_gone(kube, ns, "huge", timeout=30)
