"""Who may read the view: a bearer token checked as the API server checks one.

A request's ``Authorization: Bearer <token>`` goes to a TokenReview (authentication.k8s.io/v1:
who is this?), then the user it names to a SubjectAccessReview (authorization.k8s.io/v1: may
this user ``get`` the virtual resource ``gpus.gpu.gpuslice.dev``?). So the view is granted with
ordinary RBAC (the chart's ClusterRole ``<release>-gpuslice-view``), audited by the API server,
and works with any token the cluster accepts: ServiceAccount tokens, OIDC, webhook tokens.

A positive answer is cached for ``ttl`` seconds (10 by default) under the token's SHA-256, so a
dashboard that polls costs two reviews per 10 s, not per request; the token itself is never
kept. Refusals are not cached: a grant takes effect at the next request, and a revoked grant
within ``ttl``. The cache holds at most ``max_entries`` tokens (expired ones go first, then the
oldest).

Answers: 401 without a bearer token or with one the API server does not authenticate, 403 when
the user lacks the permission, 503 when the reviews cannot be made (the API server is down).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from gpuslice_api.names import VIEW_GROUP
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj, RawApi

log = get_logger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"  # noqa: S105 - a path
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
GROUP = VIEW_GROUP
RESOURCE = "gpus"
VERB = "get"


@dataclass(frozen=True)
class Decision:
    status: HTTPStatus
    user: str = ""
    message: str = ""

    @property
    def allowed(self) -> bool:
        return self.status == HTTPStatus.OK


class Reviewer:
    """The two API calls (a seam for tests)."""

    def __init__(self, raw: RawApi) -> None:
        self.raw = raw

    def token_review(self, token: str) -> Obj:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview"}
        return self.raw.create(TOKEN_REVIEWS, {**body, "spec": {"token": token}})

    def access_review(
        self,
        user: Obj,
        group: str = GROUP,
        verb: str = VERB,
        *,
        resource: str = RESOURCE,
        namespace: str = "",
        name: str = "",
    ) -> Obj:
        attributes = {"group": group, "resource": resource, "verb": verb}
        if namespace:
            attributes["namespace"] = namespace
        if name:
            attributes["name"] = name
        spec: dict[str, Any] = {
            "user": user.get("username", ""),
            "groups": user.get("groups") or [],
            "resourceAttributes": attributes,
        }
        if user.get("uid"):
            spec["uid"] = user["uid"]
        if user.get("extra"):
            spec["extra"] = user["extra"]
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview"}
        return self.raw.create(ACCESS_REVIEWS, {**body, "spec": spec})


def bearer(header: str | None) -> str:
    scheme, _, token = (header or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class Authorizer:
    def __init__(
        self,
        reviewer: Reviewer,
        *,
        ttl: float = 10.0,
        max_entries: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reviewer = reviewer
        self.ttl = ttl
        self.max_entries = max_entries
        self.clock = clock
        self._cache: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, authorization: str | None) -> Decision:
        """The decision for a request's ``Authorization`` header."""
        token = bearer(authorization)
        if not token:
            return Decision(HTTPStatus.UNAUTHORIZED, message="a bearer token is required")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > now:
                return Decision(HTTPStatus.OK, user=cached[1])
        try:
            decision = self._review(token)
        except GpusliceError as exc:
            log.warning("cannot review a view request", error=str(exc))
            return Decision(HTTPStatus.SERVICE_UNAVAILABLE, message="cannot review the token now")
        if decision.allowed:
            self._remember(key, decision.user, now)
        return decision

    def check_user(
        self,
        user: Obj,
        *,
        group: str,
        verb: str,
        resource: str = RESOURCE,
        namespace: str = "",
        name: str = "",
    ) -> Decision:
        """The decision for a user the API server authenticated already (the aggregated API:
        ``frontproxy``), as TokenReview's ``status.user`` names one: may it ``verb`` the
        ``resource`` in ``group`` (in ``namespace``, the object ``name``, where given: the
        attributes the API server checked, so a Role in that namespace grants it here too)?
        Cached like tokens, under a digest of the question."""
        question = json.dumps([user, group, verb, resource, namespace, name], sort_keys=True)
        key = "user:" + hashlib.sha256(question.encode()).hexdigest()
        now = self.clock()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > now:
                return Decision(HTTPStatus.OK, user=cached[1])
        who = str(user.get("username", ""))
        try:
            access = self.reviewer.access_review(
                user, group, verb, resource=resource, namespace=namespace, name=name
            )
        except GpusliceError as exc:
            log.warning("cannot review a view request", error=str(exc))
            return Decision(HTTPStatus.SERVICE_UNAVAILABLE, message="cannot review the user now")
        if not (access.get("status") or {}).get("allowed"):
            # the API server's wording, which kubectl prints after "Error from server (Forbidden)"
            what = f'{resource}.{group} "{name}"' if name else f"{resource}.{group}"
            scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            return Decision(
                HTTPStatus.FORBIDDEN,
                user=who,
                message=f'{what} is forbidden: User "{who}" cannot {verb} resource '
                f'"{resource}" in API group "{group}" {scope}',
            )
        self._remember(key, who, now)
        return Decision(HTTPStatus.OK, user=who)

    def _review(self, token: str) -> Decision:
        status = self.reviewer.token_review(token).get("status") or {}
        if not status.get("authenticated"):
            return Decision(HTTPStatus.UNAUTHORIZED, message="the token is not valid")
        user: Obj = status.get("user") or {}
        name = str(user.get("username", ""))
        access = self.reviewer.access_review(user).get("status") or {}
        if not access.get("allowed"):
            return Decision(
                HTTPStatus.FORBIDDEN,
                user=name,
                message=f'user "{name}" cannot {VERB} resource "{RESOURCE}" in API group '
                f'"{GROUP}" (the view needs it; see the ClusterRole gpuslice-view)',
            )
        return Decision(HTTPStatus.OK, user=name)

    def _remember(self, key: str, user: str, now: float) -> None:
        with self._lock:
            self._cache[key] = (now + self.ttl, user)
            self._cache.move_to_end(key)
            for stale in [k for k, (until, _) in self._cache.items() if until <= now]:
                del self._cache[stale]
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)
