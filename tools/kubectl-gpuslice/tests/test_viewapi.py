"""GPUs from the aggregated API gpus.view.gpuslice.dev: found by discovery (404: not installed,
quietly the next source; 503: the next source with a note), rows rebuilt from the objects,
references resolved to object names, and what it does not serve left to the next source."""

from __future__ import annotations

from typing import Any, cast

import pytest

from gpuslice_core.errors import FailedPreconditionError, NotFoundError
from gpuslice_kube.errors import KubeNotFoundError, KubeTransientError
from gpuslice_kube.raw import RawApi
from gpuslice_kubectl.remote import Chooser
from gpuslice_kubectl.viewapi import COLLECTION, VERSION_PATH, ViewApiSource
from gpuslice_testkit import view as t
from gpuslice_view import report, resource
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
