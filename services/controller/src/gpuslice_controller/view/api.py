"""The view as read-only JSON over HTTPS, in the shapes ``kubectl gpuslice -o json`` prints.

``GET /view/gpus``                      every GPU and MIG device (``top gpus``)
``GET /view/gpus/<uuid|node/index|node/device>``   one device (``describe gpu``)
``GET /view/claims[?namespace=<ns>]``   claims on our devices or asking our classes (``claims``)
``GET /view/why/<namespace>/<pod>``     why a pod has no GPU (``why pod/<name>``)
``GET /view/metrics``                   the per-claim Prometheus series (``ClaimCollector``)

Every request is authorized first (``auth``: 401, 403), so nothing about the cluster is said to
a caller without the permission, not even whether the view has synced; then the view answers
503 until it has synced (a half-listed cluster would show GPUs as free that are not), 404 for
an unknown path, GPU or pod (the message names what exists), 200 with JSON otherwise. Each
answer is derived under the feeder's lock, one read per request.

``/view/metrics`` is the exception to the 503: a scrape target that fails while the view lists
would look like a controller that is down, so it answers 200 and gives no claim series until
the view has synced (as ``/metrics`` gives no GPU series until then). The per-claim series are
the same data as ``/view/claims``, so they are behind the same permission.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import Message
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gpuslice_controller.view.auth import Authorizer
from gpuslice_controller.view.metrics import ClaimCollector, ViewSource
from gpuslice_core.errors import NotFoundError
from gpuslice_core.logging import get_logger
from gpuslice_view import report
from gpuslice_view.model import ClusterView
from gpuslice_view.wire import TOKEN_HEADER

log = get_logger(__name__)
PREFIX = "/view/"
METRICS = f"{PREFIX}metrics"
JSON = "application/json"


@dataclass(frozen=True)
class Answer:
    status: HTTPStatus
    body: bytes
    content_type: str = JSON


def _json(status: HTTPStatus, data: Any) -> Answer:
    return Answer(status, json.dumps(data, indent=2).encode() + b"\n")


def _error(status: HTTPStatus, message: str) -> Answer:
    return _json(status, {"error": message, "code": int(status)})


def credentials(headers: Mapping[str, str] | Message) -> str | None:
    """The request's bearer credentials: ``Authorization``, else ``X-Gpuslice-Authorization``.

    The second is how ``kubectl gpuslice`` reaches the view through the API server's service
    proxy: the API server removes ``Authorization`` once it has authenticated the user with it,
    so the plugin sends the user's token again under a header the proxy passes on. It is
    reviewed exactly as ``Authorization`` is (docs/cluster-view.md, "kubectl gpuslice").
    """
    found = headers.get("Authorization") or headers.get(TOKEN_HEADER)
    return str(found) if found else None


class ViewApi:
    def __init__(self, source: ViewSource, authorizer: Authorizer) -> None:
        self.source = source
        self.authorizer = authorizer
        self.claims = CollectorRegistry(auto_describe=False)
        self.claims.register(ClaimCollector(source))

    def get(self, target: str, authorization: str | None) -> Answer:
        """Answer ``GET target`` (path and query) for a request with that header."""
        decision = self.authorizer.check(authorization)
        if not decision.allowed:
            return _error(decision.status, decision.message)
        url = urlsplit(target)
        if url.path == METRICS:
            return Answer(HTTPStatus.OK, generate_latest(self.claims), CONTENT_TYPE_LATEST)
        if not self.source.synced.is_set():
            return _error(HTTPStatus.SERVICE_UNAVAILABLE, "the cluster view has not synced yet")
        parts = [unquote(p) for p in url.path[len(PREFIX) :].split("/") if p]
        query = parse_qs(url.query)
        try:
            answer = self._route(parts, query)
        except NotFoundError as exc:
            answer = _error(HTTPStatus.NOT_FOUND, str(exc))
        log.debug("view request", path=url.path, user=decision.user, status=int(answer.status))
        return answer

    def _route(self, parts: list[str], query: dict[str, list[str]]) -> Answer:
        read = self.source.read
        if parts == ["gpus"]:
            return _json(HTTPStatus.OK, read(report.gpu_rows))
        if parts[:1] == ["gpus"] and len(parts) in (2, 3):
            ref = "/".join(parts[1:])

            def one(view: ClusterView) -> dict[str, Any]:
                device = view.find(ref)
                return report.gpu_row(view, view.usage()[device.key])

            return _json(HTTPStatus.OK, read(one))
        if parts == ["claims"]:
            namespace = next(iter(query.get("namespace") or []), "") or None
            return _json(HTTPStatus.OK, read(lambda v: report.claim_rows(v, namespace)))
        if parts[:1] == ["why"] and len(parts) == 3:
            namespace, name = parts[1], parts[2]

            def why(view: ClusterView) -> dict[str, Any]:
                found = report.why_row(view, namespace, name)
                if found is None:
                    raise NotFoundError(f"no pod with GPU claims {name!r} in namespace {namespace}")
                return found

            return _json(HTTPStatus.OK, read(why))
        raise NotFoundError(
            "no such view; paths: /view/gpus, /view/gpus/<gpu>, /view/claims[?namespace=], "
            "/view/why/<namespace>/<pod>, /view/metrics"
        )
