"""The error taxonomy shared by every gpuslice service.

Two questions decide what happens to an error: can retrying help (``retryable``), and which gRPC
status tells a caller what went wrong (``grpc_status``, the name of a ``grpc.StatusCode``; the
``grpc_code`` attribute is that member). Domain code raises these types and chains library
exceptions as ``__cause__``; one interceptor (``gpuslice_core.grpcserver``) turns them into gRPC
statuses, so servicers carry no try/except noise. Retry loops (tenacity) retry only errors whose
``retryable`` is true.

This module does not import grpc: programs that never speak gRPC (kubectl gpuslice, a pure-Python
file for every platform: docs/cluster-view.md, "Installing") raise and catch these types too.
Reading ``grpc_code`` imports grpc, which only the gRPC layer does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import grpc


class _StatusCode:
    """``grpc_code``: the ``grpc.StatusCode`` named by the class's ``grpc_status``, looked up when
    read (on the class or an instance), so grpc is imported by the gRPC layer only."""

    def __get__(self, obj: object, owner: type[GpusliceError]) -> grpc.StatusCode:
        import grpc  # here, not at the top: see the module docstring

        return grpc.StatusCode[owner.grpc_status]


class GpusliceError(Exception):
    """Base of every error gpuslice raises on purpose."""

    grpc_status: ClassVar[str] = "INTERNAL"
    grpc_code: ClassVar[_StatusCode] = _StatusCode()
    retryable: bool = False


class InvalidArgumentError(GpusliceError):
    """Input that can never succeed as given: a bad field, value or name."""

    grpc_status = "INVALID_ARGUMENT"


class NotFoundError(GpusliceError):
    """The named object does not exist."""

    grpc_status = "NOT_FOUND"


class AlreadyExistsError(GpusliceError):
    """The object exists and the call would create it again with other content."""

    grpc_status = "ALREADY_EXISTS"


class FailedPreconditionError(GpusliceError):
    """The system is not in the state the call needs (MIG off, GPU in use, ...)."""

    grpc_status = "FAILED_PRECONDITION"


class ResourceExhaustedError(GpusliceError):
    """Not enough of something (GPU instances, memory slices, capacity) is left."""

    grpc_status = "RESOURCE_EXHAUSTED"


class UnsupportedError(GpusliceError):
    """The hardware, driver or cluster does not offer what was asked for."""

    grpc_status = "UNIMPLEMENTED"


class TransientError(GpusliceError):
    """A failure that may go away when retried after a delay (API server, timeouts)."""

    grpc_status = "UNAVAILABLE"
    retryable = True


class CorruptStateError(GpusliceError):
    """Persisted state cannot be trusted (bad checksum, unknown schema, torn file)."""

    grpc_status = "DATA_LOSS"
