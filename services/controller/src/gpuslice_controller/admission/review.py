"""AdmissionReview in, AdmissionReview out (admission.k8s.io/v1).

A reviewer is a function from the request to a ``Decision``; this module does the envelope:
it echoes the request's ``uid``, encodes a JSON patch, turns a reviewer's exception into a denial
(or an allowance, for reviewers that must never block) with the reason, and records the
outcome in metrics. Reviewers stay free of HTTP and of the envelope's details.

The review is decoded with ``gpuslice_core.untrusted.loads``: an object nested deeper than
200 levels (a claim whose opaque parameters nest 1,500 levels) is denied with that reason
without reaching a reviewer, since nothing in gpuslice could read it afterwards either.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Histogram

from gpuslice_core import untrusted
from gpuslice_core.logging import get_logger, kobj
from gpuslice_core.metrics import Subsystem, metric_name

log = get_logger(__name__)

Request = dict[str, Any]

REVIEWS = Counter(
    metric_name(Subsystem.CONTROLLER, "admission_total"),
    "Admission reviews answered, by webhook and result (allowed, denied, patched, error).",
    ["webhook", "result"],
)
DURATION = Histogram(
    metric_name(Subsystem.CONTROLLER, "admission_duration_seconds"),
    "Time to answer one admission review, by webhook.",
    ["webhook"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)

_FAILURES = untrusted.Throttle(60.0)


@dataclass(frozen=True)
class Decision:
    """A reviewer's answer: allowed or not, why, warnings for the user, and a patch."""

    allowed: bool
    message: str = ""
    warnings: tuple[str, ...] = ()
    patch: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def allow(cls, *warnings: str, patch: list[dict[str, Any]] | None = None) -> Decision:
        return cls(True, "", tuple(warnings), patch or [])

    @classmethod
    def deny(cls, message: str, *warnings: str) -> Decision:
        return cls(False, message, tuple(warnings))


Reviewer = Callable[[Request], Decision]


class BadReviewError(ValueError):
    """The body is not an AdmissionReview this server can answer (HTTP 400)."""


def parse(body: bytes) -> tuple[Request, str]:
    """The review's request, and why its objects cannot be decoded ("" when they can: then
    the request is whole; otherwise it holds only its top-level fields, ``uid`` among them)."""
    problem = ""
    try:
        review = untrusted.loads(body)
    except untrusted.UndecodableError as exc:
        problem = str(exc)
        try:  # uid, kind, namespace, name and operation are all near the top
            review = untrusted.loads(untrusted.prune(body, 3))
        except untrusted.UndecodableError:
            raise BadReviewError(f"body is not JSON: {exc}") from exc
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise BadReviewError("body is not an AdmissionReview")
    if review.get("apiVersion") != "admission.k8s.io/v1":
        raise BadReviewError(
            f"AdmissionReview {untrusted.shown(review.get('apiVersion'))} is not served; "
            "set admissionReviewVersions: [v1]"
        )
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReviewError(
            f"AdmissionReview request: {untrusted.shown(request)} is not an object"
        )
    wrong = [f"request.{key}: {why}" for key, why in _wrong_fields(request)]
    if wrong:
        raise BadReviewError(f"AdmissionReview is malformed: {'; '.join(wrong)}")
    return request, problem


#: The fields of a review's request that this server and its reviewers read, and their
#: types as the API server sends them (an absent or null field is not checked).
_FIELDS: dict[str, tuple[type, ...]] = {
    "uid": (str,),
    "kind": (dict,),
    "resource": (dict,),
    "namespace": (str,),
    "name": (str,),
    "operation": (str,),
    "dryRun": (bool,),
    "object": (dict,),
    "oldObject": (dict,),
}
_KIND_FIELDS = ("group", "version", "kind", "resource")
_TYPE_NAMES = {str: "a string", dict: "an object", bool: "true or false"}


def _wrong_fields(request: Request) -> list[tuple[str, str]]:
    """(field, what is wrong with it) for each field of ``request`` that is not of the type
    the API server sends: a review of any other shape comes from someone else."""
    wrong = []
    if not request.get("uid"):
        wrong.append(("uid", "missing"))
    for key, types in _FIELDS.items():
        value = request.get(key)
        if value is not None and not isinstance(value, types):
            wrong.append((key, f"{untrusted.shown(value)} is not {_TYPE_NAMES[types[0]]}"))
    for key in ("kind", "resource"):
        value = request.get(key)
        if isinstance(value, dict):
            for sub in _KIND_FIELDS:
                if value.get(sub) is not None and not isinstance(value[sub], str):
                    wrong.append((f"{key}.{sub}", f"{untrusted.shown(value[sub])} is not a string"))
    return wrong


def text_at(obj: object, *path: str) -> str | None:
    """The string at ``path`` in a decoded review, cut to 253 characters (a name's limit);
    None when a step is not an object or the value is not a string. For log lines and
    messages: a review of the wrong shape must still be answered, and named."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj[:253] if isinstance(obj, str) else None


def answer(webhook: str, body: bytes, reviewer: Reviewer) -> bytes:
    """The response body for an AdmissionReview ``body``; raises ``BadReviewError``."""
    start = time.perf_counter()
    request, problem = parse(body)
    try:
        if problem:
            what = text_at(request, "kind", "kind") or "object"
            decision = Decision.deny(
                f"gpuslice-controller cannot decode this {what}: {problem}; no gpuslice "
                "component could read it"
            )
        else:
            decision = reviewer(request)
        result = "patched" if decision.patch else ("allowed" if decision.allowed else "denied")
    except Exception as exc:  # a bug must answer, not hang the API server's call
        # The traceback once a minute per webhook and error type: anyone can post an object
        # of a shape no API server sends, and each must not cost a traceback in the log.
        held = _FAILURES.allow(f"{webhook}/{type(exc).__name__}")
        if held is not None:
            log.exception(
                "reviewer failed",
                webhook=webhook,
                uid=text_at(request, "uid"),
                held_back=held or None,
            )
        decision = Decision.deny(f"gpuslice-controller could not review this object: {exc}")
        result = "error"
    uid: str = request["uid"]
    response: dict[str, Any] = {"uid": uid, "allowed": decision.allowed}
    if not decision.allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": decision.message}
    if decision.warnings:
        response["warnings"] = list(decision.warnings)
    if decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(decision.patch).encode()).decode()
    elapsed = time.perf_counter() - start
    REVIEWS.labels(webhook, result).inc()
    DURATION.labels(webhook).observe(elapsed)
    log.info(
        "admission",
        webhook=webhook,
        uid=uid[:253],
        kind=text_at(request, "kind", "kind"),
        version=text_at(request, "kind", "version"),
        # the object by reference, as klog's KObj: never the object or the userInfo
        object=kobj(
            text_at(request, "namespace"),
            text_at(request, "name") or text_at(request, "object", "metadata", "name") or "",
        ),
        operation=text_at(request, "operation"),
        result=result,
        message=decision.message or None,
        warnings=len(decision.warnings) or None,
        duration_ms=round(elapsed * 1000, 2),
    )
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
    return json.dumps(review).encode()
