"""The view from the aggregated API view.gpuslice.dev: found by discovery (404: not installed,
quietly the next source; 503: the next source with a note), GPU rows rebuilt from the objects,
references resolved to object names, claims from gpuclaims and why from gpureasons (a 403 in a
namespace is the answer), and what an older controller does not serve left to the next
source."""

from __future__ import annotations

from typing import Any, cast

import pytest

from gpuslice_core.errors import FailedPreconditionError, NotFoundError
from gpuslice_kube.errors import KubeForbiddenError, KubeNotFoundError, KubeTransientError
from gpuslice_kube.raw import RawApi
from gpuslice_kubectl.remote import Chooser
from gpuslice_kubectl.viewapi import COLLECTION, VERSION_PATH, ViewApiSource
from gpuslice_testkit import view as t
from gpuslice_view import namespaced, report, resource
from gpuslice_view.model import ClusterView

pytestmark = pytest.mark.timeout(10)


def objects() -> list[dict[str, Any]]:
    view = ClusterView.build(
        slices=[t.resource_slice("node-a", [t.gpu(0), t.mig(2, "1g.10gb", 0, 9856)])],
        claims=[t.claim("ml", "a", results=[t.result("node-a", "gpu-0", cores="30")])],
    )
    return [resource.gpu_object(row) for row in report.gpu_rows(view)]


class Api:
    """The view API as the API server answers it (``down``: registered, not available)."""

    def __init__(self, *, installed: bool = True, down: bool = False) -> None:
        self.installed, self.down = installed, down
        self.objs = {o["metadata"]["name"]: o for o in objects()}
        self.calls: list[str] = []

    def get(self, path: str) -> dict[str, Any]:
        self.calls.append(path)
        if not self.installed:
            raise KubeNotFoundError(path)
        if self.down:
            raise KubeTransientError("503: service unavailable")
        if path == VERSION_PATH:
            return {"resources": [{"name": "gpus"}]}
        name = path.removeprefix(COLLECTION + "/")
        if name not in self.objs:
            raise KubeNotFoundError(path)
        return self.objs[name]

    def list(self, path: str, label_selector: str | None = None) -> dict[str, Any]:
        assert path == COLLECTION
        self.calls.append(path)
        return {"items": list(self.objs.values())}


def source(api: Api) -> ViewApiSource:
    return ViewApiSource(cast(RawApi, api))


def test_rows_and_references() -> None:
    gpus = source(Api())
    rows = gpus.gpu_rows()
    assert [r["ref"] for r in rows] == ["node-a/0", "node-a/gpu-2-mig-1g-10gb-0"]
    assert rows[0]["cores"] == {"total": 100, "used": 30}
    assert gpus.gpu_row("node-a/0")["device"] == "gpu-0"
    assert gpus.gpu_row("node-a/gpu-2-mig-1g-10gb-0")["type"] == "mig"
    assert gpus.gpu_row("node-a.gpu-0")["uuid"] == "GPU-00000000-aaaa"
    assert gpus.gpu_row("gpu-00000000-AAAA")["device"] == "gpu-0"
    with pytest.raises(NotFoundError, match=r"node-a\.gpu-7"):
        gpus.gpu_row("node-a/7")
    with pytest.raises(NotFoundError, match="give a UUID"):
        gpus.gpu_row("GPU-nope")


def test_auto_prefers_it_for_gpus_and_asks_the_next_source_for_claims() -> None:
    notes: list[str] = []
    api_listing = source(Api(installed=False))  # (never asked here)
    chooser = Chooser("auto", api_listing, lambda: api_listing, notes.append, source(Api()))
    assert len(chooser.read(lambda s: s.gpu_rows())) == 2
    assert chooser.read(lambda s: s.name) == "view-api"

    class Next:
        name = "controller"

        def claim_rows(self, namespace: str | None) -> list[Any]:
            return [{"from": "controller"}]

    chooser = Chooser("auto", api_listing, lambda: Next(), notes.append, source(Api()))  # type: ignore[arg-type, return-value]
    assert chooser.read(lambda s: s.claim_rows(None)) == [{"from": "controller"}]
    assert notes == []


def test_not_installed_is_quiet_and_unavailable_says_so() -> None:
    class Next:
        name = "controller"

        def gpu_rows(self) -> list[Any]:
            return [{"from": "controller"}]

    for installed, down, said in (
        (False, False, []),
        (True, True, ["not reading from the view API"]),
    ):
        notes: list[str] = []
        view_api = source(Api(installed=installed, down=down))
        chooser = Chooser("auto", view_api, lambda: Next(), notes.append, view_api)  # type: ignore[arg-type, return-value]
        assert chooser.read(lambda s: s.gpu_rows()) == [{"from": "controller"}]
        assert [n.split(":")[0] for n in notes] == said
    strict = Chooser("view-api", view_api, lambda: Next(), notes.append, source(Api(down=True)))  # type: ignore[arg-type, return-value]
    with pytest.raises(FailedPreconditionError, match="503"):
        strict.read(lambda s: s.gpu_rows())


# --- claims and why from gpuclaims and gpureasons ---------------------------------------------


def claims_view() -> ClusterView:
    return ClusterView.build(
        slices=[t.resource_slice("node-a", [t.gpu(0)])],
        claims=[
            t.claim("ml", "a", results=[t.result("node-a", "gpu-0", cores="30")], pods=("p",)),
            t.claim("ml", "pending", cores="30"),
            t.claim("web", "w", cores="10"),
        ],
        pods=[t.pod("ml", "waiting", claim="pending")],
        classes=t.CLASSES,
    )


class NamespacedApi:
    """gpuclaims and gpureasons as the API server answers them; ``forbidden``: namespaces RBAC
    refuses; ``older``: a controller whose discovery lists gpus only."""

    def __init__(self, *, forbidden: tuple[str, ...] = (), older: bool = False) -> None:
        view = claims_view()
        self.claims = namespaced.claim_objects(view)
        self.view, self.forbidden, self.older = view, forbidden, older
        self.calls: list[str] = []

    def _check(self, path: str) -> None:
        self.calls.append(path)
        for namespace in self.forbidden:
            if f"/namespaces/{namespace}/" in path:
                raise KubeForbiddenError(f'gpuclaims.view.gpuslice.dev is forbidden: "{namespace}"')

    def get(self, path: str) -> dict[str, Any]:
        self._check(path)
        if path == VERSION_PATH:
            names = ["gpus"] if self.older else ["gpus", "gpuclaims", "gpureasons"]
            return {"resources": [{"name": n} for n in names]}
        namespace, name = path.split("/")[-3], path.split("/")[-1]
        found = report.why_row(self.view, namespace, name)
        if found is None:
            raise KubeNotFoundError(path)
        return namespaced.reason_object(namespace, name, found)

    def list(self, path: str, label_selector: str | None = None) -> dict[str, Any]:
        self._check(path)
        if path == f"{VERSION_PATH}/gpuclaims":
            return {"items": self.claims}
        namespace = path.split("/")[-2]
        return {"items": [o for o in self.claims if o["metadata"]["namespace"] == namespace]}


def test_claims_from_gpuclaims_in_a_namespace_or_all() -> None:
    api = NamespacedApi()
    claims = ViewApiSource(cast(RawApi, api))
    rows = claims.claim_rows("ml")
    assert api.calls[-1] == "/apis/view.gpuslice.dev/v1alpha1/namespaces/ml/gpuclaims"
    assert rows == report.claim_rows(claims_view(), "ml")  # the rows the other sources give
    assert [o["kind"] for o in claims.claims_served(rows)] == ["GPUClaim", "GPUClaim"]
    every = claims.claim_rows(None)
    assert api.calls[-1] == "/apis/view.gpuslice.dev/v1alpha1/gpuclaims"
    assert [(r["namespace"], r["name"]) for r in every] == [
        ("ml", "a"),
        ("ml", "pending"),
        ("web", "w"),
    ]
    assert api.calls.count(VERSION_PATH) == 1  # discovery asked once


def test_why_from_gpureasons_and_none_for_a_pod_without_claims() -> None:
    api = NamespacedApi()
    reasons = ViewApiSource(cast(RawApi, api))
    answer = reasons.why_pod("ml", "waiting")
    assert api.calls[-1] == "/apis/view.gpuslice.dev/v1alpha1/namespaces/ml/gpureasons/waiting"
    assert answer == report.why_row(claims_view(), "ml", "waiting")
    assert reasons.reason_served("ml", "waiting")["kind"] == "GPUReason"
    assert reasons.why_pod("ml", "nobody") is None


def test_forbidden_in_a_namespace_is_the_answer_not_a_fallback() -> None:
    notes: list[str] = []
    asked: list[str] = []

    class Next:
        name = "controller"

        def claim_rows(self, namespace: str | None) -> list[Any]:
            asked.append("controller")
            return []

    view_api = ViewApiSource(cast(RawApi, NamespacedApi(forbidden=("web",))))
    chooser = Chooser("auto", view_api, lambda: Next(), notes.append, view_api)  # type: ignore[arg-type, return-value]
    assert len(chooser.read(lambda s: s.claim_rows("ml"))) == 2
    with pytest.raises(KubeForbiddenError, match="forbidden"):
        chooser.read(lambda s: s.claim_rows("web"))
    assert asked == [] and notes == []  # no token sent on to the controller


def test_an_older_controller_serving_gpus_only_leaves_claims_to_the_next_source() -> None:
    class Next:
        name = "controller"

        def claim_rows(self, namespace: str | None) -> list[Any]:
            return [{"from": "controller"}]

    notes: list[str] = []
    api = NamespacedApi(older=True)
    view_api = ViewApiSource(cast(RawApi, api))
    chooser = Chooser("auto", view_api, lambda: Next(), notes.append, view_api)  # type: ignore[arg-type, return-value]
    assert chooser.read(lambda s: s.claim_rows("ml")) == [{"from": "controller"}]
    assert notes == [] and api.calls == [VERSION_PATH]
    chooser.read(lambda s: s.gpu_rows())
    assert api.calls[-1] == COLLECTION  # the view API still serves gpus
