"""Calls to another gpuslice service over its unix socket, with one error mapping.

The other half of ``grpcserver.ErrorInterceptor``: a server turns a ``GpusliceError`` into its
status code, and a client turns the code back into the error of that kind (``rpc_error``), so
the caller's retry decisions read the same types whichever service failed. A code the domain
does not raise (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, UNKNOWN, INTERNAL) is a
``TransientError``: the other side is restarting, overloaded or broken, and a later try may
work. The message names the service, the method, what it was for and the socket.

``UnixClient`` keeps one channel to the socket (gRPC reconnects it when the server restarts) and
puts a deadline on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from gpuslice_core.errors import (
    FailedPreconditionError,
    GpusliceError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TransientError,
    UnsupportedError,
)

#: Status codes that come back as the domain error that raised them; any other is transient.
DOMAIN_ERRORS: dict[grpc.StatusCode, type[GpusliceError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnsupportedError,
    )
}


def rpc_error(what: str, exc: grpc.RpcError) -> GpusliceError:
    """A failed call as a gpuslice error of its status code, the RpcError as its cause."""
    call: Any = exc  # a failed call's error is also its grpc.Call; the stubs cannot say so
    code = call.code() if hasattr(call, "code") else grpc.StatusCode.UNKNOWN
    details = call.details() if hasattr(call, "details") else str(exc)
    err = DOMAIN_ERRORS.get(code, TransientError)(f"{what}: {code.name}: {details}")
    err.__cause__ = exc
    return err


class UnixClient:
    """One gRPC service of another gpuslice process, over its unix socket.

    ``UnixClient(socket, "enforcer", pb_grpc.EnforcerStub, timeout=10).call("CreateShare",
    request, what=claim_uid)`` returns the reply or raises the ``GpusliceError`` of its status.
    ``wait_for_ready``: a call waits (within its deadline) for a server that is not up yet
    instead of failing at once.
    """

    def __init__(
        self,
        socket: Path,
        service: str,
        stub: Callable[[grpc.Channel], Any],
        *,
        timeout: float,
        wait_for_ready: bool = False,
    ) -> None:
        self.socket = socket
        self.service = service
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._stub = stub(self._channel)

    def call(self, method: str, request: Any, *, what: str = "") -> Any:
        try:
            return getattr(self._stub, method)(
                request, timeout=self.timeout, wait_for_ready=self.wait_for_ready
            )
        except grpc.RpcError as exc:
            purpose = f" for {what}" if what else ""
            raise rpc_error(f"{self.service} {method}{purpose} ({self.socket})", exc) from exc

    def stream(self, method: str, request: Any) -> Any:
        """A server stream with no deadline, waiting for the server to be up: iterate it for
        the replies (a ``grpc.RpcError`` when it ends abnormally), ``cancel()`` it to stop."""
        return getattr(self._stub, method)(request, wait_for_ready=True)

    def close(self) -> None:
        self._channel.close()
