"""The log line's shape (klog's JSON keys), what never reaches it (frame locals, credentials,
request bodies) and the one --log-format/--log-level pair every service shares."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import structlog

from gpuslice_core import logging as gs_logging
from gpuslice_core.cli import EnvArgumentParser, add_log_flags
from gpuslice_testkit.core import preserved_logging

SECRET = "s3cr3t-abcdef0123456789"


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    with preserved_logging():
        stream = io.StringIO()
        gs_logging.configure(component="test", level="debug", stream=stream)
        yield stream
        structlog.contextvars.clear_contextvars()


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


@dataclass(frozen=True)
class Ref:
    namespace: str
    name: str
    uid: str = "u"


def test_klog_keys_in_klog_order(out: io.StringIO) -> None:
    before = time.time() * 1000
    gs_logging.get_logger("gpuslice_x.state").info("prepared", device="gpu-0")
    [line] = lines(out)
    assert list(line)[:5] == ["ts", "level", "msg", "logger", "component"]
    assert line["msg"] == "prepared" and line["level"] == "info" and "event" not in line
    assert line["logger"] == "gpuslice_x.state" and line["component"] == "test"
    # klog's JSON encoder: float milliseconds since the epoch
    assert isinstance(line["ts"], float) and before - 1 <= line["ts"] <= time.time() * 1000 + 1


def test_objects_are_written_as_klog_kobj(out: io.StringIO) -> None:
    log = gs_logging.get_logger("x")
    with structlog.contextvars.bound_contextvars(claim="ns-a/claim-1"):
        log.info("one", pod=Ref("ns-b", "pod-1"), node="node-1")
    log.info("two", claim="not-a-ref", template=gs_logging.kobj("ns-c", "t"), owner="ns/x")
    one, two = lines(out)
    assert one["claim"] == {"name": "claim-1", "namespace": "ns-a"}
    assert one["pod"] == {"name": "pod-1", "namespace": "ns-b"}
    assert one["node"] == {"name": "node-1"}, "cluster-scoped: no namespace"
    assert two["claim"] == "not-a-ref", "a UID or other id is left as it is"
    assert two["template"] == {"name": "t", "namespace": "ns-c"}
    assert two["owner"] == "ns/x", "only the object keys are rewritten"


def test_error_text_is_err(out: io.StringIO) -> None:
    gs_logging.get_logger("x").warning("cannot read the Node", error="timed out")
    [line] = lines(out)
    assert line["err"] == "timed out" and "error" not in line


def _fail(secret_token: str, review: dict[str, Any]) -> None:
    raise RuntimeError("reviewer broke")


def test_a_traceback_never_carries_a_frames_locals(out: io.StringIO) -> None:
    """A failing frame's locals (here a token and an AdmissionReview with userInfo, as the
    controller's reviewer had) must not reach the line: only file, line and code."""
    review = {"request": {"userInfo": {"username": "alice"}, "object": {"kind": "Pod"}}}
    try:
        _fail(SECRET, review)
    except RuntimeError:
        gs_logging.get_logger("x").exception("reviewer failed", webhook="pods")
    text = out.getvalue()
    [line] = lines(out)
    assert line["level"] == "error" and line["err"] == "RuntimeError: reviewer broke"
    assert "Traceback (most recent call last)" in line["stacktrace"]
    assert "in _fail" in line["stacktrace"]
    assert SECRET not in text and "secret_token" not in text
    assert "alice" not in text and "userInfo" not in text
    assert "exception" not in line and "exc_info" not in line


def test_a_stdlib_loggers_traceback_has_no_locals_either(out: io.StringIO) -> None:
    try:
        _fail(SECRET, {})
    except RuntimeError:
        logging.getLogger("grpc._server").exception("Exception calling application")
    [line] = lines(out)
    assert line["err"] == "RuntimeError: reviewer broke" and "in _fail" in line["stacktrace"]
    assert SECRET not in out.getvalue()


def test_the_text_format_has_no_locals_either() -> None:
    with preserved_logging():
        stream = io.StringIO()
        gs_logging.configure(component="test", log_format="text", stream=stream)
        token, review = SECRET, {"userInfo": "alice"}
        try:
            _fail(token, review)
        except RuntimeError:
            gs_logging.get_logger("x").exception("reviewer failed", pod=Ref("ns", "p"))
    text = stream.getvalue()
    assert "reviewer failed" in text and "RuntimeError: reviewer broke" in text
    assert SECRET not in text and "alice" not in text
    assert not text.lstrip().startswith("{") and " pod=ns/p " in text, "klog's text form"
    assert "\nTraceback (most recent call last):\n" in text, "the traceback on lines of its own"


@pytest.mark.parametrize(
    "key",
    [
        "token",
        "secret_token",
        "bearer_token",
        "Authorization",
        "password",
        "client_secret",
        "kubeconfig",
        "headers",
        "body",
        "cookie",
        "api_key",
    ],
)
def test_credential_keys_are_redacted(out: io.StringIO, key: str) -> None:
    gs_logging.get_logger("x").info("calling", **{key: SECRET})
    [line] = lines(out)
    assert line[key] == gs_logging.REDACTED
    assert SECRET not in out.getvalue()


def test_redaction_reaches_nested_values_context_and_bearer_text(out: io.StringIO) -> None:
    log = gs_logging.get_logger("x")
    with structlog.contextvars.bound_contextvars(auth_token=SECRET):
        log.info("bound")
    log.info("nested", request={"path": "/view", "headers": {"X": "1"}, "user": {"token": SECRET}})
    log.info("quoted", err=f"401 for Authorization: Bearer {SECRET}")
    logging.getLogger("urllib3").warning("header Authorization: bearer %s", SECRET)
    bound, nested, quoted, foreign = lines(out)
    assert SECRET not in out.getvalue()
    assert bound["auth_token"] == gs_logging.REDACTED
    assert nested["request"] == {
        "path": "/view",
        "headers": gs_logging.REDACTED,
        "user": {"token": gs_logging.REDACTED},
    }
    assert quoted["err"] == f"401 for Authorization: Bearer {gs_logging.REDACTED}"
    assert foreign["msg"] == f"header Authorization: bearer {gs_logging.REDACTED}"


def test_a_secret_named_by_kobj_keeps_its_name(out: io.StringIO) -> None:
    """``secret=kobj(ns, name)`` is the reference klog would write, not the Secret's data."""
    gs_logging.get_logger("x").info("TLS secret deleted", secret=gs_logging.kobj("gs", "tls"))
    gs_logging.get_logger("x").info("oops", secret={"name": "tls", "data": {"tls.key": SECRET}})
    ref, data = lines(out)
    assert ref["secret"] == {"name": "tls", "namespace": "gs"}
    assert data["secret"] == gs_logging.REDACTED


def test_log_flags_are_shared_and_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = EnvArgumentParser(prog="x")
    add_log_flags(parser)
    args = parser.parse_args([])
    assert (args.log_level, args.log_format) == ("info", "json")
    monkeypatch.setenv("GPUSLICE_LOG_FORMAT", "text")
    monkeypatch.setenv("GPUSLICE_LOG_LEVEL", "debug")
    parser = EnvArgumentParser(prog="x")
    add_log_flags(parser)
    assert (parser.parse_args([]).log_format, parser.parse_args([]).log_level) == ("text", "debug")
    assert parser.parse_args(["--log-format=json"]).log_format == "json"
    help_text = parser.format_help()
    assert "[env GPUSLICE_LOG_FORMAT]" in help_text and "[env GPUSLICE_LOG_LEVEL]" in help_text


def test_bad_log_format_names_the_choices() -> None:
    with pytest.raises(ValueError, match="json, text"):
        gs_logging.configure(component="t", log_format="console")
