"""Structured JSON logs for every gpuslice service.

One line per event on stdout, one JSON shape for everything: our own structlog loggers and the
stdlib loggers of grpc, the kubernetes client and urllib3 all pass through the same processors.
Context bound with ``bind_contextvars`` (claim UID, pod, device) appears on every line logged
inside that context, which is how an RPC gets its canonical log line.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor

LEVELS = ("debug", "info", "warning", "error")

_SHARED: list[Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.processors.StackInfoRenderer(),
]


class _StdoutHandler(logging.StreamHandler[TextIO]):
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
    *, component: str, level: str = "info", json: bool = True, stream: TextIO | None = None
) -> None:
    """Route all logging to ``stream`` (default: whatever ``sys.stdout`` is when a line is
    written) as JSON lines tagged with ``component``.

    ``json=False`` renders colourless key=value lines for a developer's terminal. Safe to call
    more than once (tests do); the last call wins. Whoever passes a ``stream`` must stop the
    threads that log before closing it.
    """
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of: {', '.join(LEVELS)}")
    numeric = logging.getLevelName(level.upper())
    renderer: Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )

    def add_component(_logger: Any, _method: str, event: EventDict) -> EventDict:
        # A static field, not a contextvar: lines from gRPC workers and reflector threads,
        # which do not inherit the main thread's context, carry it too.
        event.setdefault("component", component)
        return event

    structlog.configure(
        processors=[
            add_component,
            *_SHARED,
            structlog.processors.dict_tracebacks if json else structlog.processors.format_exc_info,
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
            foreign_pre_chain=[add_component, *_SHARED],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.dict_tracebacks
                if json
                else structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # Third-party chatter below warning is noise in a node daemon's log.
    for name in ("urllib3", "kubernetes", "grpc", "filelock"):
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    """Return a logger; ``initial`` key/values are bound to every line it writes."""
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name, **initial)
    return logger
