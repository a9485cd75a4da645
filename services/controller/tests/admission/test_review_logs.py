"""What the controller writes about an admission review: the object by reference, never the
object, the requesting user or a failing reviewer's locals (issue 31: a failed review used to
log the AdmissionReview, pod and userInfo, from the reviewer's frame)."""

from __future__ import annotations

import io
import json
from typing import Any

from gpuslice_controller.admission import review as admission
from gpuslice_controller.admission.review import Decision, Request
from gpuslice_core import logging as gslog
from gpuslice_testkit.core import preserved_logging

TOKEN = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXRva2Vu"


def _body(uid: str) -> bytes:
    request = {
        "uid": uid,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "namespace": "team-a",
        "operation": "CREATE",
        "userInfo": {"username": "alice@example.com", "extra": {"token": [TOKEN]}},
        "object": {
            "metadata": {"name": "trainer", "annotations": {"note": f"Bearer {TOKEN}"}},
            "spec": {"containers": [{"name": "c", "env": [{"name": "PW", "value": "hunter2"}]}]},
        },
    }
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    return json.dumps(review).encode()


def _logged(webhook: str, reviewer: admission.Reviewer) -> tuple[str, list[dict[str, Any]]]:
    out = io.StringIO()
    with preserved_logging():
        gslog.configure(component="controller", stream=out)
        admission.answer(webhook, _body("u-1"), reviewer)
    text = out.getvalue()
    return text, [json.loads(line) for line in text.splitlines()]


def test_the_admission_line_names_the_object_and_holds_none_of_it() -> None:
    text, [line] = _logged("log-allow", lambda request: Decision.allow())
    assert line["msg"] == "admission" and line["result"] == "allowed"
    assert line["object"] == {"name": "trainer", "namespace": "team-a"} and line["kind"] == "Pod"
    for leaked in (TOKEN, "alice", "hunter2", "userInfo", "containers"):
        assert leaked not in text


def test_a_failing_reviewer_logs_its_traceback_without_the_review() -> None:
    def fails(request: Request) -> Decision:
        user = request["userInfo"]  # locals a traceback with locals would have written
        raise KeyError(f"no {len(user)}")

    text, lines = _logged("log-fail", fails)
    failed = next(x for x in lines if x["msg"] == "reviewer failed")
    assert failed["level"] == "error" and failed["err"] == "KeyError: 'no 2'"
    assert "in fails" in failed["stacktrace"]
    assert [x["result"] for x in lines if x["msg"] == "admission"] == ["error"]
    for leaked in (TOKEN, "alice", "hunter2", 'trainer\\"', 'userInfo": {'):
        assert leaked not in text
