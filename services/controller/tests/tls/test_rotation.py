"""The leader's certificate pass against an in-memory API, and when a webhook configuration's
change wakes it (``BundleWatch``): one that appears or loses its bundle does, one that already
has it or is deleted does not. The watch itself runs against the real API server in
e2e/tests/controller/test_controller_rbac.py."""

from __future__ import annotations

import base64
import copy
import threading
from typing import cast

import pytest

from gpuslice_controller.tls import certs, rotation
from gpuslice_kube.errors import ConflictError, KubeAlreadyExistsError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi

pytestmark = pytest.mark.timeout(10)

NS, SECRET, NAME = "gpuslice", "ctl-tls", "ctl"
WEBHOOKS = rotation.WebhookConfigs((NAME,), (NAME,))
VALIDATING, MUTATING = WEBHOOKS.paths()


class MemoryApi:
    """get, create and replace with resourceVersion compare-and-swap: what ``Rotator`` calls."""

    def __init__(self) -> None:
        self.objects: dict[str, Obj] = {}
        self.version = 0
        self.writes: list[str] = []

    def put(self, path: str, obj: Obj) -> Obj:
        self.version += 1
        stored = copy.deepcopy(obj)
        stored.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.objects[path] = stored
        self.writes.append(path)
        return copy.deepcopy(stored)

    def get(self, path: str) -> Obj:
        if path not in self.objects:
            raise KubeNotFoundError(path)
        return copy.deepcopy(self.objects[path])

    def create(self, collection: str, obj: Obj) -> Obj:
        path = f"{collection}/{obj['metadata']['name']}"
        if path in self.objects:
            raise KubeAlreadyExistsError(path)
        return self.put(path, obj)

    def replace(self, path: str, obj: Obj) -> Obj:
        have = self.objects.get(path)
        if have is None:
            raise KubeNotFoundError(path)
        if obj["metadata"].get("resourceVersion") != have["metadata"]["resourceVersion"]:
            raise ConflictError(path)
        return self.put(path, obj)


def config(kind: str, bundle: str | None = None) -> Obj:
    hook: Obj = {"name": "x.gpuslice.dev", "clientConfig": {"url": "https://127.0.0.1:9443"}}
    if bundle is not None:
        hook["clientConfig"]["caBundle"] = bundle
    return {"kind": kind, "metadata": {"name": NAME}, "webhooks": [hook, copy.deepcopy(hook)]}


def rotator(api: MemoryApi) -> rotation.Rotator:
    return rotation.Rotator(
        cast(RawApi, api),
        namespace=NS,
        secret=SECRET,
        webhooks=WEBHOOKS,
        policy=certs.Policy(("127.0.0.1",)),
        publish_grace=0,
    )


def test_a_pass_publishes_to_the_configurations_that_exist() -> None:
    api = MemoryApi()
    api.put(VALIDATING, config("ValidatingWebhookConfiguration"))
    rot = rotator(api)
    outcome = rot.reconcile()
    assert "no certificate yet" in outcome and f"published the CA bundle to {NAME}" in outcome
    secret = api.get(rotation.secret_path(NS, SECRET))
    ca = base64.b64decode(secret["data"][certs.CA_CERT])
    assert rot.bundle == base64.b64encode(ca).decode()
    assert rotation.bundle_of(api.get(VALIDATING)) == {rot.bundle}
    # The mutating configuration does not exist yet: nothing to publish to, and no error.
    writes = len(api.writes)
    assert rot.reconcile() == "up to date" and len(api.writes) == writes
    # It appears (after the controller started): the next pass publishes to it alone.
    api.put(MUTATING, config("MutatingWebhookConfiguration"))
    writes = len(api.writes)
    assert rot.reconcile() == f"published the CA bundle to {NAME}"
    assert api.writes[writes:] == [MUTATING]
    assert rotation.bundle_of(api.get(MUTATING)) == {rot.bundle}


def test_a_configuration_that_appears_or_loses_the_bundle_wakes_the_pass() -> None:
    wake = threading.Event()
    wanted: list[str | None] = [None]
    watch = rotation.BundleWatch(cast(RawApi, MemoryApi()), WEBHOOKS, lambda: wanted[0], wake)
    assert [r.field_selector for r in watch.reflectors] == [f"metadata.name={NAME}"] * 2
    assert [r.path for r in watch.reflectors] == [p.rsplit("/", 1)[0] for p in WEBHOOKS.paths()]

    def woken(event: str, obj: Obj) -> bool:
        wake.clear()
        watch.on_event(event, obj)
        return wake.is_set()

    # Before the first pass every configuration wakes it (it cannot know the bundle yet).
    assert woken("ADDED", config("ValidatingWebhookConfiguration", "b64"))
    wanted[0] = "b64"
    assert not woken("ADDED", config("ValidatingWebhookConfiguration", "b64"))
    assert woken("ADDED", config("MutatingWebhookConfiguration"))  # created without one
    stripped = config("MutatingWebhookConfiguration", "b64")
    del stripped["webhooks"][1]["clientConfig"]["caBundle"]  # one webhook re-applied without
    assert woken("MODIFIED", stripped)
    assert woken("MODIFIED", config("MutatingWebhookConfiguration", "another CA"))
    assert not woken("MODIFIED", config("MutatingWebhookConfiguration", "b64"))
    assert not woken("DELETED", config("MutatingWebhookConfiguration"))


def test_an_apiservice_gets_the_bundle_in_its_spec() -> None:
    """The aggregated API's APIService (``--apiservices``) is kept like a webhook configuration:
    its ``spec.caBundle``, written with the rest of its spec left as it was."""
    api = MemoryApi()
    path = f"{rotation.APIREGISTRATION}/apiservices/v1alpha1.view.gpuslice.dev"
    spec = {"group": "view.gpuslice.dev", "version": "v1alpha1", "service": {"name": NAME}}
    api.put(path, {"metadata": {"name": "v1alpha1.view.gpuslice.dev"}, "spec": spec})
    rot = rotation.Rotator(
        cast(RawApi, api),
        namespace=NS,
        secret=SECRET,
        webhooks=rotation.WebhookConfigs(apiservices=("v1alpha1.view.gpuslice.dev",)),
        policy=certs.Policy(("127.0.0.1",)),
        publish_grace=0,
    )
    assert "published the CA bundle to v1alpha1.view.gpuslice.dev" in rot.reconcile()
    stored = api.get(path)
    assert stored["spec"] == {**spec, "caBundle": rot.bundle}
    assert rotation.bundle_of(stored) == {rot.bundle}
    assert rot.reconcile() == "up to date"
