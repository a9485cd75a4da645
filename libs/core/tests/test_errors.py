"""The error taxonomy: each type names its gRPC status, and importing it does not import grpc
(kubectl gpuslice raises these types without gRPC)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from gpuslice_core import errors


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (errors.GpusliceError, grpc.StatusCode.INTERNAL),
        (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
        (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
        (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.UnsupportedError, grpc.StatusCode.UNIMPLEMENTED),
        (errors.TransientError, grpc.StatusCode.UNAVAILABLE),
        (errors.CorruptStateError, grpc.StatusCode.DATA_LOSS),
    ],
)
def test_grpc_code_on_the_class_and_the_instance(
    cls: type[errors.GpusliceError], code: grpc.StatusCode
) -> None:
    assert cls.grpc_code is code
    assert cls("x").grpc_code is code
    assert cls.grpc_status == code.name


def test_a_subclass_names_its_own_status() -> None:
    class Denied(errors.FailedPreconditionError):
        grpc_status = "PERMISSION_DENIED"

    assert Denied("x").grpc_code is grpc.StatusCode.PERMISSION_DENIED
    assert errors.FailedPreconditionError.grpc_code is grpc.StatusCode.FAILED_PRECONDITION


def test_importing_the_errors_does_not_import_grpc() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, gpuslice_core.errors; print('grpc' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == "False"
