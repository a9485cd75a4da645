"""Objects a tenant can write, against the real API server: none may crash or stall a gpuslice
component that reads them (docs/kubelet-plugin.md and docs/controller.md, "Objects others
write").

- A ResourceClaim whose opaque parameters nest 1,500 levels deep (9 KB; the API server takes
  it) used to make every kubelet plugin that started afterwards exit (RecursionError while its
  claim cache listed the cluster's claims); now it is skipped there and by every list and
  watch, its own prepare gets an error naming the reason, and admission denies it.
- ``limits.memory: "1e300000000"`` (16 bytes the API server never checks) used to keep the
  plugin computing a number of a billion digits while a good claim's prepare timed out; now it
  is refused at once naming the field and the range.
- A selector whose ``matches()`` pattern backtracks without bound used to stall the view's
  ``why`` (with the view's lock held); now the view says it cannot judge it.

The hostile bodies are sent as bytes: the kubernetes client's own encoder recurses too.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from kubernetes.client import ApiClient

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent.testing import temporary_namespace, wait_for
from e2e.support.kubelet_plugin import ClaimMaker
from gpuslice_controller.admission.validate import ClaimValidator, Classes
from gpuslice_controller.server import WebhookServer
from gpuslice_controller.tls import certs
from gpuslice_controller.tls.serving import ServingCert
from gpuslice_draplugin import ClaimRef
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kube.reflector import Reflector, metadata_only
from gpuslice_testkit.kubelet_plugin.dra import DraClient, gpu_config, ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness
from gpuslice_view.feed import ViewFeeder
from gpuslice_view.reasons import why_claim

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(60)

GV = "resource.k8s.io/v1"
DEPTH = 1500
BOMB = "^(.*.*.*)*X$"  # Python's re backtracks for hours on any 20-character product name


def deep_parameters(depth: int = DEPTH) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def claim_text(name: str, parameters: str, *, selector: str = "") -> str:
    """A ResourceClaim as JSON text, with ``parameters`` (JSON text) as its opaque config."""
    exactly: Obj = {"deviceClassName": "gpu.gpuslice.dev"}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    claim = {
        "apiVersion": GV,
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": exactly}],
                "config": [{"opaque": {"driver": "gpu.gpuslice.dev", "parameters": "@P@"}}],
            }
        },
    }
    return json.dumps(claim).replace('"@P@"', parameters)


def send(kube: RawApi, method: str, path: str, body: bytes, content_type: str) -> tuple[int, str]:
    """One request with a body of bytes, answered as (status, body text); nothing decoded."""
    api = kube.api_client
    assert isinstance(api, ApiClient)  # the sandbox's kubernetes client: its pool sends bytes
    headers = {"Content-Type": content_type, "Accept": "application/json"}
    _m, url, headers, _b, _p = api.param_serialize(
        method=method, resource_path=path, header_params=headers, auth_settings=["BearerToken"]
    )
    response = api.rest_client.pool_manager.request(
        method, url, body=body, headers=headers, preload_content=True, timeout=10
    )
    return int(response.status), response.data.decode(errors="replace")


#: Hostile claims of the running test, deleted after it (``_delete_hostile_claims``).
_CREATED: list[tuple[RawApi, str, str]] = []


def create_hostile(kube: RawApi, namespace: str, name: str, text: str) -> None:
    path = resource_path(GV, "resourceclaims", namespace=namespace)
    status, body = send(kube, "POST", path, text.encode(), "application/json")
    assert status == 201, body[:500]
    _CREATED.append((kube, namespace, name))


@pytest.fixture(autouse=True)
def _delete_hostile_claims() -> Iterator[None]:
    """Delete every hostile claim a test made and wait until it is gone: a namespace's deletion
    is asynchronous, and a claim left behind would be in every later test's cluster-wide list
    (kubectl gpuslice, for one, then warns that it skipped it)."""
    yield
    while _CREATED:
        kube, namespace, name = _CREATED.pop()
        path = resource_path(GV, "resourceclaims", namespace=namespace, name=name)
        patch = json.dumps({"metadata": {"finalizers": None}}).encode()
        send(kube, "PATCH", path, patch, "application/merge-patch+json")
        send(kube, "DELETE", path, b"{}", "application/json")

        def gone(kube: RawApi = kube, path: str = path) -> bool:
            return send(kube, "GET", path, b"", "application/json")[0] == 404

        wait_for(gone, 30, f"{namespace}/{name} deleted")


def allocate_hostile(kube: RawApi, namespace: str, name: str, results: list[Obj]) -> None:
    """Write an allocation into the status, as the scheduler would (a merge patch: the claim
    itself cannot be read back by a client that decodes it)."""
    path = resource_path(GV, "resourceclaims", namespace=namespace, name=name) + "/status"
    patch = {"status": {"allocation": {"devices": {"results": results}}}}
    status, body = send(
        kube, "PATCH", path, json.dumps(patch).encode(), "application/merge-patch+json"
    )
    assert status == 200, body[:500]


@pytest.fixture
def hostile_ns(kube: RawApi) -> Iterator[str]:
    """A namespace of its own, so that the deep claim is in the cluster-wide list of claims."""
    with temporary_namespace(kube, "hostile") as name:
        yield name


def test_a_deep_claim_stops_no_plugin_and_no_prepare(
    harness: Harness,
    kube: RawApi,
    claims: ClaimMaker,
    namespace: str,
    hostile_ns: str,
    node_name: str,
) -> None:
    create_hostile(kube, hostile_ns, "deep", claim_text("deep", deep_parameters()))
    good = claims("good", results=[result("gpu-0", pool=node_name)])
    create_hostile(kube, namespace, "deep-here", claim_text("deep-here", deep_parameters()))
    allocate_hostile(kube, namespace, "deep-here", [result("gpu-1", pool=node_name)])

    plugin = harness.start()  # used to die here: RecursionError listing every claim
    cache = plugin.app.helper.claims
    assert cache.reflector is not None
    wait_for(lambda: cache.get(ClaimRef(namespace, "good", good["metadata"]["uid"])), 10, "cache")

    # its UID, for the kubelet's call, read without decoding
    path = resource_path(GV, "resourceclaims", namespace=namespace, name="deep-here")
    status, text = send(kube, "GET", path, b"", "application/json")
    assert status == 200
    uid = text.split('"uid":"', 1)[1].split('"', 1)[0]
    start = time.perf_counter()
    answers = plugin.client.prepare([ref(good), (namespace, "deep-here", uid)])
    took = time.perf_counter() - start
    print(f"prepare of a good and a {DEPTH}-level claim in one call: {took * 1e3:.0f} ms")
    assert answers[good["metadata"]["uid"]].error == ""
    error = answers[uid].error
    assert f"ResourceClaim {namespace}/deep-here cannot be decoded: JSON nested deeper" in error
    assert len(error) < 400, error

    # one created while the plugin watches: skipped, and the watch goes on past it
    create_hostile(kube, hostile_ns, "deep-later", claim_text("deep-later", deep_parameters()))
    later = claims("later", results=[result("gpu-0", pool=node_name, cores="10", memory="1Gi")])
    wait_for(
        lambda: cache.get(ClaimRef(namespace, "later", later["metadata"]["uid"])), 10, "watched"
    )
    assert f"{hostile_ns}/deep-later" not in cache.reflector.cache


class CountingRawApi(RawApi):
    """The real client, counting the lists it starts (a reflector relists after a failure)."""

    def __init__(self, raw: RawApi) -> None:
        super().__init__(raw.api_client, deadline=raw.deadline)
        self.lists = 0

    def pages(self, path: str, **kwargs: Any) -> Iterator[tuple[Sequence[Obj], str | None]]:
        self.lists += 1
        return super().pages(path, **kwargs)


def test_a_reflector_lists_and_watches_past_a_deep_claim(
    kube: RawApi, claims: ClaimMaker, namespace: str, hostile_ns: str
) -> None:
    create_hostile(kube, hostile_ns, "deep", claim_text("deep", deep_parameters()))
    claims("a")
    seen: list[tuple[str, str]] = []
    path = resource_path(GV, "resourceclaims")
    raw = CountingRawApi(kube)
    reflector = Reflector(
        raw, path, lambda t, o: seen.append((t, o["metadata"]["name"])), keep=metadata_only
    )
    reflector.start()
    try:
        assert reflector.synced.wait(10), "the list never finished"
        assert f"{namespace}/a" in reflector.cache
        assert f"{hostile_ns}/deep" not in reflector.cache
        create_hostile(kube, hostile_ns, "deep2", claim_text("deep2", deep_parameters()))
        claims("b")
        wait_for(lambda: f"{namespace}/b" in reflector.cache, 10, "b")
        assert raw.lists == 1, "the watch failed on the deep claim and the reflector relisted"
        assert not [name for _t, name in seen if name.startswith("deep")]
        names = [i["metadata"]["name"] for i in kube.list(path)["items"]]
        assert "a" in names and "b" in names and "deep" not in names
    finally:
        reflector.stop()


def test_a_number_of_a_billion_digits_stalls_nothing(
    harness: Harness, kube: RawApi, claims: ClaimMaker, namespace: str, node_name: str
) -> None:
    plugin = harness.start(claim_cache=False)
    bad = claims(
        "huge",
        results=[result("gpu-0", pool=node_name)],
        config=[gpu_config(limits={"memory": "1e300000000"})],
    )
    good = claims("fine", results=[result("gpu-1", pool=node_name)])
    client = DraClient(plugin.settings.sockets.dra, timeout=5)
    answers: dict[str, str] = {}
    worker = threading.Thread(
        target=lambda: answers.update({"bad": client.prepare([ref(bad)])[ref(bad)[2]].error})
    )
    worker.start()
    try:
        start = time.perf_counter()
        fine = client.prepare([ref(good)])[good["metadata"]["uid"]]
        took = time.perf_counter() - start
        worker.join(5)
    finally:
        client.close()
    print(f"a good claim's prepare next to a 1e300000000 limit: {took * 1e3:.0f} ms")
    assert fine.error == ""
    assert took < 2, took
    assert "limits.memory: '1e300000000' is not allowed (out of range" in answers["bad"]
    assert "allowed: a quantity from 1Mi up to the GPU's memory" in answers["bad"]


def test_the_controller_view_survives_deep_claims_and_regex_bombs(
    harness: Harness,
    kube: RawApi,
    claims: ClaimMaker,
    namespace: str,
    hostile_ns: str,
    device_classes: list[str],
) -> None:
    harness.start()  # publishes the node's slices: devices for selectors to be judged on
    create_hostile(kube, hostile_ns, "deep", claim_text("deep", deep_parameters()))
    selector = f'device.attributes["gpu.gpuslice.dev"].productName.matches("{BOMB}")'
    params = '{"apiVersion":"gpu.gpuslice.dev/v1alpha1","kind":"GpuConfig"}'
    create_hostile(kube, namespace, "bomb", claim_text("bomb", params, selector=selector))
    claims("plain")
    feeder = ViewFeeder(kube)
    feeder.start()
    try:
        assert feeder.synced.wait(15), "the view never synced"
        assert feeder.read(lambda v: (namespace, "plain") in v.claims)
        assert feeder.read(lambda v: (hostile_ns, "deep") not in v.claims)
        wait_for(lambda: feeder.read(lambda v: bool(v.devices())), 10, "the node's devices")
        claim = feeder.read(lambda v: v.claims[(namespace, "bomb")])
        start = time.perf_counter()
        reasons = feeder.read(lambda v: why_claim(v, claim))
        took = time.perf_counter() - start
        print(f"why of a claim with a backtracking pattern: {took * 1e3:.1f} ms")
        # judged against the node's devices (not turned away before the selector)
        assert not {r.code for r in reasons} & {"NoDeviceClass", "NotOurs", "NoDevices"}, reasons
        assert took < 1
    finally:
        feeder.stop()


@pytest.fixture
def webhook(sandbox: ControlPlane, kube: RawApi) -> Iterator[str]:
    """The controller's claim webhook in-process on 127.0.0.1 with its own CA, registered with
    the sandbox API server for one labelled namespace; yields that namespace."""
    now = dt.datetime.now(dt.UTC)
    ca, ca_key = certs.new_ca(now, dt.timedelta(hours=1))
    cert, key = certs.issue(ca, ca_key, ["127.0.0.1"], now, dt.timedelta(hours=1))
    serving = ServingCert(sandbox.run_dir / "hostile-webhook")
    serving.load(cert, key)
    validator = ClaimValidator(Classes())
    server = WebhookServer(("127.0.0.1", 0), serving, {"validate": ("claims", validator.review)})
    server.start()
    with temporary_namespace(kube, "admit") as ns:
        kube.patch(
            resource_path("v1", "namespaces", name=ns),
            {"metadata": {"labels": {"gpuslice-test/hostile": ns}}},
        )
        name = f"hostile-{ns}"
        path = resource_path("admissionregistration.k8s.io/v1", "validatingwebhookconfigurations")
        kube.create(
            path,
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": name},
                "webhooks": [
                    {
                        "name": "claims.gpu.gpuslice.dev",
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{server.port}/validate",
                            "caBundle": base64.b64encode(ca).decode(),
                        },
                        "rules": [
                            {
                                "apiGroups": ["resource.k8s.io"],
                                "apiVersions": ["*"],
                                "operations": ["CREATE"],
                                "resources": ["resourceclaims"],
                            }
                        ],
                        "namespaceSelector": {"matchLabels": {"gpuslice-test/hostile": ns}},
                        "failurePolicy": "Fail",
                        "sideEffects": "None",
                        "admissionReviewVersions": ["v1"],
                        "timeoutSeconds": 10,
                    }
                ],
            },
        )
        try:
            yield ns
        finally:
            kube.delete(f"{path}/{name}")
            server.stop()


def test_admission_denies_what_nothing_could_read(kube: RawApi, webhook: str) -> None:
    path = resource_path(GV, "resourceclaims", namespace=webhook)
    start = time.perf_counter()
    deep = claim_text("deep", deep_parameters()).encode()
    status, body = send(kube, "POST", path, deep, "application/json")
    took = time.perf_counter() - start
    print(f"a {DEPTH}-level claim denied in {took * 1e3:.0f} ms")
    assert status == 403, body[:500]
    message = json.loads(body)["message"]
    assert "cannot decode this ResourceClaim: JSON nested deeper than 200 levels" in message
    params = '{"apiVersion":"gpu.gpuslice.dev/v1alpha1","kind":"GpuConfig",' + (
        '"limits":{"memory":"1e300000000"}}'
    )
    status, body = send(kube, "POST", path, claim_text("huge", params).encode(), "application/json")
    assert status == 403, body[:500]
    assert "limits.memory: '1e300000000' is not allowed (out of range" in body
    good = claim_text("good", '{"apiVersion":"gpu.gpuslice.dev/v1alpha1","kind":"GpuConfig"}')
    kube.create(path, json.loads(good))  # admitted
