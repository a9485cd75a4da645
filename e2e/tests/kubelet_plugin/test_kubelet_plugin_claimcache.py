"""The claim cache against the real API server: prepare takes the claim from the watch when it
has the claim the kubelet names, and reads the API otherwise (docs/kubelet-plugin.md,
"The claim cache")."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import delete_claim
from e2e.sandbox.nodeagent.credentials import node_kubeconfig
from e2e.sandbox.nodeagent.testing import unique, wait_for
from e2e.support.kubelet_plugin import ClaimMaker, RecordingRawApi
from gpuslice_api.names import DRIVER
from gpuslice_draplugin import ClaimCache, ClaimRef, ResourceApi
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import RawApi
from gpuslice_testkit.kubelet_plugin.dra import ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness, Running

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)


def test_prepare_takes_a_watched_claim_without_reading_the_api(
    harness: Harness, claims: ClaimMaker, node_name: str, namespace: str
) -> None:
    raw = RecordingRawApi(harness.raw())
    plugin = harness.start(raw=raw)
    claim = claims("c", results=[result("gpu-0", pool=node_name)])
    uid = claim["metadata"]["uid"]
    wait_for(
        lambda: plugin.app.helper.claims.get(ClaimRef(namespace, "c", uid)) is not None,
        10,
        "cache",
    )
    answer = plugin.client.prepare([ref(claim)])[uid]
    assert answer.error == ""
    assert answer.devices[0]["device"] == "gpu-0"
    assert not [p for p in raw.gets if p.endswith(f"/namespaces/{namespace}/resourceclaims/c")]


def test_the_uid_the_kubelet_names_wins_over_the_cache(
    plugin: Running, claims: ClaimMaker, kube: RawApi, node_name: str, namespace: str
) -> None:
    old = claims("c", results=[result("gpu-0", pool=node_name)])
    old_uid = old["metadata"]["uid"]
    wait_for(
        lambda: plugin.app.helper.claims.get(ClaimRef(namespace, "c", old_uid)) is not None,
        10,
        "cache",
    )
    delete_claim(kube, namespace, "c")
    new = claims("c", results=[result("gpu-1", pool=node_name)])
    uid = new["metadata"]["uid"]
    # at once, whatever the watch has delivered by now: the new claim's device, never the old
    answer = plugin.client.prepare([ref(new)])[uid]
    assert answer.error == ""
    assert answer.devices[0]["device"] == "gpu-1"
    # and the old UID is answered as the API has it now: re-created
    error = plugin.client.prepare([ref(old)])[old_uid].error
    assert f"the kubelet asked for {old_uid}" in error


def test_after_unprepare_the_claim_is_read_again(
    harness: Harness, claims: ClaimMaker, node_name: str, namespace: str
) -> None:
    raw = RecordingRawApi(harness.raw())
    plugin = harness.start(raw=raw)
    claim = claims("c", results=[result("gpu-0", pool=node_name)])
    uid = claim["metadata"]["uid"]
    wait_for(
        lambda: plugin.app.helper.claims.get(ClaimRef(namespace, "c", uid)) is not None, 10, ""
    )
    assert plugin.client.prepare([ref(claim)])[uid].error == ""
    assert plugin.client.unprepare([ref(claim)]) == {uid: ""}
    # its allocation may have changed since (the watch may not say so yet): read it
    assert plugin.client.prepare([ref(claim)])[uid].error == ""
    assert [p for p in raw.gets if p.endswith(f"/namespaces/{namespace}/resourceclaims/c")]


def test_without_list_permission_the_cache_is_off_and_prepare_reads_the_api(
    plugin: Running, sandbox: ControlPlane, short_dir: Path, node_name: str
) -> None:
    # a node identity may not list claims (the Node authorizer): a real 403
    stranger = node_kubeconfig(sandbox.pki, sandbox.server, unique("stranger"), short_dir / "n")
    forbidden = RawApi(new_api_client(stranger, user_agent="gpuslice-test"), deadline=2)
    cache = ClaimCache(
        ResourceApi(forbidden, plugin.app.helper.api.server), driver=DRIVER, pool=node_name
    )
    assert cache.start() is False
    assert not cache.enabled
    assert cache.get(ClaimRef("ns", "c", "u")) is None
    cache.stop()


def test_the_cache_can_be_turned_off(harness: Harness, claims: ClaimMaker, node_name: str) -> None:
    plugin = harness.start(claim_cache=False)
    assert not plugin.app.helper.claims.enabled
    claim = claims("c", results=[result("gpu-0", pool=node_name)])
    assert plugin.client.prepare([ref(claim)])[claim["metadata"]["uid"]].error == ""
