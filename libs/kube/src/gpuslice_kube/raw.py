"""Raw-JSON access to any Kubernetes resource path.

Why raw: the typed models of kubernetes 37 cost 8-12x plain JSON to deserialize, and their
``watch`` cannot stream DRA claims at all (it looks up a model class that does not exist). A path
such as ``/apis/resource.k8s.io/v1/resourceslices`` also makes API-version fallback a string
choice instead of a different generated class. Objects are plain dicts; the API server validates
what we write and its message comes back in the error.

What others wrote is decoded with ``gpuslice_core.untrusted.loads``: nesting is bounded, and an
object that cannot be decoded (a claim whose opaque parameters nest 1,500 levels deep) is an
``UndecodableObjectError`` when it is read alone, is left out of a list (the others are kept;
one warning per object and minute names it), and arrives from a watch as an event marked
``undecodable`` that carries only the object's identity.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import urllib3

from gpuslice_core import untrusted
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube import retry
from gpuslice_kube.errors import (
    KubeUnreachableError,
    UndecodableObjectError,
    from_exception,
    from_status,
)
from gpuslice_kube.transport import ApiClientLike

log = get_logger(__name__)

Obj = dict[str, Any]

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


@dataclass(frozen=True)
class WatchEvent:
    """One event of a watch stream: ADDED, MODIFIED, DELETED, BOOKMARK or ERROR.

    ``undecodable``: why the event's object could not be decoded; ``object`` then holds only
    the ``metadata`` (name, namespace, uid, resourceVersion) that could be read, maybe none.
    """

    type: str
    object: Obj
    undecodable: str = ""


SKIPPED = untrusted.Throttle(60.0)
"""One warning per undecodable object and minute (lists are read again and again)."""


def report_skipped(path: str, meta: Mapping[str, str], reason: str) -> None:
    """Log that an object of ``path`` was left out because it cannot be decoded."""
    name = meta.get("name", "?")
    key = f"{meta['namespace']}/{name}" if meta.get("namespace") else name
    held = SKIPPED.allow(f"{path} {key} {meta.get('uid', '')}")
    if held is None:
        return
    log.warning(
        "an object that cannot be decoded is skipped; the others are kept",
        path=path,
        object=key,
        uid=meta.get("uid"),
        reason=reason,
        held_back=held or None,
    )


def _decode(data: bytes, what: str) -> Any:
    if not data:
        return {}
    try:
        return untrusted.loads(data)
    except untrusted.UndecodableError as exc:
        meta = untrusted.identity(data)
        name = "/".join(v for v in (meta.get("namespace"), meta.get("name")) if v)
        err = UndecodableObjectError(
            f"{what}: the object {name or ''} cannot be decoded: {exc}".replace("  ", " ")
        )
        err.problem = str(exc)
        raise err from exc


def _decode_page(data: bytes, path: str) -> Obj:
    """A list page; items that cannot be decoded are left out and reported."""
    if not data:
        return {}
    try:
        page: Obj = untrusted.loads(data)
        return page
    except untrusted.UndecodableError as exc:
        split = untrusted.split_items(data)
        if split is None:
            err = UndecodableObjectError(f"GET {path}: the list cannot be decoded: {exc}")
            err.problem = str(exc)
            raise err from exc
    envelope, texts = split
    page = _decode(envelope, f"GET {path}")
    items = []
    for text in texts:
        try:
            items.append(untrusted.loads(text))
        except untrusted.UndecodableError as exc:
            report_skipped(path, untrusted.identity(text), str(exc))
    page["items"] = items
    return page


def resource_path(
    group_version: str, plural: str, *, namespace: str | None = None, name: str | None = None
) -> str:
    """The URL path of a collection or object.

    ``("resource.k8s.io/v1", "resourceslices")`` → ``/apis/resource.k8s.io/v1/resourceslices``.
    """
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    if namespace is not None:
        base += f"/namespaces/{quote(namespace, safe='')}"
    base += f"/{plural}"
    if name is not None:
        base += f"/{quote(name, safe='')}"
    return base


class RawApi:
    """GET/LIST/WATCH/CREATE/UPDATE/PATCH/DELETE on resource paths, with retries on transient
    failures and gpuslice errors (with the API server's message) on everything else.

    ``api_client`` is the kubernetes client's ``ApiClient`` or anything with its two calls
    (``gpuslice_kube.transport``)."""

    def __init__(
        self,
        api_client: ApiClientLike,
        *,
        deadline: float = 60.0,
        unreachable_is_final: bool = False,
    ) -> None:
        """Transient failures are retried for ``deadline`` seconds; with
        ``unreachable_is_final`` (a command a person runs) an API server that cannot be
        connected to at all fails the first attempt, as kubectl does."""
        self.api_client = api_client
        self.deadline = deadline
        self._final: tuple[type[BaseException], ...] = (
            (KubeUnreachableError,) if unreachable_is_final else ()
        )

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = JSON,
        timeout: float | tuple[float, float] | None = 30.0,
        stream: bool = False,
        decode: bool = True,
    ) -> Any:
        headers = {"Accept": JSON, "Content-Type": content_type}
        params = [(k, v) for k, v in (query or {}).items() if v is not None]
        _method, url, header_params, serialized, _post = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=params,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        what = f"{method} {path}"
        try:
            response = self.api_client.call_api(
                method,
                url,
                header_params=header_params,
                body=serialized,
                _request_timeout=timeout,
            )
        except GpusliceError:  # the client's own verdict (a kubeconfig it cannot use)
            raise
        except Exception as exc:  # client/transport failures: classify, keep the cause
            raise from_exception(exc, what=what) from exc
        if not 200 <= response.status <= 299:
            data = response.read()
            raise from_status(response.status, data, headers=dict(response.headers), what=what)
        if stream:
            return response.response
        data = response.read()
        return _decode(data, what) if decode else data

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        return retry.call(self._request, *args, deadline=self.deadline, final=self._final, **kwargs)

    def get(self, path: str) -> Obj:
        result: Obj = self._call("GET", path)
        return result

    def list(
        self,
        path: str,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = 500,
    ) -> Obj:
        """List all pages; returns ``{"items": [...], "metadata": {"resourceVersion": ...}}``."""
        items: list[Obj] = []
        version = None
        for page, page_version in self.pages(
            path, label_selector=label_selector, field_selector=field_selector, limit=limit
        ):
            items.extend(page)
            version = page_version
        return {"items": items, "metadata": {"resourceVersion": version}}

    def pages(
        self,
        path: str,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = 500,
    ) -> Iterator[tuple[Sequence[Obj], str | None]]:
        """A list page by page, as ``(items, resourceVersion of the list)``: a consumer that
        reduces what it keeps never holds more than one page of whole objects."""
        token: str | None = None
        while True:
            data: bytes = self._call(
                "GET",
                path,
                query={
                    "labelSelector": label_selector,
                    "fieldSelector": field_selector,
                    "limit": limit,
                    "continue": token,
                },
                decode=False,
            )
            page = _decode_page(data, path)
            meta = page.get("metadata") or {}
            yield page.get("items") or [], meta.get("resourceVersion")
            token = meta.get("continue")
            if not token:
                return

    def create(self, path: str, obj: Obj) -> Obj:
        result: Obj = self._call("POST", path, body=obj)
        return result

    def replace(self, path: str, obj: Obj) -> Obj:
        result: Obj = self._call("PUT", path, body=obj)
        return result

    def patch(self, path: str, patch: Obj, *, content_type: str = MERGE_PATCH) -> Obj:
        result: Obj = self._call("PATCH", path, body=patch, content_type=content_type)
        return result

    def delete(
        self,
        path: str,
        *,
        precondition_uid: str | None = None,
        grace_period_seconds: int | None = None,
    ) -> Obj:
        """Delete one object, optionally only if it still has ``precondition_uid``."""
        options: Obj = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if precondition_uid:
            options["preconditions"] = {"uid": precondition_uid}
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        data: bytes = self._call("DELETE", path, body=options, decode=False)
        try:
            result: Obj = _decode(data, f"DELETE {path}")
            return result
        except UndecodableObjectError:  # it is deleted all the same: say which one
            return {"metadata": untrusted.identity(data)}

    def delete_collection(
        self, path: str, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> Obj:
        """Delete every object of a collection that the selectors match (DeleteCollection);
        returns the list of what was deleted (objects that cannot be decoded left out)."""
        data: bytes = self._call(
            "DELETE",
            path,
            query={"labelSelector": label_selector, "fieldSelector": field_selector},
            decode=False,
        )
        return _decode_page(data, path)

    def watch(
        self,
        path: str,
        *,
        resource_version: str | None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> WatchStream:
        """Open a watch of events after ``resource_version``; iterate it, ``close()`` to stop."""
        response: urllib3.BaseHTTPResponse = self._call(
            "GET",
            path,
            query={
                "watch": "true",
                "allowWatchBookmarks": "true",
                "resourceVersion": resource_version,
                "labelSelector": label_selector,
                "fieldSelector": field_selector,
                "timeoutSeconds": timeout_seconds,
            },
            timeout=(10.0, timeout_seconds + 30.0),
            stream=True,
        )
        return WatchStream(path, response)


class WatchStream:
    """An open watch: yields ``WatchEvent`` until the server ends it or ``close()`` is called.

    Iteration raises ``GoneError`` when the resource version is too old (list again) and the
    mapped error for any other ERROR event.
    """

    def __init__(self, path: str, response: urllib3.BaseHTTPResponse) -> None:
        self.path = path
        self._response = response
        self._closed = False

    def __iter__(self) -> Iterator[WatchEvent]:
        try:
            for line in self._response:  # urllib3 responses iterate line by line
                if not line.strip():
                    continue
                try:
                    event = untrusted.loads(line)
                except untrusted.UndecodableError as exc:
                    yield _undecodable_event(line, str(exc))
                    continue
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise from_status(
                        int(status.get("code") or 0), json.dumps(status), what=f"WATCH {self.path}"
                    )
                yield WatchEvent(type=event["type"], object=event["object"])
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            if self._closed:
                return
            raise from_exception(
                exc if not isinstance(exc, ValueError) else ConnectionError(str(exc)),
                what=f"WATCH {self.path}",
            ) from exc
        finally:
            self.close()

    def close(self) -> None:
        """End the watch from any thread; a blocked iteration returns."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(RuntimeError):  # already released to the pool
                self._response.shutdown()  # unblocks a reader stuck in a socket read
            self._response.release_conn()


def _undecodable_event(line: bytes, reason: str) -> WatchEvent:
    """What can be read of an event whose object cannot be decoded: its type and identity."""
    try:
        head = untrusted.loads(untrusted.prune(line, 1))
    except untrusted.UndecodableError:
        head = {}
    kind = head.get("type") if isinstance(head, dict) else None
    meta = untrusted.identity(line, level=2)
    return WatchEvent(
        type=str(kind or "MODIFIED"), object={"metadata": meta} if meta else {}, undecodable=reason
    )
