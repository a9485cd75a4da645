"""Kubernetes API failures as gpuslice errors.

The kubernetes client raises ``ApiException`` (HTTP status + a ``Status`` body) and urllib3 raises
connection errors. ``from_api_exception`` turns both into the shared taxonomy so callers decide by
type: ``TransientError`` is retried with backoff; ``ConflictError`` means re-read and try again;
everything else is permanent and carries the API server's own message.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import urllib3

from gpuslice_core.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    GpusliceError,
    InvalidArgumentError,
    NotFoundError,
    TransientError,
)
from gpuslice_core.untrusted import UndecodableError, loads

if TYPE_CHECKING:
    from kubernetes.client.exceptions import ApiException

TRANSIENT_STATUSES = frozenset({0, 408, 429, 500, 502, 503, 504})


class KubeError(GpusliceError):
    """Mixin carried by every API failure: the HTTP status and the server's reason."""

    status: int = 0
    reason: str = ""
    retry_after: float | None = None


class KubeNotFoundError(KubeError, NotFoundError):
    """404: the object does not exist."""


class KubeAlreadyExistsError(KubeError, AlreadyExistsError):
    """409 AlreadyExists on create."""


class ConflictError(KubeError, FailedPreconditionError):
    """409 Conflict: the object changed since it was read; re-read and retry."""


class GoneError(KubeError, FailedPreconditionError):
    """410 Gone: a watch or list continuation is too old; list again."""


class KubeInvalidError(KubeError, InvalidArgumentError):
    """400/422: the API server refused the object; the message says which field and why."""


class KubeForbiddenError(KubeError):
    """401/403: the credentials are missing or lack RBAC permission."""


class UndecodableObjectError(KubeError, UndecodableError):
    """The API server's answer cannot be decoded: an object someone wrote nests too deep or
    holds a number out of range (``gpuslice_core.untrusted``). Retrying cannot help."""

    problem: str = ""
    """What is wrong with the JSON, without the request (``JSON nested deeper than ...``)."""


class KubeTransientError(KubeError, TransientError):
    """429, 5xx, timeouts and connection failures: retry with backoff."""


class KubeUnreachableError(KubeTransientError):
    """No connection to the API server at all: refused, no route, a name that does not resolve.

    Transient for a service (the API server restarts), but not for a command a person runs:
    kubectl says at once that the connection was refused, so ``RawApi(unreachable_is_final=
    True)`` gives up on it at the first attempt."""

    def __init__(self, message: str, *, server: str = "") -> None:
        super().__init__(message)
        self.server = server


def _status_message(body: str | bytes | None) -> tuple[str, str]:
    if not body:
        return "", ""
    try:
        status = loads(body)
    except UndecodableError:
        text = body.decode() if isinstance(body, bytes) else body
        return text.strip()[:500], ""
    if not isinstance(status, dict):
        return str(status)[:500], ""
    return str(status.get("message", "")), str(status.get("reason", ""))


def from_status(
    status: int, body: str | bytes | None, *, headers: dict[str, str] | None = None, what: str = ""
) -> KubeError:
    """Build the error for an HTTP ``status`` with a Kubernetes ``Status`` ``body``."""
    message, reason = _status_message(body)
    text = f"{what}: " if what else ""
    text += message or f"HTTP {status}"
    cls: type[KubeError]
    if status == 404:
        cls = KubeNotFoundError
    elif status == 409 and reason == "AlreadyExists":
        cls = KubeAlreadyExistsError
    elif status == 409:
        cls = ConflictError
    elif status == 410:
        cls = GoneError
    elif status in (400, 422):
        cls = KubeInvalidError
    elif status in (401, 403):
        cls = KubeForbiddenError
    elif status in TRANSIENT_STATUSES or status >= 500:
        cls = KubeTransientError
    else:
        cls = KubeError
    err = cls(text)
    err.status = status
    err.reason = reason
    retry_after = (headers or {}).get("Retry-After")
    if retry_after and retry_after.isdigit():
        err.retry_after = float(retry_after)
    return err


def from_exception(exc: BaseException, *, what: str = "") -> KubeError:
    """Translate a client or transport exception; the original is kept as ``__cause__``."""
    if isinstance(exc, KubeError):
        return exc
    if _is_api_exception(exc):
        headers = dict(exc.headers or {})
        err = from_status(int(exc.status or 0), exc.body, headers=headers, what=what)
        if not err.args[0].strip(": ") and exc.reason:
            err = type(err)(f"{what}: {exc.reason}" if what else str(exc.reason))
    elif (unreachable := _unreachable(exc)) is not None:
        server, reason = unreachable
        text = f"cannot connect to the API server at {server}: {reason}"
        err = KubeUnreachableError(f"{what}: {text}" if what else text, server=server)
    elif isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError):
        err = KubeTransientError(f"{what}: {type(exc).__name__}: {exc}" if what else str(exc))
    else:
        raise TypeError(f"not a Kubernetes API failure: {exc!r}") from exc
    err.__cause__ = exc
    return err


def _is_api_exception(exc: BaseException) -> TypeGuard[ApiException]:
    """Whether ``exc`` is the kubernetes client's ``ApiException``. Only that client raises
    one, so where it was never imported (``kubectl gpuslice``) nothing is, and this module does
    not import it (decision 15)."""
    module = sys.modules.get("kubernetes.client.exceptions")
    return module is not None and isinstance(exc, module.ApiException)


def _unreachable(exc: BaseException) -> tuple[str, str] | None:
    """(host:port, why) when ``exc`` is urllib3 failing to open a connection at all."""
    server = ""
    if isinstance(exc, urllib3.exceptions.MaxRetryError):
        pool = exc.pool
        if pool is not None:
            server = f"{pool.host}:{pool.port}"
        exc = exc.reason if exc.reason is not None else exc
    if not isinstance(exc, urllib3.exceptions.NewConnectionError):
        return None
    if not server:
        conn = getattr(exc, "conn", None)
        server = f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
    reason = str(exc).split("Failed to establish a new connection: ", 1)[-1]
    return server, reason
