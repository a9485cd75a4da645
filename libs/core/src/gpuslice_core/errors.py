"""The error taxonomy shared by every gpuslice service.

Two questions decide what happens to an error: can retrying help (``retryable``), and which gRPC
status tells a caller what went wrong (``grpc_code``). Domain code raises these types and chains
library exceptions as ``__cause__``; one interceptor (``gpuslice_core.grpcserver``) turns them into
gRPC statuses, so servicers carry no try/except noise. Retry loops (tenacity) retry only errors
whose ``retryable`` is true.
"""

from __future__ import annotations

import grpc


class GpusliceError(Exception):
    """Base of every error gpuslice raises on purpose."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: bool = False


class InvalidArgumentError(GpusliceError):
    """Input that can never succeed as given: a bad field, value or name."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(GpusliceError):
    """The named object does not exist."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(GpusliceError):
    """The object exists and the call would create it again with other content."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(GpusliceError):
    """The system is not in the state the call needs (MIG off, GPU in use, ...)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(GpusliceError):
    """Not enough of something (GPU instances, memory slices, capacity) is left."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnsupportedError(GpusliceError):
    """The hardware, driver or cluster does not offer what was asked for."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class TransientError(GpusliceError):
    """A failure that may go away when retried after a delay (API server, timeouts)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class CorruptStateError(GpusliceError):
    """Persisted state cannot be trusted (bad checksum, unknown schema, torn file)."""

    grpc_code = grpc.StatusCode.DATA_LOSS
