"""The view's JSON endpoints: routes, shapes (those of kubectl gpuslice -o json), 503, 404."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, TypeVar

import pytest

from gpuslice_controller.view.api import ViewApi, credentials
from gpuslice_controller.view.auth import Authorizer, Decision
from gpuslice_testkit import view as t
from gpuslice_view import report
from gpuslice_view.model import ClusterView
from gpuslice_view.wire import TOKEN_HEADER

pytestmark = pytest.mark.timeout(10)
T = TypeVar("T")


def cluster() -> ClusterView:
    return ClusterView.build(
        slices=[t.resource_slice("node-a", [t.gpu(0), t.gpu(1), t.mig(2, "1g.10gb", 0, 9856)])],
        claims=[
            t.claim(
                "ml",
                "a",
                results=[t.result("node-a", "gpu-0", cores="80", memory="20Gi")],
                pods=("pa",),
            ),
            t.claim("web", "whole", results=[t.result("node-a", "gpu-1")], pods=("w",)),
            t.claim("ml", "pending"),
        ],
        classes=t.CLASSES,
    )


class Allow(Authorizer):
    def __init__(self) -> None:
        self.answer = Decision(HTTPStatus.OK, user="alice")

    def check(self, authorization: str | None) -> Decision:
        return self.answer


@pytest.fixture
def source() -> t.FixedFeeder:
    view = cluster()
    pod = t.pod("ml", "waiting", claim="pending")
    pod["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1"}
    ]
    view.apply("Pod", "ADDED", pod)
    return t.FixedFeeder(view)


def get(api: ViewApi, path: str) -> tuple[HTTPStatus, Any]:
    answer = api.get(path, "Bearer x")
    return answer.status, json.loads(answer.body)


def test_gpus_and_one_gpu_as_the_plugin_prints_them(source: t.FixedFeeder) -> None:
    api = ViewApi(source, Allow())
    status, rows = get(api, "/view/gpus")
    assert status == HTTPStatus.OK and rows == report.gpu_rows(source.view)
    status, row = get(api, "/view/gpus/node-a/0")
    assert status == HTTPStatus.OK and row["uuid"] == "GPU-00000000-aaaa"
    assert row["cores"] == {"total": 100, "used": 80}
    assert get(api, "/view/gpus/MIG-2-0")[1]["device"] == "gpu-2-mig-1g-10gb-0"
    assert get(api, "/view/gpus/node-a/gpu-2-mig-1g-10gb-0")[1]["profile"] == "1g.10gb"
    status, error = get(api, "/view/gpus/node-z/0")
    assert status == HTTPStatus.NOT_FOUND and "node-a" in error["error"]


def test_claims_of_all_or_one_namespace(source: t.FixedFeeder) -> None:
    api = ViewApi(source, Allow())
    _, rows = get(api, "/view/claims")
    assert rows == report.claim_rows(source.view, None)
    _, web = get(api, "/view/claims?namespace=web")
    assert [r["name"] for r in web] == ["whole"]


def test_why_a_pod_waits(source: t.FixedFeeder) -> None:
    api = ViewApi(source, Allow())
    status, why = get(api, "/view/why/ml/waiting")
    assert status == HTTPStatus.OK
    assert why["pod"] == "ml/waiting" and why["scheduler"] == "0/1"
    assert why["reasons"][0]["claim"] == "ml/pending"
    assert get(api, "/view/why/ml/nobody")[0] == HTTPStatus.NOT_FOUND
    assert get(api, "/view/other")[0] == HTTPStatus.NOT_FOUND


def test_authorization_comes_first_then_sync(source: t.FixedFeeder) -> None:
    deny = Allow()
    deny.answer = Decision(HTTPStatus.FORBIDDEN, message="no")
    source.synced.clear()
    assert ViewApi(source, deny).get("/view/gpus", None).status == HTTPStatus.FORBIDDEN
    status, error = get(ViewApi(source, Allow()), "/view/gpus")
    assert status == HTTPStatus.SERVICE_UNAVAILABLE and "not synced" in error["error"]
    assert source.reads == 0


def test_claim_metrics_are_behind_the_same_door(source: t.FixedFeeder) -> None:
    deny = Allow()
    deny.answer = Decision(HTTPStatus.UNAUTHORIZED, message="a bearer token is required")
    refused = ViewApi(source, deny).get("/view/metrics", None)
    assert refused.status == HTTPStatus.UNAUTHORIZED and b"gpuslice_claim_" not in refused.body
    assert source.reads == 0
    answer = ViewApi(source, Allow()).get("/view/metrics", "Bearer x")
    assert answer.status == HTTPStatus.OK and answer.content_type.startswith("text/plain")
    text = answer.body.decode()
    assert 'gpuslice_claim_cores_ratio{GPU_I_PROFILE="",Hostname="node-a",UUID=' in text
    assert 'claim="a",dra_device="gpu-0",gpu="0",namespace="ml"' in text
    assert "gpuslice_gpu_" not in text  # those are on the open port
    # Before the view has synced: 200 and no claim series (a failing target would look down).
    source.synced.clear()
    answer = ViewApi(source, Allow()).get("/view/metrics", "Bearer x")
    assert answer.status == HTTPStatus.OK and answer.body == b""


def test_the_token_comes_from_authorization_else_the_proxy_safe_header() -> None:
    assert credentials({"Authorization": "Bearer a", TOKEN_HEADER: "Bearer b"}) == "Bearer a"
    assert credentials({TOKEN_HEADER: "Bearer b"}) == "Bearer b"
    assert credentials({}) is None
