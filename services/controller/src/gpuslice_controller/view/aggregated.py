"""The view as an aggregated API: ``gpus.view.gpuslice.dev/v1alpha1`` behind the API server.

The API server's aggregator (an APIService naming this controller's Service) authenticates the
user, checks RBAC on ``gpus`` in ``view.gpuslice.dev``, and proxies the request here with its
front-proxy client certificate and the user in headers (``frontproxy``). So ``kubectl get gpus``,
``-o wide``, ``-l``, ``-w`` and ``describe`` work, RBAC grants the view on a real resource, and
no user's token ever leaves the API server (docs/view-api.md).

Paths (GET only; everything read-only):

- discovery: ``/apis`` (APIGroupList), ``/apis/view.gpuslice.dev`` (APIGroup),
  ``/apis/view.gpuslice.dev/v1alpha1`` (APIResourceList); ``/openapi/...`` is 404 (kubectl
  needs it only for ``explain``);
- ``.../v1alpha1/gpus``: list (``labelSelector``, ``fieldSelector`` ``metadata.name``), or a
  watch with ``watch=true`` (``resourceVersion``, ``timeoutSeconds``);
- ``.../v1alpha1/gpus/<name>``: one GPU.

A list or get whose Accept asks for ``as=Table;g=meta.k8s.io`` (what kubectl's printing asks)
gets a ``meta.k8s.io/v1`` Table with the columns of ``kubectl gpuslice top gpus`` (priority 1
ones only with ``-o wide``), and so does each event of such a watch.

Every request needs a user from the aggregator (401 otherwise, whatever its headers say). The
discovery documents are answered to any such user; the GPUs after a SubjectAccessReview of the
verb (get, list, watch) on ``gpus.view.gpuslice.dev`` (403 otherwise; cached as ``auth`` caches
token reviews), so a grant that the API server checked is checked again here, as every
aggregated API server does. Until the view has synced: 503. Errors are ``v1`` Status objects
with the reason kubectl prints.

Watches are bounded: at most ``max_watches`` at once (429 beyond), each for ``timeoutSeconds``
or at most ``max_watch_s``; one from another replica's version catches up with the current state
of what changed around it (``gpustore``); one whose changes are no longer kept gets an
``ERROR`` event with 410 Expired, and lists again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
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
from gpuslice_view import resource
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
    HTTPStatus.GONE: "Expired",
    HTTPStatus.TOO_MANY_REQUESTS: "TooManyRequests",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailable",
}


@dataclass(frozen=True)
class Stream:
    """A streamed answer: ``chunks`` are written as they come (``b""`` is an idle tick);
    ``release`` is called once when the stream ends, however it ends."""

    status: HTTPStatus
    chunks: Iterator[bytes]
    release: Callable[[], None]
    content_type: str = JSON


def status(code: HTTPStatus, message: str, name: str = "") -> Obj:
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
        out["details"] = {"name": name, "group": resource.GROUP, "kind": resource.RESOURCE}
    return out


def _answer(code: HTTPStatus, body: Obj) -> Answer:
    return Answer(code, json.dumps(body).encode() + b"\n")


def _failure(code: HTTPStatus, message: str, name: str = "") -> Answer:
    return _answer(code, status(code, message, name))


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
        gpus = {
            "name": resource.RESOURCE,
            "singularName": resource.SINGULAR,
            "namespaced": False,
            "kind": resource.KIND,
            "verbs": ["get", "list", "watch"],
        }
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": resource.API_VERSION,
            "resources": [gpus],
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


def table(objs: list[Obj], version: int, include: str, *, columns: bool = True) -> Obj:
    rows = []
    for obj in objs:
        row: Obj = {"cells": resource.cells(obj)}
        embedded = _row_object(obj, include)
        if embedded is not None:
            row["object"] = embedded
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": str(version)},
        "columnDefinitions": resource.column_definitions() if columns else [],
        "rows": rows,
    }


class AggregatedApi:
    def __init__(
        self,
        store: GpuStore,
        authorizer: Authorizer,
        config: Callable[[], RequestHeaderConfig | None],
        synced: threading.Event,
        *,
        max_watches: int = 16,
        max_watch_s: float = 1800.0,
    ) -> None:
        self.store = store
        self.authorizer = authorizer
        self.config = config
        self.synced = synced
        self.max_watch_s = max_watch_s
        self._watches = threading.BoundedSemaphore(max_watches)
        self.max_watches = max_watches

    def get(
        self, target: str, headers: Message, peercert: dict[str, Any] | None
    ) -> Answer | Stream:
        """Answer ``GET target`` on a connection whose verified client certificate (if any) is
        ``peercert``."""
        user = proxied_user(self.config(), peercert, headers)
        if user is None:
            return _failure(
                HTTPStatus.UNAUTHORIZED,
                "Unauthorized: this API is served to the API server's front proxy only "
                f"(kubectl get {resource.RESOURCE}.{resource.GROUP})",
            )
        url = urlsplit(target)
        path = url.path.rstrip("/") or "/"
        found = discovery(path)
        if found is not None:
            return _answer(HTTPStatus.OK, found)
        if path.startswith("/openapi/"):
            return _failure(HTTPStatus.NOT_FOUND, "no OpenAPI document is served")
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        accept = headers.get("Accept") or ""
        if path == COLLECTION:
            verb = "watch" if query.get("watch") in ("true", "1") else "list"
            return self._authorized(user, verb, lambda: self._collection(verb, query, accept))
        if path.startswith(COLLECTION + "/") and "/" not in path[len(COLLECTION) + 1 :]:
            name = unquote(path[len(COLLECTION) + 1 :])
            return self._authorized(user, "get", lambda: self._one(name, query, accept))
        return _failure(
            HTTPStatus.NOT_FOUND, f"the server could not find the requested path {path}"
        )

    def _authorized(
        self, user: User, verb: str, then: Callable[[], Answer | Stream]
    ) -> Answer | Stream:
        decision = self.authorizer.check_user(user.as_obj(), group=resource.GROUP, verb=verb)
        if not decision.allowed:
            return _failure(decision.status, decision.message)
        if not self.synced.is_set():
            return _failure(HTTPStatus.SERVICE_UNAVAILABLE, "the cluster view has not synced yet")
        log.debug("aggregated api request", verb=verb, user=user.name)
        return then()

    def _one(self, name: str, query: dict[str, str], accept: str) -> Answer:
        self.store.current()
        version, objs = self.store.snapshot()
        found = [o for o in objs if o["metadata"]["name"] == name]
        if not found:
            message = f'{resource.RESOURCE}.{resource.GROUP} "{name}" not found'
            return _failure(HTTPStatus.NOT_FOUND, message, name)
        if wants_table(accept):
            include = query.get("includeObject", "Metadata")
            return _answer(HTTPStatus.OK, table(found, version, include))
        return _answer(HTTPStatus.OK, found[0])

    def _collection(self, verb: str, query: dict[str, str], accept: str) -> Answer | Stream:
        try:
            labels = label_selector(query.get("labelSelector"))
            fields = field_selector(query.get("fieldSelector"))
            timeout = float(query.get("timeoutSeconds") or self.max_watch_s)
        except InvalidArgumentError as exc:
            return _failure(HTTPStatus.BAD_REQUEST, str(exc))
        except ValueError:
            return _failure(HTTPStatus.BAD_REQUEST, "timeoutSeconds must be a number of seconds")

        def selected(obj: Obj | None) -> bool:
            return obj is not None and labels(obj["metadata"].get("labels") or {}) and fields(obj)

        include = query.get("includeObject", "Metadata")
        as_table = wants_table(accept)
        if verb == "list":
            self.store.current()
            version, objs = self.store.snapshot()
            objs = [o for o in objs if selected(o)]
            if as_table:
                return _answer(HTTPStatus.OK, table(objs, version, include))
            return _answer(
                HTTPStatus.OK,
                {
                    "kind": resource.LIST_KIND,
                    "apiVersion": resource.API_VERSION,
                    "metadata": {"resourceVersion": str(version)},
                    "items": objs,
                },
            )
        if not self._watches.acquire(blocking=False):
            return _failure(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"too many watches of {resource.RESOURCE} (at most {self.max_watches}); retry",
            )
        deadline = time.monotonic() + max(0.0, min(timeout, self.max_watch_s))
        start = query.get("resourceVersion") or ""
        events = self._watch(start, selected, deadline, as_table, include)
        return Stream(HTTPStatus.OK, events, self._watches.release)

    def _watch(
        self,
        start: str,
        selected: Callable[[Obj | None], bool],
        deadline: float,
        as_table: bool,
        include: str,
    ) -> Iterator[bytes]:
        """The watch's events, one JSON line each."""
        first = [True]

        def line(kind: str, obj: Obj) -> bytes:
            if as_table:
                obj = table(
                    [obj], int(obj["metadata"]["resourceVersion"]), include, columns=first[0]
                )
                first[0] = False
            return json.dumps({"type": kind, "object": obj}).encode() + b"\n"

        if start in ("", "0"):  # the current state first, as synthetic ADDED events
            self.store.current()
            version, objs = self.store.snapshot()
            for obj in objs:
                if selected(obj):
                    yield line("ADDED", obj)
        elif start.isdigit():
            version = int(start)
        else:
            yield self._expired(start)
            return
        if start not in ("", "0") and not self.store.ours(version):
            # Another replica's version: the current state of what changed around it, then on
            # from this store's version before that (a change in between may come twice, never
            # older than what was sent before it).
            current = self.store.version
            caught_up = self.store.changes_since(version, foreign=True)
            if caught_up is None:
                yield self._expired(start)
                return
            for change in caught_up:
                kind = _seen_as(change, selected)
                if kind:
                    yield line(kind, change.obj)
            version = current
        while (left := deadline - time.monotonic()) > 0:
            changes = self.store.changes_since(version)
            if changes is None:
                yield self._expired(str(version))
                return
            for change in changes:
                kind = _seen_as(change, selected)
                if kind:
                    yield line(kind, change.obj)
                version = change.version
            if not changes:
                self.store.wait(version, min(left, IDLE_TICK_S))
                yield b""

    @staticmethod
    def _expired(version: str) -> bytes:
        message = f"too old resource version: {version} (the view keeps recent changes only)"
        event = {"type": "ERROR", "object": status(HTTPStatus.GONE, message)}
        return json.dumps(event).encode() + b"\n"


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
