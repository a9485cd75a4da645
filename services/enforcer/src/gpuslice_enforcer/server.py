"""The enforcer's sockets: the gRPC socket and, beside it, the attach socket for the CDI hook.

``grpc_server`` serves ``gpuslice.v1.Enforcer`` (kubelet plugin, controller) and
``gpuslice.v1.EnforcerContainers`` (the CDI hook's gRPC entry) with health on one unix socket.

``AttachSocketServer`` is ``EnforcerContainers`` for the CDI hook, without gRPC's start-up cost.
The hook runs once per container start and the runtime waits for it, so it must not import
grpc (≈ 70 ms; gpuslice_enforcer.hook). This socket, ``<gRPC socket>.attach``, carries the same
``AttachContainerRequest``/``DetachContainerRequest`` messages, framed by the hook's module
(``MAGIC``, method, length, message; the reply: status, length, text), and answers them with the
same ``ContainersServicer`` code as the gRPC service, so both entries behave alike: same
validation, same errors (a domain error's gRPC status code and message), same metrics.

Hostile or broken clients must not keep a valid hook waiting (docs/enforcer.md, "The attach
socket"). One thread accepts connections and reads every request without blocking (a selector):
a client that connects and sends nothing, or a byte now and then, costs a file descriptor and a
buffer, never a worker. Each connection has ``REQUEST_DEADLINE_S`` from its accept to its whole
request (a deadline per request, not per read); at most ``MAX_PENDING`` connections may still be
sending, and past that the one that has waited longest goes. Only complete requests reach the
worker pool, at most ``MAX_QUEUED`` of them at once. When accepting fails (out of file
descriptors), the loop gives up the oldest connection still sending if it has had
``EVICT_AFTER_S``, and otherwise stops accepting for a back-off that doubles up to
``ACCEPT_BACKOFF_S[1]``, logging one line per ``throttledlog.LOG_EVERY_S`` at most. Every error
text a client or the log gets is cut to ``MAX_TEXT`` characters (gpuslice_enforcer.hook).

The socket is bound at a temporary name, made 0600 and renamed into place, like the gRPC
sockets (gpuslice_core.grpcserver); something other than a socket at its path is refused, never
replaced. It is removed at stop only while it is still ours.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from gpuslice_core.errors import GpusliceError
from gpuslice_core.files import make_dirs
from gpuslice_core.grpcserver import UnixGrpcServer, refuse_non_socket, remove_stale_socket
from gpuslice_core.logging import get_logger
from gpuslice_enforcer.attachwire import (
    ATTACH_SUFFIX,
    MAGIC,
    MAX_TEXT,
    METHOD_ATTACH,
    METHOD_DETACH,
    STATUS_OK,
    bounded,
)
from gpuslice_enforcer.hook import attached_line
from gpuslice_enforcer.servicer import ContainersServicer, EnforcerServicer
from gpuslice_enforcer.throttledlog import Throttled
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc

log = get_logger(__name__)

#: The largest request accepted (a container's cgroup lines are a few hundred bytes).
MAX_REQUEST = 64 << 10
#: Time a connection has from its accept until its whole request is in.
REQUEST_DEADLINE_S = 5.0
#: Connections still sending their request, at most (each costs a descriptor and a buffer).
MAX_PENDING = 128
#: Complete requests waiting for, or held by, a worker, at most.
MAX_QUEUED = 64
#: The listen backlog (the kernel caps it at net.core.somaxconn).
BACKLOG = 1024
#: How long a worker may take to hand a reply to the client.
REPLY_TIMEOUT_S = 2.0
#: Out of file descriptors: a connection still sending after this long gives way to a new one.
EVICT_AFTER_S = 0.5
#: Back-off of the accept loop after an accept error: first, most.
ACCEPT_BACKOFF_S = (0.01, 1.0)

_HEADER = len(MAGIC) + 5
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


#: Threads for unary calls, and for streams (WatchViolations, Health.Watch); a stream past
#: MAX_STREAMS is refused with RESOURCE_EXHAUSTED, so open streams never starve unary calls.
MAX_WORKERS, MAX_STREAMS = 8, 16


def grpc_server(
    socket_path: Path, enforcer: EnforcerServicer, containers: ContainersServicer
) -> UnixGrpcServer:
    """The gRPC server of both services on ``socket_path``, not started (socket 0600, its
    directory 0755 whatever the umask)."""
    server = UnixGrpcServer(
        [socket_path],
        name="enforcer",
        max_workers=MAX_WORKERS,
        max_streams=MAX_STREAMS,
        socket_mode=0o600,
        dir_mode=0o755,
    )
    server.add(pb_grpc.add_EnforcerServicer_to_server, enforcer, "gpuslice.v1.Enforcer")
    server.add(
        pb_grpc.add_EnforcerContainersServicer_to_server,
        containers,
        "gpuslice.v1.EnforcerContainers",
    )
    return server


def attach_socket_for(grpc_socket: Path) -> Path:
    return grpc_socket.with_name(grpc_socket.name + ATTACH_SUFFIX)


class CallError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(bounded(message, MAX_TEXT))
        self.code = code


def reply_frame(status: int, text: str) -> bytes:
    data = bounded(text, 2 * MAX_TEXT).encode()  # a guard: CallError's text is cut already
    return bytes([status]) + len(data).to_bytes(4, "big") + data


@dataclass
class _Pending:
    """A connection whose request is not complete yet."""

    conn: socket.socket
    accepted: float
    data: bytearray = field(default_factory=bytearray)


class AttachSocketServer:
    def __init__(
        self,
        path: Path,
        servicer: ContainersServicer,
        max_workers: int = 8,
        *,
        request_deadline_s: float = REQUEST_DEADLINE_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.path = path
        self.servicer = servicer
        self.request_deadline_s = request_deadline_s
        self.max_pending = max_pending
        self._pool = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="attach")
        self._queued = 0
        self._queued_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._accepting = False
        self._resume_at = 0.0
        self._backoff = 0.0
        self._accept_failed = Throttled("attach socket cannot accept; backing off")
        self._dropped = Throttled("attach socket refused clients without a complete request")
        self._loop_failed = Throttled("attach socket loop failed")

    def start(self) -> None:
        make_dirs(self.path.parent, 0o755)
        refuse_non_socket(self.path)  # a planted file is refused, never replaced
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        remove_stale_socket(temporary)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(temporary))
        temporary.chmod(0o600)
        listener.listen(BACKLOG)
        listener.setblocking(False)
        temporary.replace(self.path)
        self._inode = self.path.stat().st_ino
        self._listener = listener
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._selector.register(listener, selectors.EVENT_READ)
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="attach-socket", daemon=True)
        self._thread.start()
        log.info("attach socket listening", socket=str(self.path))

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)  # the loop closes the listener and what it holds
        else:  # never started (start refused the path): nothing else to close
            self._selector.close()
            self._wake_r.close()
        self._pool.shutdown(wait=True)
        try:
            ours = self.path.lstat().st_ino == self._inode
        except FileNotFoundError:
            ours = False
        if ours:
            remove_stale_socket(self.path)
        self._wake_w.close()

    # -- the accept-and-read loop ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._turn()
                except Exception as exc:  # a bug here must not end the socket; nor spin silently
                    self._loop_failed(error=bounded(repr(exc), MAX_TEXT))
                    time.sleep(0.01)
        finally:
            for pending in list(self._pending.values()):
                self._close(pending)
            if self._listener is not None:
                self._listener.close()
            self._selector.close()
            self._wake_r.close()

    def _turn(self) -> None:
        for key, _ in self._selector.select(self._wait(time.monotonic())):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            elif key.fileobj is self._listener:
                self._accept()
            else:
                self._read(key.data)
        now = time.monotonic()
        self._expire(now)
        if not self._accepting and now >= self._resume_at and self._listener is not None:
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._accepting = True

    def _wait(self, now: float) -> float:
        """Seconds until the loop has something to do without a new event."""
        wake = now + 1.0
        if self._pending:
            oldest = next(iter(self._pending.values()))
            wake = min(wake, oldest.accepted + self.request_deadline_s)
        if not self._accepting:
            wake = min(wake, self._resume_at)
        return max(wake - now, 0.0)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if self._stopping.is_set():
                    return
                if exc.errno in _OUT_OF_DESCRIPTORS and self._evict(
                    "the enforcer is out of file descriptors", min_age=EVICT_AFTER_S
                ):
                    continue
                self._pause(exc)
                return
            self._backoff = 0.0
            if len(self._pending) >= self.max_pending:
                self._evict(f"{self.max_pending} connections were still sending their requests")
            conn.setblocking(False)
            pending = _Pending(conn, time.monotonic())
            self._pending[conn.fileno()] = pending
            self._selector.register(conn, selectors.EVENT_READ, pending)

    def _pause(self, exc: OSError) -> None:
        """Stop accepting for a back-off: the listener stays readable while the error lasts,
        and retrying at once would spin."""
        low, high = ACCEPT_BACKOFF_S
        self._backoff = min(max(self._backoff * 2, low), high)
        self._resume_at = time.monotonic() + self._backoff
        if self._accepting and self._listener is not None:
            self._selector.unregister(self._listener)
            self._accepting = False
        self._accept_failed(error=exc.strerror or str(exc), backoff_s=self._backoff)

    def _evict(self, why: str, min_age: float = 0.0) -> bool:
        """Give up the connection that has waited longest for its request; False if none has
        waited ``min_age``."""
        if not self._pending:
            return False
        oldest = next(iter(self._pending.values()))
        if time.monotonic() - oldest.accepted < min_age:
            return False
        self._refuse(
            oldest,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{why}; this one had waited longest",
        )
        return True

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if now - oldest.accepted < self.request_deadline_s:
                return
            self._refuse(
                oldest,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request was not complete within {self.request_deadline_s:g} s "
                f"(got {len(oldest.data)} bytes)",
            )

    def _read(self, pending: _Pending) -> None:
        try:
            chunk = pending.conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(pending)  # the client went away
            return
        data = pending.data
        if not chunk:
            got, wanted = len(data), _HEADER
            if got >= _HEADER:
                got, wanted = got - _HEADER, int.from_bytes(data[len(MAGIC) + 1 : _HEADER], "big")
            self._refuse(
                pending,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request cut short: connection closed after {got} of {wanted} bytes",
            )
            return
        data += chunk
        if data[: len(MAGIC)] != MAGIC[: len(data)]:
            self._refuse(pending, grpc.StatusCode.INVALID_ARGUMENT, "not a gpuslice hook request")
            return
        if len(data) < _HEADER:
            return
        size = int.from_bytes(data[len(MAGIC) + 1 : _HEADER], "big")
        if size > MAX_REQUEST:
            self._refuse(
                pending,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request of {size} bytes; at most {MAX_REQUEST}",
            )
            return
        if len(data) >= _HEADER + size:
            self._dispatch(pending, data[len(MAGIC)], bytes(data[_HEADER : _HEADER + size]))

    def _forget(self, pending: _Pending) -> None:
        if self._pending.pop(pending.conn.fileno(), None) is not None:
            self._selector.unregister(pending.conn)

    def _close(self, pending: _Pending) -> None:
        self._forget(pending)
        pending.conn.close()

    def _refuse(self, pending: _Pending, code: grpc.StatusCode, text: str) -> None:
        """Answer a connection that never made a complete request, and close it."""
        with contextlib.suppress(OSError):
            pending.conn.send(reply_frame(code.value[0], text))  # small: fits the buffer
        self._close(pending)
        self._dropped(code=code.name, reason=bounded(text, MAX_TEXT))

    def _dispatch(self, pending: _Pending, method: int, body: bytes) -> None:
        with self._queued_lock:
            full = self._queued >= MAX_QUEUED
            if not full:
                self._queued += 1
        if full:
            self._refuse(
                pending,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_QUEUED} attach calls are queued already; retry",
            )
            return
        self._forget(pending)
        self._pool.submit(self._serve, pending.conn, method, body)

    # -- the workers -------------------------------------------------------------------------
    def _serve(self, conn: socket.socket, method: int, body: bytes) -> None:
        try:
            with conn:
                try:
                    status, text = STATUS_OK, self.handle(method, body)
                except CallError as exc:
                    status, text = exc.code.value[0], str(exc)
                try:
                    conn.setblocking(True)
                    conn.settimeout(REPLY_TIMEOUT_S)
                    conn.sendall(reply_frame(status, text))
                except OSError as exc:
                    log.info("attach socket client went away before the reply", error=str(exc))
        finally:
            with self._queued_lock:
                self._queued -= 1

    def handle(self, method: int, body: bytes) -> str:
        try:
            if method == METHOD_ATTACH:
                request = pb.AttachContainerRequest.FromString(body)
                reply = self.servicer.attach(request)
                return attached_line(request.container_id, reply)
            if method == METHOD_DETACH:
                detach = pb.DetachContainerRequest.FromString(body)
                done = self.servicer.detach(detach).detached
                return f"{'detached' if done else 'was not attached:'} {detach.container_id}"
        except DecodeError as exc:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"bad message: {exc}") from None
        except GpusliceError as exc:
            error = CallError(exc.grpc_code, str(exc))
            log.info("attach socket call failed", code=exc.grpc_code.name, error=str(error))
            raise error from None
        except Exception as exc:
            log.exception("attach socket call crashed")
            raise CallError(
                grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
            ) from None
        raise CallError(grpc.StatusCode.UNIMPLEMENTED, f"method {method}")
