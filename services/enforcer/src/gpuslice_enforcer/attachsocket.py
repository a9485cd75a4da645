"""The attach socket: ``EnforcerContainers`` for the CDI hook, without gRPC's start-up cost.

The hook runs once per container start and the runtime waits for it, so it must not import
grpc (≈ 70 ms; gpuslice_enforcer.hook). This socket, ``<gRPC socket>.attach``, carries the same
``AttachContainerRequest``/``DetachContainerRequest`` messages, framed by the hook's module
(``MAGIC``, method, length, message; the reply: status, length, text), and answers them with the
same ``ContainersServicer`` code as the gRPC service, so both entries behave alike: same
validation, same errors (a domain error's gRPC status code and message), same metrics.

One thread accepts; each connection is served by a small thread pool and carries one call.
The socket is bound at a temporary name and renamed into place, like the gRPC sockets
(gpuslice_core.grpcserver), and removed at stop only while it is still ours.
"""

from __future__ import annotations

import socket
import threading
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from gpuslice_core.errors import GpusliceError
from gpuslice_core.grpcserver import remove_stale_socket
from gpuslice_core.logging import get_logger
from gpuslice_enforcer.hook import (
    ATTACH_SUFFIX,
    MAGIC,
    METHOD_ATTACH,
    METHOD_DETACH,
    STATUS_OK,
    attached_line,
    recv_exactly,
)
from gpuslice_enforcer.servicer import ContainersServicer
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb

log = get_logger(__name__)

#: The largest request accepted (a container's cgroup lines are a few hundred bytes).
MAX_REQUEST = 1 << 20
#: How long a connected client may take to send its request.
READ_TIMEOUT_S = 10.0


def attach_socket_for(grpc_socket: Path) -> Path:
    return grpc_socket.with_name(grpc_socket.name + ATTACH_SUFFIX)


class CallError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def read_request(conn: socket.socket) -> tuple[int, bytes]:
    """(method, message) of the one request a connection carries."""
    try:
        head = recv_exactly(conn, len(MAGIC) + 5)
        if head[: len(MAGIC)] != MAGIC:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, "not a gpuslice hook request")
        method, size = head[len(MAGIC)], int.from_bytes(head[len(MAGIC) + 1 :], "big")
        if size > MAX_REQUEST:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"request of {size} bytes")
        return method, recv_exactly(conn, size)
    except EOFError as exc:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"request cut short: {exc}") from None


class AttachSocketServer:
    def __init__(self, path: Path, servicer: ContainersServicer, max_workers: int = 8) -> None:
        self.path = path
        self.servicer = servicer
        self._pool = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="attach")
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        remove_stale_socket(temporary)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(temporary))
        temporary.chmod(0o600)
        listener.listen(64)
        temporary.replace(self.path)
        self._inode = self.path.stat().st_ino
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name="attach-socket", daemon=True)
        self._thread.start()
        log.info("attach socket listening", socket=str(self.path))

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=True)
        try:
            ours = self.path.lstat().st_ino == self._inode
        except FileNotFoundError:
            return
        if ours:
            remove_stale_socket(self.path)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("attach socket accept failed")
                continue
            self._pool.submit(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(READ_TIMEOUT_S)
            try:
                status, text = STATUS_OK, self.handle(conn)
            except CallError as exc:
                status, text = exc.code.value[0], str(exc)
            except OSError as exc:
                log.info("attach socket client went away", error=str(exc))
                return
            data = text.encode()
            try:
                conn.sendall(bytes([status]) + len(data).to_bytes(4, "big") + data)
            except OSError as exc:
                log.info("attach socket client went away before the reply", error=str(exc))

    def handle(self, conn: socket.socket) -> str:
        method, body = read_request(conn)
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
            log.info("attach socket call failed", code=exc.grpc_code.name, error=str(exc))
            raise CallError(exc.grpc_code, str(exc)) from None
        except Exception as exc:
            log.exception("attach socket call crashed")
            raise CallError(
                grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
            ) from None
        raise CallError(grpc.StatusCode.UNIMPLEMENTED, f"method {method}")
