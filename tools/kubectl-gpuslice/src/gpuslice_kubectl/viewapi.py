"""Reading the view from the aggregated API ``view.gpuslice.dev/v1alpha1`` (docs/view-api.md).

Where the controller serves it, ``top gpus`` and ``describe gpu`` read ``gpus``, ``claims``
reads ``gpuclaims`` (in the namespace, or in all with ``-A``) and ``why pod/<name>`` gets the
pod's ``gpureasons`` object, as any client reads a resource: a GET on the API server with the
user's own kubeconfig credentials, which the API server checks and keeps (no token is sent on
to the controller, and client certificates work too). The rows are those the controller
computes, with live usage; the plugin prints its own tables from them (``report``).

Whether it is served is asked of discovery (``/apis/view.gpuslice.dev/v1alpha1``): 404 when no
APIService registers it (not installed: the next source, quietly), 503 while the APIService is
registered but not available (the next source, with a note that says so). A resource that
discovery does not list (an older controller serves ``gpus`` only) goes to the next source
quietly (``remote.NotServedError``). A 403 on the namespaced ``gpuclaims`` or ``gpureasons`` is
the answer, as ``kubectl get`` would print it: RBAC said no, and the next sources would only
resend the token to the controller to be told the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from gpuslice_core.errors import NotFoundError
from gpuslice_kube.errors import (
    KubeError,
    KubeForbiddenError,
    KubeInvalidError,
    KubeNotFoundError,
)
from gpuslice_kube.raw import RawApi
from gpuslice_kubectl.remote import NotInstalledError, NotServedError, UnavailableError
from gpuslice_view import namespaced, resource
from gpuslice_view.report import Row

VERSION_PATH = f"/apis/{resource.API_VERSION}"
COLLECTION = f"{VERSION_PATH}/{resource.RESOURCE}"


def path(resource_: str, namespace: str | None = None, name: str = "") -> str:
    """A resource's path: in ``namespace`` if given, and the object ``name`` if given."""
    where = f"/namespaces/{quote(namespace, safe='')}" if namespace else ""
    one = f"/{quote(name, safe='')}" if name else ""
    return f"{VERSION_PATH}{where}/{resource_}{one}"


class ViewApiSource:
    """The GPU commands' answers from ``gpus.view.gpuslice.dev``."""

    name = "view-api"

    def __init__(self, raw: RawApi) -> None:
        self.raw = raw
        self._resources: set[str] | None = None  # what discovery lists, once asked
        self._objects: dict[str, resource.Obj] = {}  # as last served, by name
        self._claims: dict[tuple[str, str], resource.Obj] = {}  # by (namespace, name)
        self._reasons: dict[tuple[str, str], resource.Obj] = {}

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

    def claims_served(self, rows: list[Row]) -> list[resource.Obj]:
        """The ``GPUClaim`` objects ``rows`` were read from (``served`` for claims)."""
        found = []
        for row in rows:
            obj = self._claims[(row["namespace"], row["name"])]
            kind = {"apiVersion": resource.API_VERSION, "kind": namespaced.CLAIM_KIND}
            found.append({**kind, **obj})
        return found

    def reason_served(self, namespace: str, name: str) -> resource.Obj:
        """The ``GPUReason`` object ``why_pod(namespace, name)`` was read from."""
        return self._reasons[(namespace, name)]

    def _call(self, fn: Callable[[], Any], what: str = resource.RESOURCE) -> Any:
        if self._resources is None:
            try:
                found = self.raw.get(VERSION_PATH)
            except KubeNotFoundError as exc:
                raise NotInstalledError(f"the API server serves no {resource.API_VERSION}") from exc
            except KubeError as exc:
                raise UnavailableError(f"the view API {resource.API_VERSION}: {exc}") from exc
            self._resources = {str(r.get("name")) for r in found.get("resources") or []}
        if what not in self._resources:
            raise NotServedError(f"the view API serves no {what} (an older controller)")
        try:
            return fn()
        except (KubeNotFoundError, KubeInvalidError):  # no such object; a bad selector
            raise
        except KubeForbiddenError as exc:
            if what == resource.RESOURCE:  # (cluster-scoped: the next source may do)
                raise UnavailableError(f"the view API {resource.API_VERSION}: {exc}") from exc
            raise  # RBAC's answer for this namespace
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
        """The claims in ``namespace`` (None: in every namespace)."""
        where = path(namespaced.CLAIMS, namespace)
        listed = self._call(lambda: self.raw.list(where), namespaced.CLAIMS)
        rows = []
        for obj in listed["items"]:
            meta = obj["metadata"]
            self._claims[(meta["namespace"], meta["name"])] = obj
            rows.append(namespaced.claim_row_of(obj))
        return rows

    def why_claim(self, namespace: str, name: str) -> tuple[Row, resource.Obj] | None:
        """``why claim/<name>``'s answer and the ``GPUClaim`` it came from (a get of one
        carries ``status.reasons``), or None for no such claim of ours (404)."""
        where = path(namespaced.CLAIMS, namespace, name)
        try:
            obj = self._call(lambda: self.raw.get(where), namespaced.CLAIMS)
        except KubeNotFoundError:
            return None
        reasons = (obj.get("status") or {}).get("reasons")
        if reasons is None:
            raise NotServedError("the view API's GPUClaims carry no reasons (an older controller)")
        kind = {"apiVersion": resource.API_VERSION, "kind": namespaced.CLAIM_KIND}
        return {"claim": f"{namespace}/{name}", "reasons": list(reasons)}, {**kind, **obj}

    def why_pod(self, namespace: str, name: str) -> Row | None:
        """``why pod/<name>``'s answer, or None for a pod without GPU claims (404)."""
        where = path(namespaced.REASONS, namespace, name)
        try:
            obj = self._call(lambda: self.raw.get(where), namespaced.REASONS)
        except KubeNotFoundError:
            return None
        self._reasons[(namespace, name)] = obj
        return namespaced.why_of(obj)
