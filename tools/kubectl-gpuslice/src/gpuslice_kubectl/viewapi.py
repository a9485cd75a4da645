"""Reading GPUs from the aggregated API ``gpus.view.gpuslice.dev`` (docs/view-api.md).

Where the controller serves it, ``top gpus`` and ``describe gpu`` read GPUs as any client reads
a resource: a GET on the API server with the user's own kubeconfig credentials, which the API
server checks and keeps (no token is sent on to the controller, and client certificates work
too). The rows are those the controller computes, with live usage; the plugin prints its own
tables from them (``report``). The API serves GPUs only: claims and ``why`` come from the next
source (``remote.Chooser``).

Whether it is served is asked of discovery (``/apis/view.gpuslice.dev/v1alpha1``): 404 when no
APIService registers it (not installed: the next source, quietly), 503 while the APIService is
registered but not available (the next source, with a note that says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuslice_core.errors import NotFoundError
from gpuslice_kube.errors import KubeError, KubeInvalidError, KubeNotFoundError
from gpuslice_kube.raw import RawApi
from gpuslice_kubectl.remote import NotInstalledError, NotServedError, UnavailableError
from gpuslice_view import resource
from gpuslice_view.report import Row

VERSION_PATH = f"/apis/{resource.API_VERSION}"
COLLECTION = f"{VERSION_PATH}/{resource.RESOURCE}"


class ViewApiSource:
    """The GPU commands' answers from ``gpus.view.gpuslice.dev``."""

    name = "view-api"

    def __init__(self, raw: RawApi) -> None:
        self.raw = raw
        self._served = False
        self._objects: dict[str, resource.Obj] = {}  # as last served, by name

    def served(self, rows: list[Row]) -> list[resource.Obj]:
        """The objects ``rows`` were read from, as the API server served them (a list's items
        given their ``apiVersion`` and ``kind``, which a list may leave out)."""
        found = []
        for row in rows:
            obj = self._objects[resource.object_name(row["node"], row["device"])]
            found.append({"apiVersion": resource.API_VERSION, "kind": resource.KIND, **obj})
        return found

    def _keep(self, obj: resource.Obj) -> Row:
        self._objects[obj["metadata"]["name"]] = obj
        return resource.row_of(obj)

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self._served:
            try:
                self.raw.get(VERSION_PATH)
            except KubeNotFoundError as exc:
                raise NotInstalledError(f"the API server serves no {resource.API_VERSION}") from exc
            except KubeError as exc:
                raise UnavailableError(f"the view API {resource.API_VERSION}: {exc}") from exc
            self._served = True
        try:
            return fn()
        except (KubeNotFoundError, KubeInvalidError):  # no such GPU; a bad selector
            raise
        except KubeError as exc:
            raise UnavailableError(f"the view API {resource.API_VERSION}: {exc}") from exc

    def gpu_rows(self, selector: str | None = None) -> list[Row]:
        listed = self._call(lambda: self.raw.list(COLLECTION, label_selector=selector or None))
        return [self._keep(obj) for obj in listed["items"]]

    def gpu_row(self, ref: str) -> Row:
        """``ref`` as the other sources take it (a UUID, ``<node>/<index>``,
        ``<node>/<device>``) or a GPU object's name."""
        wanted = ref.strip()
        node, slash, what = wanted.partition("/")
        if not slash:  # a UUID, or an object's name
            for row in self.gpu_rows():
                name = resource.object_name(row["node"], row["device"])
                if name == wanted or (row["uuid"] and row["uuid"].lower() == wanted.lower()):
                    return row
            raise NotFoundError(
                f"no GPU {ref!r}; give a UUID, <node>/<index>, <node>/<device> or a GPU's name "
                "(kubectl get gpus)"
            )
        device = f"gpu-{what}" if what.isdigit() else what
        try:
            obj = self._call(
                lambda: self.raw.get(f"{COLLECTION}/{resource.object_name(node, device)}")
            )
        except KubeNotFoundError as exc:
            raise NotFoundError(
                f"no GPU {ref!r} (no {resource.RESOURCE}.{resource.GROUP} "
                f"{resource.object_name(node, device)!r}); kubectl get gpus lists them"
            ) from exc
        return self._keep(obj)

    def claim_rows(self, namespace: str | None) -> list[Row]:
        raise NotServedError("the view API serves GPUs only")

    def why_pod(self, namespace: str, name: str) -> Row | None:
        raise NotServedError("the view API serves GPUs only")
