"""The view as an aggregated API: ``view.gpuslice.dev/v1alpha1`` behind the API server.

The API server's aggregator (an APIService naming this controller's Service) authenticates the
user, checks RBAC on the resource in ``view.gpuslice.dev``, and proxies the request here with
its front-proxy client certificate and the user in headers (``frontproxy``). So ``kubectl get
gpus``, ``kubectl get gpuclaims -n ml``, ``-o wide``, ``-l``, ``-w`` and ``describe`` work, RBAC
grants the view on real resources, and no user's token ever leaves the API server
(docs/view-api.md).

Resources (``KINDS``; GET only, everything read-only):

- ``gpus`` (cluster-scoped; get, list, watch): one ``GPU`` per device;
- ``gpuclaims`` (namespaced; get, list, watch): one ``GPUClaim`` per claim on our devices or
  asking our classes, listed in a namespace or in all (``.../v1alpha1/gpuclaims``);
- ``gpureasons`` (namespaced; get only): ``GPUReason``, why a pod has no GPU, derived when
  asked (a list or watch is 405).

Paths: discovery, ``/apis`` (APIGroupList), ``/apis/view.gpuslice.dev`` (APIGroup),
``/apis/view.gpuslice.dev/v1alpha1`` (APIResourceList); ``/openapi/...`` is 404 (kubectl needs
it only for ``explain``); ``.../v1alpha1/<resource>[/<name>]`` and
``.../v1alpha1/namespaces/<ns>/<resource>[/<name>]``. A list takes ``labelSelector`` and
``fieldSelector`` (``metadata.name``, ``metadata.namespace``); ``watch=true`` makes it a watch
(``resourceVersion``, ``timeoutSeconds``).

A list or get whose Accept asks for ``as=Table;g=meta.k8s.io`` (what kubectl's printing asks)
gets a ``meta.k8s.io/v1`` Table with the columns of the matching ``kubectl gpuslice`` command
(priority 1 ones only with ``-o wide``), and so does each event of such a watch.

Every request needs a user from the aggregator (401 otherwise, whatever its headers say). The
discovery documents are answered to any such user; the resources after a SubjectAccessReview
of the verb (get, list, watch) on the resource, with the namespace and name of the request as
the API server checked them (403 otherwise; cached as ``auth`` caches token reviews), so a grant
that the API server checked is checked again here, as every aggregated API server does. Until
the view has synced: 503. Errors are ``v1`` Status objects with the reason kubectl prints.

Watches are bounded: at most ``max_watches`` at once (429 beyond), each for ``timeoutSeconds``
or at most ``max_watch_s``; one from another replica's version catches up with the current state
of what changed around it (``gpustore``); one whose changes are no longer kept gets an
``ERROR`` event with 410 Expired, and lists again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from email.message import Message
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from gpuslice_controller.view.api import JSON, Answer
from gpuslice_controller.view.auth import Authorizer
from gpuslice_controller.view.frontproxy import RequestHeaderConfig, User, proxied_user
from gpuslice_controller.view.gpustore import Change, GpuStore
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_core.logging import get_logger
from gpuslice_view import namespaced, report, resource
from gpuslice_view.model import ClusterView
from gpuslice_view.reasons import why_claim
from gpuslice_view.resource import Columns
from gpuslice_view.selectors import field_selector, label_selector

log = get_logger(__name__)

Obj = dict[str, Any]
GROUP_PATH = f"/apis/{resource.GROUP}"
VERSION_PATH = f"{GROUP_PATH}/{resource.VERSION}"
COLLECTION = f"{VERSION_PATH}/{resource.RESOURCE}"
IDLE_TICK_S = 1.0
"""How often a quiet watch hands control back to the server, which checks the client is still
there (a watch whose client left frees its place within this)."""

_REASONS = {
    HTTPStatus.BAD_REQUEST: "BadRequest",
    HTTPStatus.UNAUTHORIZED: "Unauthorized",
    HTTPStatus.FORBIDDEN: "Forbidden",
    HTTPStatus.NOT_FOUND: "NotFound",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowed",
    HTTPStatus.GONE: "Expired",
    HTTPStatus.TOO_MANY_REQUESTS: "TooManyRequests",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailable",
}


@dataclass(frozen=True)
class Kind:
    """One resource of the group: its names, scope, verbs and table."""

    resource: str
    singular: str
    kind: str
    list_kind: str
    namespaced: bool
    verbs: tuple[str, ...]
    columns: Columns
    cells: Callable[[Obj], list[Any]]

    def discovery(self) -> Obj:
        return {
            "name": self.resource,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(self.verbs),
        }


GPUS = Kind(
    resource.RESOURCE,
    resource.SINGULAR,
    resource.KIND,
    resource.LIST_KIND,
    False,
    ("get", "list", "watch"),
    resource.COLUMNS,
    resource.cells,
)
CLAIMS = Kind(
    namespaced.CLAIMS,
    namespaced.CLAIM_SINGULAR,
    namespaced.CLAIM_KIND,
    namespaced.CLAIM_LIST_KIND,
    True,
    ("get", "list", "watch"),
    namespaced.CLAIM_COLUMNS,
    namespaced.claim_cells,
)
REASONS = Kind(
    namespaced.REASONS,
    namespaced.REASON_SINGULAR,
    namespaced.REASON_KIND,
    "",
    True,
    ("get",),
    namespaced.REASON_COLUMNS,
    namespaced.reason_cells,
)
KINDS = {k.resource: k for k in (GPUS, CLAIMS, REASONS)}


@dataclass(frozen=True)
class Stream:
    """A streamed answer: ``chunks`` are written as they come (``b""`` is an idle tick);
    ``release`` is called once when the stream ends, however it ends."""

    status: HTTPStatus
    chunks: Iterator[bytes]
    release: Callable[[], None]
    content_type: str = JSON


def status(code: HTTPStatus, message: str, name: str = "", kind: Kind = GPUS) -> Obj:
    out: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASONS.get(code, "InternalError"),
        "code": int(code),
    }
    if name:
        out["details"] = {"name": name, "group": resource.GROUP, "kind": kind.resource}
    return out


def _answer(code: HTTPStatus, body: Obj) -> Answer:
    return Answer(code, json.dumps(body).encode() + b"\n")


def _failure(code: HTTPStatus, message: str, name: str = "", kind: Kind = GPUS) -> Answer:
    return _answer(code, status(code, message, name, kind))


def handles(path: str) -> bool:
    return path == "/apis" or path.startswith(("/apis/", "/openapi/"))


def _group() -> Obj:
    version = {"groupVersion": resource.API_VERSION, "version": resource.VERSION}
    return {"name": resource.GROUP, "versions": [version], "preferredVersion": version}


def discovery(path: str) -> Obj | None:
    if path == "/apis":
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group()]}
    if path == GROUP_PATH:
        return {"kind": "APIGroup", "apiVersion": "v1", **_group()}
    if path == VERSION_PATH:
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": resource.API_VERSION,
            "resources": [k.discovery() for k in KINDS.values()],
        }
    return None


def wants_table(accept: str) -> bool:
    """Whether the client asks for a meta.k8s.io Table (kubectl's server-side printing)."""
    for media in accept.split(","):
        params = {p.strip() for p in media.split(";")[1:]}
        if "as=Table" in params and "g=meta.k8s.io" in params:
            return True
    return False


def _row_object(obj: Obj, include: str) -> Obj | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    meta = "meta.k8s.io/v1"
    return {"kind": "PartialObjectMetadata", "apiVersion": meta, "metadata": obj["metadata"]}


def table(
    objs: Sequence[Obj], version: str, include: str, *, kind: Kind = GPUS, columns: bool = True
) -> Obj:
    rows = []
    for obj in objs:
        row: Obj = {"cells": kind.cells(obj)}
        embedded = _row_object(obj, include)
        if embedded is not None:
            row["object"] = embedded
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": version} if version else {},
        "columnDefinitions": resource.column_definitions(kind.columns) if columns else [],
        "rows": rows,
    }


@dataclass(frozen=True)
class Target:
    """What a request path names: a resource, in a namespace or not, one object or all."""

    kind: Kind
    namespace: str
    name: str


def target(path: str) -> Target | None:
    """The resource a path under the version names, or None (404)."""
    if not path.startswith(VERSION_PATH + "/"):
        return None
    parts = [unquote(p) for p in path[len(VERSION_PATH) + 1 :].split("/")]
    namespace = ""
    if parts[0] == "namespaces":
        if len(parts) < 3 or not parts[1]:
            return None
        namespace, parts = parts[1], parts[2:]
    kind = KINDS.get(parts[0])
    if kind is None or len(parts) > 2 or not all(parts):
        return None
    if namespace and not kind.namespaced:
        return None
    name = parts[1] if len(parts) == 2 else ""
    if name and kind.namespaced and not namespace:
        return None  # a namespaced object is named in its namespace
    return Target(kind, namespace, name)


class AggregatedApi:
    def __init__(
        self,
        store: GpuStore,
        authorizer: Authorizer,
        config: Callable[[], RequestHeaderConfig | None],
        synced: threading.Event,
        *,
        claims: GpuStore | None = None,
        max_watches: int = 16,
        max_watch_s: float = 1800.0,
    ) -> None:
        """``store`` keeps the GPUs; ``claims`` the GPU claims (by default a store of the same
        view, which then needs its own ``run`` and ``mark``s to refresh between requests)."""
        self.store = store
        self.claims = claims or GpuStore(store.source, derive=namespaced.claim_objects)
        self.authorizer = authorizer
        self.config = config
        self.synced = synced
        self.max_watch_s = max_watch_s
        self._watches = threading.BoundedSemaphore(max_watches)
        self.max_watches = max_watches

    def stores(self) -> dict[str, GpuStore]:
        return {GPUS.resource: self.store, CLAIMS.resource: self.claims}

    def get(
        self, target_: str, headers: Message, peercert: dict[str, Any] | None
    ) -> Answer | Stream:
        """Answer ``GET target_`` on a connection whose verified client certificate (if any) is
        ``peercert``."""
        user = proxied_user(self.config(), peercert, headers)
        if user is None:
            return _failure(
                HTTPStatus.UNAUTHORIZED,
                "Unauthorized: this API is served to the API server's front proxy only "
                f"(kubectl get {resource.RESOURCE}.{resource.GROUP})",
            )
        url = urlsplit(target_)
        path = url.path.rstrip("/") or "/"
        found = discovery(path)
        if found is not None:
            return _answer(HTTPStatus.OK, found)
        if path.startswith("/openapi/"):
            return _failure(HTTPStatus.NOT_FOUND, "no OpenAPI document is served")
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        accept = headers.get("Accept") or ""
        where = target(path)
        if where is None:
            return _failure(
                HTTPStatus.NOT_FOUND, f"the server could not find the requested path {path}"
            )
        watching = query.get("watch") in ("true", "1")
        verb = "get" if where.name else "watch" if watching else "list"
        if verb not in where.kind.verbs:
            return _failure(
                HTTPStatus.METHOD_NOT_ALLOWED,
                f"the server does not allow this method on the requested resource "
                f"({where.kind.resource} answer {', '.join(where.kind.verbs)} only)",
                kind=where.kind,
            )

        def then() -> Answer | Stream:
            if where.kind is REASONS:
                return self._reason(where, query, accept)
            if where.name:
                return self._one(where, query, accept)
            return self._collection(where, verb, query, accept)

        return self._authorized(user, verb, where, then)

    def _authorized(
        self, user: User, verb: str, where: Target, then: Callable[[], Answer | Stream]
    ) -> Answer | Stream:
        decision = self.authorizer.check_user(
            user.as_obj(),
            group=resource.GROUP,
            verb=verb,
            resource=where.kind.resource,
            namespace=where.namespace,
            name=where.name,
        )
        if not decision.allowed:
            return _failure(decision.status, decision.message, where.name, where.kind)
        if not self.synced.is_set():
            return _failure(HTTPStatus.SERVICE_UNAVAILABLE, "the cluster view has not synced yet")
        log.debug(
            "aggregated api request",
            verb=verb,
            resource=where.kind.resource,
            namespace=where.namespace,
            user=user.name,
        )
        return then()

    @staticmethod
    def _not_found(where: Target) -> Answer:
        message = f'{where.kind.resource}.{resource.GROUP} "{where.name}" not found'
        return _failure(HTTPStatus.NOT_FOUND, message, where.name, where.kind)

    def _one(self, where: Target, query: dict[str, str], accept: str) -> Answer:
        store = self.stores()[where.kind.resource]
        store.current()
        version, objs = store.snapshot()
        found = [
            o
            for o in objs
            if o["metadata"]["name"] == where.name
            and o["metadata"].get("namespace", "") == where.namespace
        ]
        if not found:
            return self._not_found(where)
        if wants_table(accept):
            include = query.get("includeObject", "Metadata")
            return _answer(HTTPStatus.OK, table(found, str(version), include, kind=where.kind))
        if where.kind is CLAIMS:
            return _answer(HTTPStatus.OK, self._with_reasons(found[0]))
        return _answer(HTTPStatus.OK, found[0])

    def _with_reasons(self, obj: Obj) -> Obj:
        """A ``GPUClaim`` as a get returns it: with ``status.reasons``, why it has no devices
        (or where it has them), judged now against the whole view. Lists and watches leave them
        out: judging every pending claim on every change would cost a pass over the cluster's
        devices per claim."""
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])

        def judged(view: ClusterView) -> list[Obj] | None:
            claim = view.claims.get(key)
            return None if claim is None else [r.to_dict() for r in why_claim(view, claim)]

        reasons = self.store.source.read(judged)
        if reasons is None:  # gone since the snapshot
            return obj
        return {**obj, "status": {**obj["status"], "reasons": reasons}}

    def _reason(self, where: Target, query: dict[str, str], accept: str) -> Answer:
        """A pod's ``GPUReason``, derived now (no store: nothing lists or watches them)."""
        found = self.store.source.read(lambda v: report.why_row(v, where.namespace, where.name))
        if found is None:
            return self._not_found(where)
        obj = namespaced.reason_object(where.namespace, where.name, found)
        if wants_table(accept):
            include = query.get("includeObject", "Metadata")
            return _answer(HTTPStatus.OK, table([obj], "", include, kind=REASONS))
        return _answer(HTTPStatus.OK, obj)

    def _collection(
        self, where: Target, verb: str, query: dict[str, str], accept: str
    ) -> Answer | Stream:
        kind = where.kind
        store = self.stores()[kind.resource]
        try:
            labels = label_selector(query.get("labelSelector"))
            fields = field_selector(query.get("fieldSelector"))
            timeout = float(query.get("timeoutSeconds") or self.max_watch_s)
        except InvalidArgumentError as exc:
            return _failure(HTTPStatus.BAD_REQUEST, str(exc))
        except ValueError:
            return _failure(HTTPStatus.BAD_REQUEST, "timeoutSeconds must be a number of seconds")

        def selected(obj: Obj | None) -> bool:
            if obj is None:
                return False
            meta = obj["metadata"]
            if where.namespace and meta.get("namespace") != where.namespace:
                return False
            return labels(meta.get("labels") or {}) and fields(obj)

        include = query.get("includeObject", "Metadata")
        as_table = wants_table(accept)
        if verb == "list":
            store.current()
            version, objs = store.snapshot()
            objs = [o for o in objs if selected(o)]
            if as_table:
                return _answer(HTTPStatus.OK, table(objs, str(version), include, kind=kind))
            return _answer(
                HTTPStatus.OK,
                {
                    "kind": kind.list_kind,
                    "apiVersion": resource.API_VERSION,
                    "metadata": {"resourceVersion": str(version)},
                    "items": objs,
                },
            )
        if not self._watches.acquire(blocking=False):
            return _failure(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"too many watches of the view (at most {self.max_watches}); retry",
            )
        deadline = time.monotonic() + max(0.0, min(timeout, self.max_watch_s))
        start = query.get("resourceVersion") or ""
        printer = Printer(kind, as_table, include)
        events = self._watch(store, start, selected, deadline, printer)
        return Stream(HTTPStatus.OK, events, self._watches.release)

    def _watch(
        self,
        store: GpuStore,
        start: str,
        selected: Callable[[Obj | None], bool],
        deadline: float,
        printer: Printer,
    ) -> Iterator[bytes]:
        """The watch's events, one JSON line each."""
        line = printer.line
        if start in ("", "0"):  # the current state first, as synthetic ADDED events
            store.current()
            version, objs = store.snapshot()
            for obj in objs:
                if selected(obj):
                    yield line("ADDED", obj)
        elif start.isdigit():
            version = int(start)
        else:
            yield self._expired(start)
            return
        if start not in ("", "0") and not store.ours(version):
            # Another replica's version: the current state of what changed around it, then on
            # from this store's version before that (a change in between may come twice, never
            # older than what was sent before it).
            current = store.version
            caught_up = store.changes_since(version, foreign=True)
            if caught_up is None:
                yield self._expired(start)
                return
            for change in caught_up:
                kind = _seen_as(change, selected)
                if kind:
                    yield line(kind, change.obj)
            version = current
        while (left := deadline - time.monotonic()) > 0:
            changes = store.changes_since(version)
            if changes is None:
                yield self._expired(str(version))
                return
            for change in changes:
                kind = _seen_as(change, selected)
                if kind:
                    yield line(kind, change.obj)
                version = change.version
            if not changes:
                store.wait(version, min(left, IDLE_TICK_S))
                yield b""

    @staticmethod
    def _expired(version: str) -> bytes:
        message = f"too old resource version: {version} (the view keeps recent changes only)"
        event = {"type": "ERROR", "object": status(HTTPStatus.GONE, message)}
        return json.dumps(event).encode() + b"\n"


class Printer:
    """A watch's events as JSON lines: objects, or one-row Tables (the columns in the first)."""

    def __init__(self, kind: Kind, as_table: bool, include: str) -> None:
        self.kind = kind
        self.as_table = as_table
        self.include = include
        self.first = True

    def line(self, event: str, obj: Obj) -> bytes:
        if self.as_table:
            version = obj["metadata"]["resourceVersion"]
            obj = table([obj], version, self.include, kind=self.kind, columns=self.first)
            self.first = False
        return json.dumps({"type": event, "object": obj}).encode() + b"\n"


def _seen_as(change: Change, selected: Callable[[Obj | None], bool]) -> str:
    """How a watch with a selection sees a change: moving into it is ADDED, out of it DELETED,
    and a change outside it is not seen ("")."""
    now = change.type != "DELETED" and selected(change.obj)
    before = change.type != "ADDED" and selected(change.before)
    if now and before:
        return change.type
    if now:
        return "ADDED"
    if before:
        return "DELETED"
    return ""
