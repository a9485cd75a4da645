"""Retry policies for Kubernetes API calls (tenacity).

Only ``TransientError`` is retried: exponential backoff with jitter, honouring a server's
Retry-After, bounded by time so a caller never hangs forever. Conflicts are not retried blindly:
``retry_on_conflict`` re-runs a whole read-modify-write function, which re-reads the object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import tenacity

from gpuslice_core.errors import TransientError
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import ConflictError, KubeError

T = TypeVar("T")
log = get_logger(__name__)


class _Wait(tenacity.wait.wait_base):
    """Exponential backoff with jitter, but never shorter than a server's Retry-After."""

    def __init__(self, initial: float, maximum: float) -> None:
        self._backoff = tenacity.wait_exponential_jitter(
            multiplier=initial, max=maximum, jitter=initial
        )

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        delay = float(self._backoff(retry_state))
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, KubeError) and exc.retry_after is not None:
            delay = max(delay, exc.retry_after)
        return delay


def _log_retry(retry_state: tenacity.RetryCallState) -> None:
    outcome = retry_state.outcome
    exc = outcome.exception() if outcome is not None else None
    sleep = retry_state.next_action.sleep if retry_state.next_action else 0.0
    log.warning(
        "kubernetes api call failed; retrying",
        call=getattr(retry_state.fn, "__qualname__", "?"),
        attempt=retry_state.attempt_number,
        retry_in_s=round(sleep, 3),
        error=str(exc),
    )


def api_retry(
    *,
    deadline: float = 60.0,
    initial: float = 0.2,
    maximum: float = 10.0,
    final: tuple[type[BaseException], ...] = (),
) -> tenacity.Retrying:
    """A ``Retrying`` for transient API failures, giving up after ``deadline`` seconds, or at
    once on the transient failures the caller counts as ``final``."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TransientError)
        & tenacity.retry_if_not_exception_type(final),
        wait=_Wait(initial, maximum),
        stop=tenacity.stop_after_delay(deadline),
        before_sleep=_log_retry,
        reraise=True,
    )


def call(
    fn: Callable[..., T],
    *args: Any,
    deadline: float = 60.0,
    final: tuple[type[BaseException], ...] = (),
    **kwargs: Any,
) -> T:
    """Call ``fn`` with ``api_retry``: transient errors (but ``final``) are retried until
    ``deadline``."""
    return api_retry(deadline=deadline, final=final)(fn, *args, **kwargs)


def retry_on_conflict(fn: Callable[[], T], *, attempts: int = 5, deadline: float = 60.0) -> T:
    """Run a read-modify-write ``fn`` again (it must re-read) when the write hits a conflict."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type((ConflictError, TransientError)),
        wait=_Wait(0.05, 2.0),
        stop=tenacity.stop_after_attempt(attempts) | tenacity.stop_after_delay(deadline),
        before_sleep=_log_retry,
        reraise=True,
    )
    return retrying(fn)
