"""``/healthz`` and ``/readyz`` over HTTP, for the kubelet's ``httpGet`` probes.

A probe that execs a command starts an interpreter in the container each time (0.5 to 1.8 s and
48 to 78 MB on a loaded node); an HTTP GET costs the serving process a fraction of a millisecond.
Every long-running node service serves both paths on ``--health-addr``
(``GPUSLICE_HEALTH_ADDR``; empty turns it off), a port of its own next to ``--metrics-addr``:

- ``/healthz`` (liveness): the process's serving loop is alive — its gRPC server answers its
  own health check, its worker threads run. A failure restarts the container.
- ``/readyz`` (readiness, and start-up): what the service's ``--probe`` flag checks, e.g. the
  sockets served end to end. A failure only takes the container out of readiness.

Each check returns the problems it found (empty: healthy). It runs in a worker thread and the
answer waits at most ``timeout`` seconds for it: a check stuck on a lock answers 503 instead
of hanging the probe, and while it stays stuck no second copy is started (every probe answers
503, naming the age of the stuck run). 200 carries ``ok``; 503 one problem a line. Only GET
and HEAD are served (405 otherwise), only those two paths (404 otherwise).

    server = HealthServer(":9410", live=grpc_serving(socket), ready=app.ready).start()
    ...
    server.stop()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpuslice_core.logging import get_logger
from gpuslice_core.metrics import parse_addr

log = get_logger(__name__)

#: A check: the problems it found, none when healthy.
Check = Callable[[], Iterable[str]]

#: Seconds a probe waits for its check: under the chart's timeoutSeconds (1 at the least).
DEFAULT_TIMEOUT = 0.8


class BoundedCheck:
    """A check run in a worker thread and waited for at most ``timeout`` seconds.

    While a run is still going (stuck on a lock, a hung call) no second one starts: the caller
    gets a problem naming how long it has been running. A check that raises reports the error.
    """

    def __init__(self, name: str, check: Check, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.name = name
        self.check = check
        self.timeout = timeout
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None
        self._started = 0.0
        self._result: list[str] = []
        self._done = threading.Event()

    def _run(self) -> None:
        try:
            result = [str(p) for p in self.check()]
        except Exception as exc:  # a check's bug is a failed check, not a dead server
            result = [f"{self.name}: check failed: {type(exc).__name__}: {exc}"]
        with self._lock:
            self._result = result
            self._running = None
        self._done.set()

    def __call__(self) -> list[str]:
        with self._lock:
            if self._running is not None:
                age = time.monotonic() - self._started
                return [f"{self.name}: the previous check has been running for {age:.1f}s"]
            self._done.clear()
            self._started = time.monotonic()
            self._running = threading.Thread(
                target=self._run, name=f"health-{self.name}", daemon=True
            )
            self._running.start()
        if not self._done.wait(self.timeout):
            return [f"{self.name}: check did not answer within {self.timeout:g}s"]
        with self._lock:
            return list(self._result)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    allowed: ClassVar[str] = "GET, HEAD"

    def _answer(self, *, body: bool) -> None:
        check = self.server.checks.get(self.path.split("?", 1)[0])
        if check is None:
            self._send(HTTPStatus.NOT_FOUND, "not found: /healthz or /readyz\n", body=body)
            return
        problems = check()
        if problems:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, "".join(f"{p}\n" for p in problems), body)
        else:
            self._send(HTTPStatus.OK, "ok\n", body=body)

    def _send(self, status: HTTPStatus, text: str, body: bool, allow: bool = False) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        if allow:
            self.send_header("Allow", self.allowed)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _refuse(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "only GET and HEAD\n", body=True, allow=True)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:
        """Probes every few seconds are not worth a log line each."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    checks: dict[str, BoundedCheck]


class HealthServer:
    """``/healthz`` (``live``) and ``/readyz`` (``ready``) on ``addr``, in a daemon thread."""

    def __init__(
        self,
        addr: str,
        *,
        live: Check,
        ready: Check,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.addr = addr
        self._host, self._port = parse_addr(addr, flag="--health-addr")
        self.checks = {
            "/healthz": BoundedCheck("healthz", live, timeout),
            "/readyz": BoundedCheck("readyz", ready, timeout),
        }
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> HealthServer:
        server = _Server((self._host, self._port), _Handler)
        server.checks = self.checks
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="health", daemon=True
        )
        self._thread.start()
        log.info("health served", addr=self.addr, port=self.port)
        return self

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server else self._port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def serve(addr: str, *, live: Check, ready: Check) -> HealthServer | None:
    """A started server on ``addr``, or None when ``addr`` is empty (turned off)."""
    return HealthServer(addr, live=live, ready=ready).start() if addr else None


class GrpcServing:
    """The grpc.health.v1 service behind a unix socket answers SERVING: a check.

    The channel stays open between healthy calls (a probe reuses the connection), so a check
    is one small unary call; a failed call drops it, so the next probe dials afresh instead of
    waiting out gRPC's reconnect backoff (a server that starts or restarts is seen at once).
    """

    def __init__(self, socket: Path, service: str = "", timeout: float = 0.5) -> None:
        self.socket = Path(socket)
        self.service = service
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()

    def _stub(self) -> health_pb2_grpc.HealthStub:
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(f"unix://{self.socket}")
            return health_pb2_grpc.HealthStub(self._channel)

    def __call__(self) -> list[str]:
        try:
            reply = self._stub().Check(
                health_pb2.HealthCheckRequest(service=self.service), timeout=self.timeout
            )
        except grpc.RpcError as exc:
            self.close()
            return [f"grpc.health.v1 on {self.socket}: {exc.code().name}"]
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return [f"grpc.health.v1 on {self.socket}: {status}"]
        return []

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


def threads_alive(
    threads: Callable[[], Sequence[threading.Thread | None]],
) -> Callable[[], list[str]]:
    """A check that every started thread ``threads()`` names is alive (None: not started)."""

    def check() -> list[str]:
        return [
            f"thread {t.name} has died" for t in threads() if t is not None and not t.is_alive()
        ]

    return check


def combine(*checks: Check) -> Callable[[], list[str]]:
    """Every problem of every check, in order."""

    def check() -> list[str]:
        return [problem for c in checks for problem in c()]

    return check
