"""NVML errors are gpuslice errors carrying the NVML code."""

from __future__ import annotations

import grpc
import pytest

from gpuslice_core import errors as core
from gpuslice_nvml import errors as e


@pytest.mark.parametrize(
    ("code", "cls", "base", "status"),
    [
        (2, e.NvmlInvalidArgument, core.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
        (3, e.NvmlNotSupported, core.UnsupportedError, grpc.StatusCode.UNIMPLEMENTED),
        (6, e.NvmlNotFound, core.NotFoundError, grpc.StatusCode.NOT_FOUND),
        (10, e.NvmlTimeout, core.TransientError, grpc.StatusCode.UNAVAILABLE),
        (12, e.NvmlLibraryNotFound, core.FailedPreconditionError, None),
        (15, e.NvmlGpuLost, core.FailedPreconditionError, None),
        (19, e.NvmlInUse, core.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
        (
            23,
            e.NvmlInsufficientResources,
            core.ResourceExhaustedError,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
    ],
)
def test_code_maps_to_class(
    code: int, cls: type[e.NvmlError], base: type[Exception], status: grpc.StatusCode | None
) -> None:
    err = e.nvml_error(code, "nvmlSomething(GPU 0)", "detail")
    assert type(err) is cls
    assert isinstance(err, base)
    assert isinstance(err, e.NvmlError)
    assert err.code == code
    assert str(err) == f"nvmlSomething(GPU 0): {e.describe(code)} (detail)"
    if status is not None:
        assert err.grpc_code == status


def test_retryable_only_where_retry_helps() -> None:
    assert e.NvmlTimeout("x").retryable
    assert not e.NvmlInsufficientResources("x").retryable


def test_unmapped_code_is_the_base_class() -> None:
    err = e.nvml_error(777, "nvmlX")
    assert type(err) is e.NvmlError
    assert err.code == 777
    assert err.grpc_code == grpc.StatusCode.INTERNAL


def test_pynvml_codes_agree() -> None:
    import pynvml

    for name in ("INVALID_ARGUMENT", "NOT_SUPPORTED", "IN_USE", "INSUFFICIENT_RESOURCES"):
        assert getattr(e, f"ERROR_{name}") == getattr(pynvml, f"NVML_ERROR_{name}")
        assert e.error_class(getattr(e, f"ERROR_{name}")).nvml_name == f"NVML_ERROR_{name}"
