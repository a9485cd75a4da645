"""The attach socket's wire contract, shared by the hook (client) and the enforcer (server).

A request: ``MAGIC`` | method (``METHOD_ATTACH``/``METHOD_DETACH``) | u32 big-endian length |
the protobuf ``AttachContainerRequest``/``DetachContainerRequest``. A reply: status
(``STATUS_OK`` or the gRPC status code) | u32 big-endian length | UTF-8 text. See
docs/enforcer.md, "The CDI hook". Only built-in modules here: the hook imports this at every
container start.
"""

from __future__ import annotations

MAGIC = b"GSH1"
METHOD_ATTACH = 1
METHOD_DETACH = 2
STATUS_OK = 0
#: The attach socket's name: the gRPC socket's own (the link's target) plus this suffix.
ATTACH_SUFFIX = ".attach"
#: Largest reply the hook reads; a longer one is a protocol error.
MAX_REPLY = 1 << 16
#: Longest text the hook prints, and the attach socket sends or logs, for one error.
MAX_TEXT = 1024
#: gRPC status codes by number, for the gRPC fallback's and the attach socket's messages.
STATUS_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)


def bounded(text: str, limit: int = MAX_TEXT) -> str:
    """``text``, cut to ``limit`` characters (and saying so): no error message grows with what a
    client sent."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"
