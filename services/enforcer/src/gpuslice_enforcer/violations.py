"""Violations (a limit breached, and what was done) and the bus that streams them."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpuslice_enforcer.state import Mechanism, PodRef


@dataclass(frozen=True)
class Violation:
    claim_uid: str
    share_id: str
    device_uuid: str
    pod: PodRef | None
    pid: int
    #: "memory" or "cores".
    resource: str
    observed: float
    limit: float
    #: "reported", "throttled", "killed" or "denied".
    action: str
    mechanism: Mechanism
    time: float
    message: str


class ViolationBus:
    """Fan-out of violations to every WatchViolations stream; nothing is replayed."""

    def __init__(self, max_queue: int = 1000) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[tuple[str | None, queue.Queue[Violation]]] = []
        self._max_queue = max_queue

    def publish(self, violation: Violation) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for claim_uid, q in subscribers:
            if claim_uid is None or claim_uid == violation.claim_uid:
                # a stream that does not read loses the news, not the enforcer
                with contextlib.suppress(queue.Full):
                    q.put_nowait(violation)

    def subscribe(self, claim_uid: str | None) -> queue.Queue[Violation]:
        q: queue.Queue[Violation] = queue.Queue(self._max_queue)
        with self._lock:
            self._subscribers.append((claim_uid, q))
        return q

    def unsubscribe(self, q: queue.Queue[Violation]) -> None:
        with self._lock:
            self._subscribers = [(c, s) for c, s in self._subscribers if s is not q]

    def stream(
        self,
        claim_uid: str | None,
        is_active: Callable[[], bool] = lambda: True,
        poll_s: float = 0.2,
    ) -> Iterator[Violation]:
        """Yield violations (of one claim, or all) until ``is_active()`` turns false."""
        q = self.subscribe(claim_uid)
        try:
            while is_active():
                try:
                    yield q.get(timeout=poll_s)
                except queue.Empty:
                    continue
        finally:
            self.unsubscribe(q)
