"""gRPC over unix sockets: server lifecycle, the error interceptor, health, graceful stop.

Every gpuslice socket (kubelet registration, DRA, device plugin, enforcer, mig-manager) is served
by a ``UnixGrpcServer``: it clears a stale socket left by a killed predecessor, binds, registers
the standard ``grpc.health.v1.Health`` service, maps domain errors to gRPC statuses in one place
(``ErrorInterceptor``), and on stop marks itself NOT_SERVING, lets in-flight calls finish within a
grace period and removes its socket files.

Streams (a watch, ``Health.Watch``) hold a worker thread for as long as they are open. Every
server gives them a budget of their own (``max_streams``, 16 unless a service says otherwise) —
that many threads more, and a refusal (``RESOURCE_EXHAUSTED``, naming the cap) for a stream past
it (``StreamBudget``) — so open streams never starve unary calls, whoever opens them (the health
service's ``Watch`` streams exist on every server). ``socket_mode`` (0600) and ``dir_mode``
(0755) set the socket's and a created socket directory's modes explicitly, whatever the
process's umask: every gpuslice socket's clients run as root (kubelet, the hook, our services).
"""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpuslice_core.errors import GpusliceError
from gpuslice_core.files import make_dirs
from gpuslice_core.logging import get_logger

log = get_logger(__name__)

AddServicer = Callable[[Any, grpc.Server], None]

#: Streams a server serves at once unless its service says otherwise.
DEFAULT_MAX_STREAMS = 16


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    if context.code() not in (None, grpc.StatusCode.OK):  # type: ignore[attr-defined]
        return  # the servicer called context.abort() itself: keep its code and details
    if isinstance(exc, GpusliceError):
        log.info("rpc failed", method=method, code=exc.grpc_code.name, error=str(exc))
        context.abort(exc.grpc_code, str(exc))
    log.exception("rpc crashed", method=method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns ``GpusliceError`` into its status code and anything else into INTERNAL.

    Servicers raise domain errors and never catch them; the caller sees the error's message as
    the status details. Unexpected exceptions are logged with their traceback.
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return inner_uu(request, context)
                except Exception as exc:
                    _abort(context, method, exc)
                    raise  # the servicer's own abort: its status is already set

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from inner_us(request, context)
                except Exception as exc:
                    _abort(context, method, exc)
                    raise

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


class StreamBudget(grpc.ServerInterceptor):
    """At most ``cap`` streaming calls at once — in all, or with ``per_method`` for each
    streaming method — and one more is refused with RESOURCE_EXHAUSTED, naming the cap."""

    def __init__(self, cap: int, server: str, *, per_method: bool = False) -> None:
        if cap < 1:
            raise ValueError(f"max_streams must be at least 1, got {cap}")
        self.cap = cap
        self.server = server
        self.per_method = per_method
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        with self._lock:
            return sum(self._open.values())

    def open_streams(self, method: str) -> int:
        with self._lock:
            return self._open[self._key(method)]

    def _key(self, method: str) -> str:
        return method if self.per_method else ""

    def _enter(self, context: grpc.ServicerContext, method: str) -> None:
        key = self._key(method)
        with self._lock:
            if self._open[key] < self.cap:
                self._open[key] += 1
                return
        log.info("stream refused", method=method, cap=self.cap)
        if self.per_method:
            message = (
                f"{self.server}: it serves at most {self.cap} streams of {method} at once, and "
                f"that many are open (max_streams={self.cap} per method); close one or retry later"
            )
        else:
            message = (
                f"{self.server}: {self.cap} streams are open, the most it serves at once "
                f"(max_streams={self.cap}); close one or retry later"
            )
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def _leave(self, method: str) -> None:
        with self._lock:
            self._open[self._key(method)] -= 1

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_stream is None:
            return handler  # unary calls are not counted; no service here streams requests
        inner = handler.unary_stream
        method: str = handler_call_details.method

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._enter(context, method)
            try:
                yield from inner(request, context)
            finally:
                self._leave(method)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _refuse_non_socket(path: Path) -> bool:
    """True if a socket sits at ``path``; raise if something else does (never replace it)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a unix socket; refusing to replace it")
    return True


def refuse_non_socket(path: Path) -> None:
    """Raise FileExistsError if something other than a unix socket sits at ``path``."""
    _refuse_non_socket(path)


def remove_stale_socket(path: Path) -> None:
    """Remove ``path`` if it is a socket; refuse to delete anything else that sits there."""
    if _refuse_non_socket(path):
        path.unlink(missing_ok=True)


class UnixGrpcServer:
    """One gRPC server listening on one or more unix sockets."""

    def __init__(
        self,
        sockets: Sequence[Path],
        *,
        name: str,
        max_workers: int = 8,
        max_streams: int = DEFAULT_MAX_STREAMS,
        stream_methods: int = 0,
        socket_mode: int = 0o600,
        dir_mode: int = 0o755,
        interceptors: Iterable[grpc.ServerInterceptor] = (),
    ) -> None:
        """``max_workers`` threads serve unary calls; ``max_streams`` more serve streams and a
        stream past them is refused (``StreamBudget``); with ``stream_methods``, the budget is
        per streaming method (that many of them, each with ``max_streams`` threads).
        ``socket_mode``: the sockets' mode; ``dir_mode``: the mode of socket directories this
        server creates (existing ones are left as they are)."""
        if not sockets:
            raise ValueError("UnixGrpcServer needs at least one socket path")
        self.sockets = [Path(s) for s in sockets]
        self.name = name
        self.health = health.HealthServicer()
        self.streams = StreamBudget(max_streams, name, per_method=stream_methods > 0)
        stream_threads = max_streams * max(1, stream_methods)
        self._socket_mode = socket_mode
        self._dir_mode = dir_mode
        self._server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=max_workers + stream_threads, thread_name_prefix=name
            ),
            interceptors=[ErrorInterceptor(), self.streams, *interceptors],
            options=[("grpc.so_reuseport", 0)],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._services: list[str] = []
        self._started = False
        self._inodes: dict[Path, int] = {}

    def add(self, add_servicer: AddServicer, servicer: Any, service_name: str) -> None:
        """Register a servicer; ``service_name`` is its full name, reported by health checks."""
        add_servicer(servicer, self._server)
        self._services.append(service_name)

    def start(self) -> None:
        """Bind every socket (replacing stale ones) and start serving.

        Each socket is bound at a private temporary name and renamed into place: the path
        changes hands atomically (a stale socket of a killed predecessor, or an older server's
        in a rolling update), and gRPC's own unlink at shutdown hits the temporary name, so a
        stopping server never deletes a successor's socket.
        """
        bound: list[tuple[Path, Path]] = []
        for index, path in enumerate(self.sockets):
            make_dirs(path.parent, self._dir_mode)
            _refuse_non_socket(path)
            temporary = path.parent / f".{os.getpid()}.{index}.s"
            temporary.unlink(missing_ok=True)
            if self._server.add_insecure_port(f"unix://{temporary}") == 0:
                raise OSError(f"{self.name}: cannot listen on unix socket {path}")
            temporary.chmod(self._socket_mode)  # bound, not listening yet: nobody is in
            bound.append((temporary, path))
        for temporary, path in bound:
            temporary.replace(path)
            self._inodes[path] = path.stat().st_ino
        self._server.start()
        self._started = True
        for service in ["", *self._services]:
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("grpc server started", server=self.name, sockets=[str(s) for s in self.sockets])

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting calls, let in-flight ones finish within ``grace``, remove sockets."""
        if self._started:
            self.health.enter_graceful_shutdown()
            self._server.stop(grace).wait()
            self._started = False
        for path in self.sockets:
            try:
                current = path.lstat().st_ino
            except FileNotFoundError:
                continue
            if current != self._inodes.get(path):
                # another server (a newer pod in a rolling update) bound this path since
                log.info("socket path now belongs to another server; left alone", path=str(path))
                continue
            try:
                remove_stale_socket(path)
            except FileExistsError:
                log.warning("socket path replaced by a non-socket; left alone", path=str(path))
        log.info("grpc server stopped", server=self.name)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server terminates; True if it did within ``timeout``."""
        return bool(self._server.wait_for_termination(timeout))


def check_health(socket: Path, service: str = "", timeout: float = 2.0) -> bool:
    """Ask the health service behind ``socket``; True when it answers SERVING.

    Used by probes, so they test the real socket end to end rather than a side port.
    """
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class StopSignals:
    """SIGTERM and SIGINT caught from the moment this is made (on the main thread).

    Make it before starting anything: a service that installs its handler only once it is
    running leaves a window, after it answers ready and before the handler, in which the
    kubelet's SIGTERM takes the default action and kills it mid-start (no lease released, no
    socket removed). A signal that arrives during start-up is kept, and ``wait`` returns at
    once. ``done``: set once a signal is seen; anything else that sets it ends the wait too
    (then: 0).

    The handler only appends to a list. It must take no lock: Python runs it in the main thread
    between two bytecodes, also while that thread holds ``done``'s own lock inside
    ``Event.wait``, so an ``Event.set`` there waits for itself forever (seen: a service that
    logged nothing after SIGTERM and was killed 20 s later, 8 in 400 stress starts under load).
    ``wait`` looks at the list every ``POLL_S`` instead, and sets ``done`` outside the handler.
    """

    POLL_S = 0.1

    def __init__(
        self,
        done: threading.Event | None = None,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        self.done = done or threading.Event()
        self._received: list[int] = []
        self._previous = {s: signal.signal(s, self._handler) for s in signals}

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        self._received.append(signum)  # nothing that takes a lock (see the class)

    @property
    def received(self) -> int:
        """The first signal received; 0 when none has been."""
        return self._received[0] if self._received else 0

    def wait(self) -> int:
        """Block until a signal (or ``done``); return the signal's number (0: none), and give
        the signals back to the handlers they had before."""
        try:
            while not self._received and not self.done.wait(self.POLL_S):
                pass
            self.done.set()
        finally:
            self.restore()
        return self.received

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
