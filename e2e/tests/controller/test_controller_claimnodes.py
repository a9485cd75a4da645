"""The controller's node label on allocated claims, against the real API server
(``gpuslice_controller.claimnodes``; docs/kubelet-plugin.md, "The claim cache"): the leader
keeps ``gpu.gpuslice.dev/node`` equal to the node a claim of our driver is allocated to, and a
watch with one node's label then delivers that node's claims and no others."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from e2e.sandbox.gpunode import RESOURCE
from e2e.sandbox.nodeagent.testing import wait_for
from gpuslice_api.names import NODE_LABEL, node_label_value
from gpuslice_controller.claimnodes import ClaimNodeLabels
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.kubelet_plugin.dra import result

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(60)


def claim_path(namespace: str, name: str = "") -> str:
    return resource_path(RESOURCE, "resourceclaims", namespace=namespace, name=name or None)


def make_claim(
    kube: RawApi, namespace: str, name: str, labels: dict[str, str] | None = None
) -> Obj:
    """An unallocated claim (no label: nothing has written one)."""
    return kube.create(
        claim_path(namespace),
        {
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuslice.dev"}}
                    ]
                }
            },
        },
    )


def allocate(kube: RawApi, namespace: str, name: str, results: list[Obj] | None) -> None:
    """Write (or with None remove) the allocation, as the scheduler does (a merge patch: the
    labeller may be writing the claim's metadata at the same time)."""
    allocation = {"devices": {"results": results}} if results else None
    kube.patch(claim_path(namespace, name) + "/status", {"status": {"allocation": allocation}})


def label_of(kube: RawApi, namespace: str, name: str) -> str | None:
    labels = kube.get(claim_path(namespace, name))["metadata"].get("labels") or {}
    return labels.get(NODE_LABEL)


@pytest.fixture
def labels(kube: RawApi) -> Iterator[ClaimNodeLabels]:
    """The labeller with its watch running, not leading yet."""
    labeller = ClaimNodeLabels(kube, version=RESOURCE.split("/")[1])
    labeller.start()
    wait_for(labeller.reflector.synced.is_set, 10, "the claim watch's first list")
    yield labeller
    labeller.stop()


@pytest.fixture
def leading(labels: ClaimNodeLabels) -> Iterator[ClaimNodeLabels]:
    """The labeller as the leader runs it, until the test ends (the lease is lost)."""
    stop = threading.Event()
    thread = threading.Thread(target=labels.run, args=(stop,), daemon=True)
    thread.start()
    yield labels
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_the_leader_labels_a_claim_with_the_node_it_is_allocated_to_and_follows_it(
    leading: ClaimNodeLabels, kube: RawApi, namespace: str
) -> None:
    make_claim(kube, namespace, "c")
    allocate(kube, namespace, "c", [result("gpu-0", pool="node-a")])
    wait_for(lambda: label_of(kube, namespace, "c") == "node-a", 10, "label node-a")
    # deallocated and allocated elsewhere (a scheduler unreserve, then another pod)
    allocate(kube, namespace, "c", None)
    wait_for(lambda: label_of(kube, namespace, "c") is None, 10, "label removed")
    allocate(kube, namespace, "c", [result("gpu-3", pool="node-b")])
    wait_for(lambda: label_of(kube, namespace, "c") == "node-b", 10, "label node-b")


def test_claims_of_other_drivers_and_unallocated_claims_get_no_label(
    leading: ClaimNodeLabels, kube: RawApi, namespace: str
) -> None:
    make_claim(kube, namespace, "other")
    allocate(kube, namespace, "other", [result("x-0", pool="node-a", driver="other.example.com")])
    make_claim(kube, namespace, "pending")
    make_claim(kube, namespace, "ours")
    allocate(kube, namespace, "ours", [result("gpu-0", pool="node-a")])
    # the watch hands events over in order and the labeller decides at each whether a write is
    # due, so once the last claim is labelled the others' events were judged
    wait_for(lambda: label_of(kube, namespace, "ours") == "node-a", 10, "label")
    assert label_of(kube, namespace, "other") is None
    assert label_of(kube, namespace, "pending") is None


def test_a_wrong_label_is_corrected_and_a_right_one_costs_no_write(
    leading: ClaimNodeLabels, kube: RawApi, namespace: str
) -> None:
    # a tenant labels its claim to land in another node's watch
    make_claim(kube, namespace, "spoofed", {NODE_LABEL: "node-z"})
    allocate(kube, namespace, "spoofed", [result("gpu-0", pool="node-a")])
    wait_for(lambda: label_of(kube, namespace, "spoofed") == "node-a", 10, "label corrected")
    writes = leading.writes
    # more events of a claim whose label is right: no write
    for i in range(3):
        kube.patch(claim_path(namespace, "spoofed"), {"metadata": {"annotations": {"n": str(i)}}})
    make_claim(kube, namespace, "marker")
    allocate(kube, namespace, "marker", [result("gpu-2", pool="node-a")])
    wait_for(lambda: label_of(kube, namespace, "marker") == "node-a", 10, "marker label")
    assert leading.writes == writes + 1  # the marker's


def test_nothing_is_written_before_leading_and_the_new_leader_catches_up(
    labels: ClaimNodeLabels, kube: RawApi, namespace: str
) -> None:
    make_claim(kube, namespace, "c")
    allocate(kube, namespace, "c", [result("gpu-0", pool="node-a")])
    wait_for(lambda: "/".join((namespace, "c")) in labels.reflector.cache, 10, "watched")
    assert labels.writes == 0
    assert label_of(kube, namespace, "c") is None
    stop = threading.Event()
    thread = threading.Thread(target=labels.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: label_of(kube, namespace, "c") == "node-a", 10, "caught up")
    finally:
        stop.set()
        thread.join(5)


def test_a_node_name_too_long_for_a_label_value_is_digested(
    leading: ClaimNodeLabels, kube: RawApi, namespace: str
) -> None:
    node = "gpu-node-" + "x" * 70 + ".example.internal"
    make_claim(kube, namespace, "c")
    allocate(kube, namespace, "c", [result("gpu-0", pool=node)])
    wait_for(lambda: label_of(kube, namespace, "c") is not None, 10, "label")
    value = label_of(kube, namespace, "c")
    assert value == node_label_value(node) and len(value) <= 63
    # what one node's plugin watches: its own claims only
    selected = kube.list(claim_path(namespace), label_selector=f"{NODE_LABEL}={value}")["items"]
    assert [c["metadata"]["name"] for c in selected] == ["c"]
