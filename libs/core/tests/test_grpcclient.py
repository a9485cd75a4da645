"""One error mapping for every client: a status comes back as the domain error that raised it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpuslice_core.errors import (
    FailedPreconditionError,
    NotFoundError,
    TransientError,
)
from gpuslice_core.grpcclient import UnixClient
from gpuslice_core.grpcserver import UnixGrpcServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[UnixGrpcServer]:
    running = UnixGrpcServer([tmp_path / "s.sock"], name="probe")
    running.start()
    yield running
    running.stop(grace=0)


def test_a_domain_status_comes_back_as_its_error(server: UnixGrpcServer) -> None:
    client = UnixClient(server.sockets[0], "probe", health_pb2_grpc.HealthStub, timeout=5)
    try:
        reply = client.call("Check", health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(NotFoundError) as missing:  # the health service's NOT_FOUND
            client.call("Check", health_pb2.HealthCheckRequest(service="nope"), what="a test")
        assert str(missing.value).startswith(
            f"probe Check for a test ({server.sockets[0]}): NOT_FOUND"
        )
        assert not isinstance(missing.value, FailedPreconditionError)
    finally:
        client.close()


def test_a_server_that_is_not_there_is_transient(tmp_path: Path) -> None:
    client = UnixClient(tmp_path / "none.sock", "enforcer", health_pb2_grpc.HealthStub, timeout=1)
    try:
        with pytest.raises(TransientError, match=r"enforcer Check \(.*none.sock\): UNAVAILABLE"):
            client.call("Check", health_pb2.HealthCheckRequest())
    finally:
        client.close()
