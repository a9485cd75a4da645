"""What one client of the webhook server may hold: a place among a bounded number of
connections, and time — per phase of a connection, not per read.

The webhook port is reachable from the whole cluster network and its review paths need no
credentials, so a client that connects and sends nothing, or one byte at a time, must not keep
a thread and a socket for long, and many of them must not lock the API server out. Each open
connection is registered here with its phase and a deadline:

* ``handshake``: the TLS handshake, ``HANDSHAKE_TIMEOUT``;
* ``idle``: between requests of a kept-alive connection, ``IDLE_TIMEOUT`` (longer than the API
  server's own idle timeout for webhook connections, so it is the client that closes them);
* ``request``: from a request's first line to its last body byte, ``REQUEST_TIMEOUT`` — a whole
  request, so a client trickling a byte every few seconds is cut off like a silent one.

A reaper thread shuts down (``SHUT_RDWR``) every connection past its deadline; the handler's
blocked read then ends and its thread with it. At most ``cap`` connections are open, and at
most ``per_client`` from one address (pod-to-pod traffic keeps its source address through a
Service), so one client cannot take every place from the API server: a new connection beyond
either takes the place of the longest-idle kept-alive connection (its client's own, at the
per-client cap), or is closed at once when every such place is in the middle of a request
(each of which ends within ``REQUEST_TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge

from gpuslice_core.logging import get_logger

log = get_logger(__name__)

HANDSHAKE_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0
REQUEST_TIMEOUT = 10.0
MAX_CONNECTIONS = 128
MAX_PER_CLIENT = 32
#: Refusals and cuts are logged at most this often, with their counts since.
LOG_EVERY_S = 10.0

OPEN = Gauge("gpuslice_controller_webhook_connections", "Open connections of the HTTPS server.")
CLOSED = PromCounter(
    "gpuslice_controller_webhook_connections_closed_total",
    "Connections the HTTPS server closed on its own, by reason (refused: at the connection cap "
    "with every place mid-request; evicted: the longest-idle one, for a new connection; "
    "handshake, idle, request: past that phase's deadline).",
    ["reason"],
)


class Connection:
    """One open connection: its socket (the raw one, under TLS), phase and deadline."""

    def __init__(self, sock: socket.socket, client: str, clock: Callable[[], float]) -> None:
        self.sock = sock
        self.client = client
        self._clock = clock
        self.phase = "handshake"
        self.since = clock()
        self.deadline = self.since + HANDSHAKE_TIMEOUT

    def enter(self, phase: str, seconds: float) -> None:
        self.phase, self.since = phase, self._clock()
        self.deadline = self.since + seconds

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
    """The open connections of one server, at most ``cap``, and the reaper that holds their
    deadlines (every ``tick`` seconds)."""

    def __init__(
        self,
        cap: int = MAX_CONNECTIONS,
        *,
        per_client: int = MAX_PER_CLIENT,
        tick: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap = cap
        self.per_client = per_client
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
        (every place it could take is in the middle of a request)."""
        with self._lock:
            mine = [c for c in self._open.values() if c.client == client]
            if len(mine) >= self.per_client and not self._make_room(mine):
                return None
            if len(self._open) >= self.cap and not self._make_room(list(self._open.values())):
                return None
            conn = Connection(sock, client, self._clock)
            self._open[id(conn)] = conn
            OPEN.set(len(self._open))
            return conn

    def _make_room(self, pool: list[Connection]) -> bool:
        """Cut the longest-idle connection of ``pool`` (lock held); False, and the new one
        counted as refused, when all of them are in the middle of a request."""
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

    def _closed(self, reason: str) -> None:
        """Count (and now and then log) a connection closed by the server (lock held)."""
        CLOSED.labels(reason).inc()
        self._unlogged[reason] += 1
        now = self._clock()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "webhook connections closed by the server",
                open=len(self._open),
                cap=self.cap,
                **dict(self._unlogged),
            )
            self._unlogged.clear()
            self._logged_at = now

    def reap(self) -> int:
        """Cut every connection past its deadline; how many were cut."""
        now = self._clock()
        with self._lock:
            late = [c for c in self._open.values() if c.deadline <= now]
            for conn in late:
                del self._open[id(conn)]
                self._closed(conn.phase)
                conn.cut()
            OPEN.set(len(self._open))
        return len(late)

    def _reap(self) -> None:
        while not self._stop.wait(self._tick):
            self.reap()
