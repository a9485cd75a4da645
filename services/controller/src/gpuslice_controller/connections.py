"""What one client of the webhook server may hold: a place among a bounded number of
connections, and time — per phase of a connection, not per read.

The webhook port is reachable from the whole cluster network and its review paths need no
credentials, so a client that connects and sends nothing, or one byte at a time, must not keep
a thread and a socket for long, and many of them must not lock the API server out. Each open
connection is registered here with its phase and a deadline (``Limits``):

* ``handshake``: the TLS handshake;
* ``idle``: between requests of a kept-alive connection (longer than the API server's own idle
  timeout for webhook connections, so it is the client that closes them);
* ``request``: from a request's first byte to its last body byte — a whole request, so a
  client trickling a byte every few seconds is cut off like a silent one;
* ``response``: working out the answer and writing it (a client that does not read it);
* ``watch``: a streamed answer (a watch of the aggregated API), which ends on its own first;
* ``closing``: after the last answer, reading what the client still sends until it closes too
  (``server._linger``).

The handler's reads and writes wait only for what is left of the phase (``server``), so it
notices a deadline itself and can answer 408. A reaper thread is the backstop:
``Limits.reap_grace_s`` after a deadline it shuts the connection down (``SHUT_RDWR``),
whatever the handler is blocked in. At most ``Limits.connections`` are open, and at most
``Limits.per_client`` from one address (pod-to-pod traffic keeps its source address through a
Service), so one client cannot take every place from the API server: a new connection beyond
either takes the place of the longest-idle kept-alive connection (its client's own, at the
per-client cap), or is closed at once when every such place is busy (each busy one ends
within its deadline).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge

from gpuslice_core.logging import get_logger
from gpuslice_core.metrics import Subsystem, metric_name

log = get_logger(__name__)

#: Refusals and cuts are logged at most this often, with their counts since.
LOG_EVERY_S = 10.0

OPEN = Gauge(
    metric_name(Subsystem.CONTROLLER, "webhook_connections"),
    "Open connections of the HTTPS server.",
)
CLOSED = PromCounter(
    metric_name(Subsystem.CONTROLLER, "webhook_connections_closed_total"),
    "Connections the HTTPS server closed on its own, by reason (refused: at the connection cap "
    "with every place busy; evicted: the longest-idle one, for a new connection; "
    "handshake, idle, request, response, closing: past that phase's deadline).",
    ["reason"],
)


@dataclass(frozen=True)
class Limits:
    """What one client of the webhook server may take. The defaults are what the controller
    serves with (docs/controller.md, "The HTTPS server under hostile clients"); tests pass
    smaller ones."""

    connections: int = 128
    per_client: int = 32
    handshake_s: float = 10.0
    idle_s: float = 120.0
    request_s: float = 10.0
    response_s: float = 10.0
    watch_s: float = 1830.0
    """A streamed answer (a watch of the aggregated API, which ends itself after at most
    ``AggregatedApi.max_watch_s``: 1800 s)."""
    closing_s: float = 0.5
    """Reading what a client still sends after the server's last answer, before closing."""
    reap_grace_s: float = 1.0
    """How long after a deadline the reaper cuts a connection whose handler has not."""
    request_line: int = 8 * 1024
    header_line: int = 8 * 1024
    header_count: int = 64
    header_bytes: int = 32 * 1024
    """The request line and every header line together."""
    body: int = 3 * 1024 * 1024
    """The API server's request limit; no AdmissionReview is larger."""
    body_slots: int = 8
    """Requests reading a body at once (each up to ``body``): the memory a flood of bodies
    can take."""

    def seconds(self, phase: str) -> float:
        """The time a connection has for ``phase`` (handshake, idle, request, response,
        closing)."""
        seconds: float = getattr(self, f"{phase}_s")
        return seconds


class Connection:
    """One open connection: its socket (the raw one, then the TLS one), phase and deadline."""

    def __init__(
        self, sock: socket.socket, client: str, limits: Limits, clock: Callable[[], float]
    ) -> None:
        self.sock = sock
        self.client = client
        self._limits = limits
        self._clock = clock
        self.phase = "handshake"
        self.since = clock()
        self.deadline = self.since + limits.handshake_s

    def enter(self, phase: str) -> None:
        # The deadline first: the reaper, reading without the handler's order, may pair the
        # new deadline with the old phase (a count under the wrong reason at worst), never an
        # old, passed deadline with the new phase.
        now = self._clock()
        self.deadline = now + self._limits.seconds(phase)
        self.phase, self.since = phase, now

    def remaining(self) -> float:
        return max(0.0, self.deadline - self._clock())

    def cut(self) -> None:
        """Shut the connection down under its reader (the plain socket call, also for a TLS
        socket: the TLS layer is left to the thread that owns it). Only called with the
        registry's lock held, and a handler releases its place before closing its socket, so
        the file descriptor cut is never one reused by another connection."""
        with contextlib.suppress(OSError, ValueError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)


class Connections:
    """The open connections of one server, within ``limits``, and the reaper that cuts those
    ``limits.reap_grace_s`` past their deadline (it looks every ``tick`` seconds)."""

    def __init__(
        self,
        limits: Limits,
        *,
        tick: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._tick = tick
        self._clock = clock
        self._open: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._reap, name="webhook-reaper", daemon=True)
        self._unlogged: Counter[str] = Counter()
        self._logged_at = -LOG_EVERY_S

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def admit(self, sock: socket.socket, client: str) -> Connection | None:
        """Register a new connection from address ``client``; None when it must be closed
        (every place it could take is busy)."""
        with self._lock:
            mine = [c for c in self._open.values() if c.client == client]
            if len(mine) >= self.limits.per_client and not self._make_room(mine):
                return None
            if len(self._open) >= self.limits.connections and not self._make_room(
                list(self._open.values())
            ):
                return None
            conn = Connection(sock, client, self.limits, self._clock)
            self._open[id(conn)] = conn
            OPEN.set(len(self._open))
            return conn

    def _make_room(self, pool: list[Connection]) -> bool:
        """Cut the longest-idle connection of ``pool`` (lock held); False, and the new one
        counted as refused, when none of them is idle."""
        idle = [c for c in pool if c.phase == "idle"]
        if not idle:
            self._closed("refused")
            return False
        oldest = min(idle, key=lambda c: c.since)
        del self._open[id(oldest)]
        oldest.cut()
        self._closed("evicted")
        return True

    def release(self, conn: Connection) -> None:
        with self._lock:
            self._open.pop(id(conn), None)
            OPEN.set(len(self._open))

    def expired(self, conn: Connection) -> None:
        """The handler found ``conn`` past its deadline and closes it: count it (once) by
        its phase and give up its place."""
        with self._lock:
            if self._open.pop(id(conn), None) is not None:
                self._closed(conn.phase)
            OPEN.set(len(self._open))

    def _closed(self, reason: str) -> None:
        """Count (and now and then log) a connection closed by the server (lock held)."""
        CLOSED.labels(reason).inc()
        self._unlogged[reason] += 1
        self._log_due()

    def _log_due(self) -> None:
        """One line with the counts since the last, if there are any and the last line is
        ``LOG_EVERY_S`` old (lock held)."""
        now = self._clock()
        if not self._unlogged or now - self._logged_at < LOG_EVERY_S:
            return
        log.warning(
            "webhook connections closed by the server",
            open=len(self._open),
            cap=self.limits.connections,
            **dict(self._unlogged),
        )
        self._unlogged.clear()
        self._logged_at = now

    def reap(self) -> int:
        """Cut every connection ``reap_grace_s`` past its deadline, and log counts held back;
        how many were cut."""
        now = self._clock()
        with self._lock:
            late = [c for c in self._open.values() if c.deadline + self.limits.reap_grace_s <= now]
            for conn in late:
                del self._open[id(conn)]
                self._closed(conn.phase)
                conn.cut()
            OPEN.set(len(self._open))
            self._log_due()
        return len(late)

    def _reap(self) -> None:
        while not self._stop.wait(self._tick):
            self.reap()
