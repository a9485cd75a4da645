"""The namespaced resources' objects: GPUClaim from a claim's row and back, GPUReason from
``why``'s answer and back, and their table cells."""

from __future__ import annotations

from gpuslice_testkit.view import CLASSES, claim, gpu, pod, resource_slice, result
from gpuslice_view import namespaced, report
from gpuslice_view.model import ClusterView


def cluster() -> ClusterView:
    taken = [result("node-a", "gpu-0", cores="30")]
    labelled = claim("ml", "a", results=taken, pods=("p",), cores="30")
    labelled["metadata"]["labels"] = {"team": "vision", "app": "train"}
    return ClusterView.build(
        slices=[resource_slice("node-a", [gpu(0)])],
        claims=[labelled, claim("ml", "pending", memory="10Gi")],
        pods=[pod("ml", "waiting", claim="pending")],
        classes=CLASSES,
    )


def test_a_gpuclaim_carries_the_claims_labels_requests_and_devices_and_gives_its_row_back() -> None:
    view = cluster()
    objs = namespaced.claim_objects(view)
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs] == [
        ("ml", "a"),
        ("ml", "pending"),
    ]
    a = objs[0]
    assert a["apiVersion"] == "view.gpuslice.dev/v1alpha1" and a["kind"] == "GPUClaim"
    assert a["metadata"]["labels"] == {"app": "train", "team": "vision"}
    assert a["metadata"]["uid"] == namespaced.uid("gpuclaims", "ml", "a")
    assert a["spec"]["requests"] == [
        {
            "name": "gpu",
            "deviceClassName": "gpu.gpuslice.dev",
            "allocationMode": "ExactCount",
            "count": 1,
            "cores": 30,
            "memory": None,
            "selectors": [],
        }
    ]
    [device] = a["status"]["devices"]
    assert device["node"] == "node-a" and device["device"] == "node-a/0"
    assert "labels" not in objs[1]["metadata"]  # a claim without labels
    for obj, c in zip(objs, sorted(view.claims.values(), key=lambda c: c.key), strict=True):
        row = report.claim_row(view, c)
        assert namespaced.claim_row_of(obj) == row
        assert namespaced.claim_object(row) == obj


def test_an_older_controllers_row_gives_an_object_without_what_it_lacks() -> None:
    row = {"namespace": "ml", "name": "a", "state": "Pending", "devices": [], "pods": []}
    obj = namespaced.claim_object(row)
    assert obj["spec"] == {"requests": []} and "labels" not in obj["metadata"]
    assert namespaced.claim_cells(obj)[8:] == ["-", "-"]


def test_a_gpureason_is_whys_answer_named_as_the_pod() -> None:
    view = cluster()
    answer = report.why_row(view, "ml", "waiting")
    assert answer is not None and report.why_row(view, "ml", "nobody") is None
    obj = namespaced.reason_object("ml", "waiting", answer)
    assert obj["kind"] == "GPUReason" and obj["metadata"]["name"] == "waiting"
    assert namespaced.why_of(obj) == answer
    cells = namespaced.reason_cells(obj)
    assert cells[:3] == ["waiting", "-", answer["reasons"][0]["code"]]
    assert len(cells) == len(namespaced.REASON_COLUMNS)
