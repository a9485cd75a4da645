"""Structured logs for every gpuslice service, in the shape Kubernetes components write.

One line per event on stdout. ``--log-format=json`` (the default) writes the keys of klog's JSON
format (``k8s.io/component-base/logs/json``) so that the ``jq`` filters written for the
kubelet's or the API server's logs work on ours::

    {"ts": 1764212400123.456, "level": "info", "msg": "prepared",
     "logger": "gpuslice_kubelet_plugin.state", "component": "kubelet-plugin",
     "claim": {"name": "c", "namespace": "ns"}, "claim_uid": "…"}

- ``ts``: float milliseconds since the Unix epoch, as klog's JSON encoder writes it;
- ``level``: debug, info, warning or error (klog has ``v`` instead; we keep one string);
- ``msg``: the message; ``logger``: the Python logger (module); ``component``: the service;
- ``err``: the error's text (a call site's ``error=`` is written as ``err``, and an exception's
  ``Type: message``), ``stacktrace``: the traceback, never a frame's local variables;
- ``pod``, ``claim``, ``node``: objects as klog's ``KObj`` writes them,
  ``{"name": …, "namespace": …}`` (no namespace for a cluster-scoped object).

``--log-format=text`` renders colourless ``key=value`` lines for a developer's terminal. Both go
through the same processors: our own structlog loggers and the stdlib loggers of grpc, the
kubernetes client and urllib3 alike. Keys that name a credential (token, authorization, password,
secret, cookie, kubeconfig, headers, body) are redacted on every line, whatever a call site
passes, and so is any ``Bearer …`` in a value. Context bound with ``bind_contextvars`` (claim UID,
pod, device) appears on every line logged inside that context, which is how an RPC gets its
canonical log line. docs/logging.md has the reasons.
"""

from __future__ import annotations

import logging
import re
import sys
import time
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

import structlog
from structlog.typing import EventDict, Processor

from gpuslice_core.cli import pop_deprecation_notices

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "text")

#: What a redacted value is replaced by.
REDACTED = "[REDACTED]"

#: Keys whose values never reach a line: credentials, and whole request bodies and headers.
_SECRET_KEY = re.compile(
    r"token|authori[sz]ation|passw|secret|credential|cookie|api_?key|private_?key|kubeconfig"
    r"|^headers$|^body$",
    re.IGNORECASE,
)
#: A bearer token inside any string value (an error message that quotes a header).
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9\-._~+/=]+")

#: Keys that name a Kubernetes object, written as klog's KObj (``{"name", "namespace"}``).
OBJECT_KEYS = ("pod", "claim", "node", "template")


def kobj(namespace: str | None, name: str) -> dict[str, str]:
    """An object reference as klog's ``KObj``/``KRef`` writes it in JSON: ``{"name": name,
    "namespace": namespace}``, without ``namespace`` for a cluster-scoped object."""
    return {"name": name, "namespace": namespace} if namespace else {"name": name}


def _as_kobj(key: str, value: Any) -> Any:
    """``value`` as a KObj when it names an object: something with ``namespace`` and ``name``
    (ClaimRef, PodRef), a ``namespace/name`` string, or (``node``) a bare name."""
    if isinstance(value, str):
        namespace, slash, name = value.partition("/")
        if slash and namespace and name and "/" not in name:
            return kobj(namespace, name)
        return kobj(None, value) if key == "node" and value else value
    ref_namespace, ref_name = getattr(value, "namespace", None), getattr(value, "name", None)
    if isinstance(ref_namespace, str) and isinstance(ref_name, str):
        return kobj(ref_namespace, ref_name)
    return value


def object_refs(_logger: Any, _method: str, event: EventDict) -> EventDict:
    """Write ``pod``, ``claim``, ``node`` and ``template`` the way klog's KObj does."""
    for key in OBJECT_KEYS:
        if key in event:
            event[key] = _as_kobj(key, event[key])
    return event


def _is_kobj(value: Any) -> bool:
    """A reference made by :func:`kobj` (``secret=kobj(ns, name)`` names a Secret; it holds
    nothing of it)."""
    return (
        isinstance(value, dict)
        and "name" in value
        and value.keys() <= {"name", "namespace"}
        and all(isinstance(v, str) for v in value.values())
    )


def _hidden(key: Any, value: Any) -> bool:
    return isinstance(key, str) and bool(_SECRET_KEY.search(key)) and not _is_kobj(value)


def _scrub(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return _BEARER.sub(rf"\1 {REDACTED}", value) if "earer" in value else value
    if depth > 4:
        return value
    if isinstance(value, Mapping):
        return {k: REDACTED if _hidden(k, v) else _scrub(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v, depth + 1) for v in value]
    return value


def redact(_logger: Any, _method: str, event: EventDict) -> EventDict:
    """The backstop: no value under a credential's key, or a bearer token anywhere, is written
    (call sites should not pass them in the first place). A :func:`kobj` under such a key
    (``secret=kobj(namespace, name)``) is a reference and is kept."""
    for key in list(event):
        if _hidden(key, event[key]):
            event[key] = REDACTED
        else:
            event[key] = _scrub(event[key])
    return event


def _exception(exc_info: Any) -> BaseException | None:
    """The exception that ``exc_info`` (an exception, a ``sys.exc_info()`` tuple or true for
    the one being handled) names."""
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        return exc_info[1] if isinstance(exc_info[1], BaseException) else None
    return sys.exc_info()[1] if exc_info else None


def exceptions(_logger: Any, _method: str, event: EventDict) -> EventDict:
    """``exc_info`` as ``err`` (``Type: message``) and ``stacktrace`` (the standard library's
    traceback text, chained causes included: file, line and code of each frame, never its
    local variables, which is where request bodies and tokens live)."""
    exc = _exception(event.pop("exc_info", None))
    if exc is not None:
        event.setdefault("err", "".join(traceback.format_exception_only(exc)).strip())
        event["stacktrace"] = "".join(traceback.format_exception(exc)).rstrip()
    return event


def klog_keys(_logger: Any, _method: str, event: EventDict) -> EventDict:
    """``event`` → ``msg``, ``error`` → ``err``, and ``ts``, ``level``, ``msg``, ``logger``,
    ``component`` first on the line, then the rest."""
    if "error" in event:
        error = event.pop("error")
        event.setdefault("err", error)
    head = {key: event.pop(key) for key in ("ts", "level") if key in event}
    head["msg"] = event.pop("event", "")
    head.update({key: event.pop(key) for key in ("logger", "component") if key in event})
    head.update(event)
    return head


def _kobj_text(_logger: Any, _method: str, event: EventDict) -> EventDict:
    """Text format: an object as klog's text format writes it, ``namespace/name``."""
    for key, value in event.items():
        if _is_kobj(value):
            event[key] = "/".join(value[k] for k in ("namespace", "name") if k in value)
    return event


def _stacktrace_below(_logger: Any, _method: str, event: EventDict) -> EventDict:
    """Text format: the traceback on lines of its own under the line (ConsoleRenderer prints
    ``exception`` that way), not as one quoted value."""
    if "stacktrace" in event:
        event["exception"] = event.pop("stacktrace")
    return event


def _epoch_ms(_logger: Any, _method: str, event: EventDict) -> EventDict:
    record = event.get("_record")
    seconds = record.created if isinstance(record, logging.LogRecord) else time.time()
    event["ts"] = round(seconds * 1000, 3)
    return event


if TYPE_CHECKING:
    _TextStreamHandler = logging.StreamHandler[TextIO]
else:  # subscripted at run time from Python 3.11 on; kubectl gpuslice runs on 3.10 too
    _TextStreamHandler = logging.StreamHandler


class _StdoutHandler(_TextStreamHandler):
    """Writes to the ``sys.stdout`` of the moment, as ``logging.lastResort`` does for stderr.

    A handler that kept the stdout of configure() time would outlive it wherever stdout is
    swapped and closed later: a test that runs a service's ``main`` under pytest's capture left
    every later log line, from any thread, failing with "I/O operation on closed file".
    """

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, _stream: TextIO) -> None:
        """Ignored (StreamHandler's constructor sets it): the stream is always sys.stdout."""


def configure(
    *,
    component: str,
    level: str = "info",
    json: bool = True,
    log_format: str | None = None,
    stream: TextIO | None = None,
) -> None:
    """Route all logging to ``stream`` (default: whatever ``sys.stdout`` is when a line is
    written), tagged with ``component``.

    ``log_format`` (json or text; ``json=False`` is text too) picks klog-style JSON lines or
    colourless key=value lines for a terminal. Safe to call more than once (tests do); the last
    call wins. Whoever passes a ``stream`` must stop the threads that log before closing it.
    Writes a warning for each deprecated environment variable the flags were read from.
    """
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of: {', '.join(LEVELS)}")
    if log_format is not None:
        if log_format not in FORMATS:
            raise ValueError(f"log format {log_format!r} is not one of: {', '.join(FORMATS)}")
        json = log_format == "json"
    numeric = logging.getLevelName(level.upper())
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(
            colors=False,
            # the default (rich) formatter prints every frame's locals
            exception_formatter=structlog.dev.plain_traceback,
            event_key="msg",
            timestamp_key="ts",
            sort_keys=False,
        )
    )

    def add_component(_logger: Any, _method: str, event: EventDict) -> EventDict:
        # A static field, not a contextvar: lines from gRPC workers and reflector threads,
        # which do not inherit the main thread's context, carry it too.
        event.setdefault("component", component)
        return event

    shared: list[Processor] = [
        add_component,
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _epoch_ms if json else structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[
            *shared,
            # here, while the caller is still in its except block (exc_info=True)
            exceptions,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()

    handler = logging.StreamHandler(stream) if stream is not None else _StdoutHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                exceptions,
                object_refs,
                redact,
                klog_keys,
                *([] if json else [_kobj_text, _stacktrace_below]),
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # Third-party chatter below warning is noise in a node daemon's log (and the kubernetes
    # client's debug lines carry request and response bodies).
    for name in ("urllib3", "kubernetes", "grpc", "filelock"):
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
    # The old environment variable names the flags were read from (gpuslice_core.cli): logged
    # here because flags are parsed before logging exists, so each service gets them for free.
    for notice in pop_deprecation_notices():
        get_logger("gpuslice_core.cli").warning(
            notice.message, deprecated_env=notice.old, env=notice.new
        )


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    """Return a logger; ``initial`` key/values are bound to every line it writes."""
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name, **initial)
    return logger
