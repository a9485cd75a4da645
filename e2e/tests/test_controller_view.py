"""The controller's cluster view against the real control plane: metrics per GPU (open) and
per claim (/view/metrics, only for a token the view admits), the /view/ JSON for
ServiceAccount tokens the real API server reviews (with the chart's own gpuslice-view
ClusterRole), and GpuUnschedulable Events on a pod the real scheduler cannot place. A sandbox
GPU node (node agent + the real kubelet plugin, one H100) serves the module; the controller runs
as a process without webhooks (admission has its own suite)."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.sandbox import procs
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    RESOURCE,
    GpuNode,
    claim_template,
    gpu_pod,
    running_gpu_node,
)
from e2e.sandbox.nodeagent.testing import (
    temporary_namespace,
    unique,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
)
from e2e.support.chart import render
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)


BIN = Path(sys.executable).parent
GIB = 1024**3

Sample = tuple[str, tuple[tuple[str, str], ...]]


def parse_samples(text: str) -> dict[Sample, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@dataclass
class Controller:
    port: int
    metrics_port: int
    log: Path
    stop: Callable[[], object]

    def get(self, path: str, token: str | None) -> tuple[int, Any]:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the controller's own CA; not what is tested here
        request = urllib.request.Request(f"https://127.0.0.1:{self.port}{path}")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=10) as r:
                return int(r.status), json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def metrics(self) -> dict[Sample, float]:
        """The open metrics port, as anyone on the network reads it."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
        except urllib.error.URLError:
            return {}  # not listening yet
        return parse_samples(text)

    def claim_metrics(self, token: str | None) -> tuple[int, dict[Sample, float]]:
        """``GET /view/metrics`` with ``token``: (status, samples)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        request = urllib.request.Request(f"https://127.0.0.1:{self.port}/view/metrics")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=10) as r:
                return int(r.status), parse_samples(r.read().decode())
        except urllib.error.HTTPError as exc:
            return exc.code, {}


@pytest.fixture(scope="module")
def node(sandbox: ControlPlane, kube: RawApi, device_classes: list[str]) -> Iterator[GpuNode]:
    with running_gpu_node(sandbox, kube, [{"model": "H100", "count": 1}], devices=1) as gpu_node:
        yield gpu_node


@pytest.fixture(scope="module")
def ns(kube: RawApi, node: GpuNode) -> Iterator[str]:
    with temporary_namespace(kube, "ctlview") as name:
        yield name


@contextlib.contextmanager
def running_controller(sandbox: ControlPlane, ns: str, root: Path) -> Iterator[Controller]:
    """The controller as a process on loopback (no webhooks, no election) until the view has
    synced; stopped on leaving (``Controller.stop`` stops it earlier)."""
    port, metrics_port = procs.free_port(), procs.free_port()
    argv = [
        str(BIN / "gpuslice-controller"),
        *("--kubeconfig", str(sandbox.kubeconfig), "--namespace", ns, "--identity", "view-0"),
        *("--webhook-addr", f"127.0.0.1:{port}", "--metrics-addr", f"127.0.0.1:{metrics_port}"),
        *("--tls-secret", "view-tls", "--cert-hosts", "127.0.0.1"),
        *("--cert-dir", str(root / "certs"), "--no-leader-elect"),
        *("--validating-webhooks", "", "--mutating-webhooks", ""),
        *("--event-interval", "5", "--log-level", "debug"),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = root / "controller.log"
    proc = procs.start("controller", argv, log, env, cwd=Path.cwd(), die_with_parent=True)
    ctl = Controller(port, metrics_port, log, stop=lambda: procs.stop([proc], grace=10))
    try:
        wait_for(
            lambda: ctl.metrics().get(("gpuslice_view_synced", ())) == 1 or None,
            60,
            "the controller's view to sync",
        )
        yield ctl
    finally:
        ctl.stop()
        print(log.read_text()[-6000:])


@pytest.fixture(scope="module")
def controller(
    sandbox: ControlPlane, kube: RawApi, ns: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Controller]:
    with running_controller(sandbox, ns, tmp_path_factory.mktemp("controller-view")) as ctl:
        yield ctl


def token(kube: RawApi, ns: str, account: str) -> str:
    kube.create(
        resource_path("v1", "serviceaccounts", namespace=ns),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
    )
    path = resource_path("v1", "serviceaccounts", namespace=ns, name=account) + "/token"
    made = kube.create(path, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest"})
    return str(made["status"]["token"])


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
    gpu = (
        ("device", "gpu-0"),
        ("model", "NVIDIA H100 80GB HBM3"),
        ("node", node.name),
        ("type", "gpu"),
        ("uuid", node.gpu_uuid(0)),
    )

    def allocated() -> float | None:
        return controller.metrics().get(("gpuslice_gpu_cores_allocated_percent", gpu))

    wait_for(lambda: allocated() == 30 or None, 10, "30% of gpu-0 in the metrics")
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
        if name == "gpuslice_claim_cores_percent" and ("namespace", ns) in labels
    ]
    assert claim_row[1] == 30 and ("device", "gpu-0") in claim_row[0]
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
