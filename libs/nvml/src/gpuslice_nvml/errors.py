# ruff: noqa: N818 - the names mirror pynvml's NVMLError_* classes (NvmlNotSupported, ...)
"""NVML errors as gpuslice error types.

Every error the NVML layer raises is an :class:`NvmlError` that carries the NVML return code
(``code``) and its C name (``nvml_name``), and is *also* one of the shared gpuslice error types,
so callers decide on retry and gRPC status without knowing NVML: ``NvmlInsufficientResources``
is a :class:`~gpuslice_core.errors.ResourceExhaustedError`, ``NvmlInUse`` a
:class:`~gpuslice_core.errors.FailedPreconditionError`, and so on.

The real backend turns each ``pynvml.NVMLError`` into the class for its code with the pynvml
error as ``__cause__``; the fake backend raises the same classes with the codes NVML returns in
the same situation, so code written against the fake handles the real errors.
"""

from __future__ import annotations

from typing import ClassVar

from gpuslice_core.errors import (
    FailedPreconditionError,
    GpusliceError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TransientError,
    UnsupportedError,
)

# NVML return codes (nvml.h ``nvmlReturn_t``); pynvml exposes the same values as NVML_ERROR_*.
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_RESET_REQUIRED = 16
ERROR_LIB_RM_VERSION_MISMATCH = 18
ERROR_IN_USE = 19
ERROR_MEMORY = 20
ERROR_NO_DATA = 21
ERROR_INSUFFICIENT_RESOURCES = 23
ERROR_ARGUMENT_VERSION_MISMATCH = 25
ERROR_NOT_READY = 27
ERROR_GPU_NOT_FOUND = 28
ERROR_INVALID_STATE = 29
ERROR_UNKNOWN = 999

# What nvmlErrorString() says for each code (the text pynvml puts in str(error)).
_DESCRIPTIONS: dict[int, str] = {
    ERROR_UNINITIALIZED: "Uninitialized",
    ERROR_INVALID_ARGUMENT: "Invalid Argument",
    ERROR_NOT_SUPPORTED: "Not Supported",
    ERROR_NO_PERMISSION: "Insufficient Permissions",
    ERROR_NOT_FOUND: "Not Found",
    ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    ERROR_TIMEOUT: "Timeout",
    ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    ERROR_GPU_IS_LOST: "GPU is lost",
    ERROR_RESET_REQUIRED: "GPU requires restart",
    ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    ERROR_IN_USE: "In use by another client",
    ERROR_MEMORY: "Insufficient Memory",
    ERROR_NO_DATA: "No data",
    ERROR_INSUFFICIENT_RESOURCES: "Insufficient Resources",
    ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    ERROR_NOT_READY: "Not Ready",
    ERROR_GPU_NOT_FOUND: "GPU not found",
    ERROR_INVALID_STATE: "Invalid state",
    ERROR_UNKNOWN: "Unknown Error",
}


def has_description(code: int) -> bool:
    return code in _DESCRIPTIONS


def describe(code: int) -> str:
    """The NVML description of ``code`` ("Insufficient Resources"), or a generic one."""
    return _DESCRIPTIONS.get(code, f"NVML error {code}")


class NvmlError(GpusliceError):
    """Base of every NVML error; ``code`` is the NVML return code.

    Raised as-is for codes without a more precise class (its gRPC code is INTERNAL).
    """

    default_code: ClassVar[int] = ERROR_UNKNOWN
    nvml_name: ClassVar[str] = "NVML_ERROR_UNKNOWN"

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code: int = self.default_code if code is None else code

    @property
    def description(self) -> str:
        """NVML's own words for the code, e.g. "Insufficient Resources"."""
        return describe(self.code)


class NvmlUninitialized(NvmlError, FailedPreconditionError):
    default_code = ERROR_UNINITIALIZED
    nvml_name = "NVML_ERROR_UNINITIALIZED"


class NvmlInvalidArgument(NvmlError, InvalidArgumentError):
    default_code = ERROR_INVALID_ARGUMENT
    nvml_name = "NVML_ERROR_INVALID_ARGUMENT"


class NvmlNotSupported(NvmlError, UnsupportedError):
    default_code = ERROR_NOT_SUPPORTED
    nvml_name = "NVML_ERROR_NOT_SUPPORTED"


class NvmlNoPermission(NvmlError, FailedPreconditionError):
    default_code = ERROR_NO_PERMISSION
    nvml_name = "NVML_ERROR_NO_PERMISSION"
    grpc_status = "PERMISSION_DENIED"


class NvmlNotFound(NvmlError, NotFoundError):
    default_code = ERROR_NOT_FOUND
    nvml_name = "NVML_ERROR_NOT_FOUND"


class NvmlDriverNotLoaded(NvmlError, FailedPreconditionError):
    default_code = ERROR_DRIVER_NOT_LOADED
    nvml_name = "NVML_ERROR_DRIVER_NOT_LOADED"


class NvmlTimeout(NvmlError, TransientError):
    default_code = ERROR_TIMEOUT
    nvml_name = "NVML_ERROR_TIMEOUT"


class NvmlLibraryNotFound(NvmlError, FailedPreconditionError):
    default_code = ERROR_LIBRARY_NOT_FOUND
    nvml_name = "NVML_ERROR_LIBRARY_NOT_FOUND"


class NvmlFunctionNotFound(NvmlError, UnsupportedError):
    """The loaded libnvidia-ml lacks a function: the driver is older than the call needs."""

    default_code = ERROR_FUNCTION_NOT_FOUND
    nvml_name = "NVML_ERROR_FUNCTION_NOT_FOUND"


class NvmlGpuLost(NvmlError, FailedPreconditionError):
    """The GPU fell off the bus or stopped answering; only a reset or reboot brings it back."""

    default_code = ERROR_GPU_IS_LOST
    nvml_name = "NVML_ERROR_GPU_IS_LOST"


class NvmlResetRequired(NvmlError, FailedPreconditionError):
    default_code = ERROR_RESET_REQUIRED
    nvml_name = "NVML_ERROR_RESET_REQUIRED"


class NvmlVersionMismatch(NvmlError, FailedPreconditionError):
    """libnvidia-ml and the loaded kernel module differ (driver upgraded without reboot)."""

    default_code = ERROR_LIB_RM_VERSION_MISMATCH
    nvml_name = "NVML_ERROR_LIB_RM_VERSION_MISMATCH"


class NvmlInUse(NvmlError, FailedPreconditionError):
    """The object is busy: processes run on it, or it still holds compute/GPU instances."""

    default_code = ERROR_IN_USE
    nvml_name = "NVML_ERROR_IN_USE"


class NvmlInsufficientMemory(NvmlError, ResourceExhaustedError):
    default_code = ERROR_MEMORY
    nvml_name = "NVML_ERROR_MEMORY"


class NvmlNoData(NvmlError, NotFoundError):
    default_code = ERROR_NO_DATA
    nvml_name = "NVML_ERROR_NO_DATA"


class NvmlInsufficientResources(NvmlError, ResourceExhaustedError):
    """No room for the instance: slices taken, placement occupied or instance count reached."""

    default_code = ERROR_INSUFFICIENT_RESOURCES
    nvml_name = "NVML_ERROR_INSUFFICIENT_RESOURCES"


class NvmlArgumentVersionMismatch(NvmlError, UnsupportedError):
    default_code = ERROR_ARGUMENT_VERSION_MISMATCH
    nvml_name = "NVML_ERROR_ARGUMENT_VERSION_MISMATCH"


class NvmlNotReady(NvmlError, TransientError):
    default_code = ERROR_NOT_READY
    nvml_name = "NVML_ERROR_NOT_READY"


class NvmlGpuNotFound(NvmlError, NotFoundError):
    default_code = ERROR_GPU_NOT_FOUND
    nvml_name = "NVML_ERROR_GPU_NOT_FOUND"


class NvmlInvalidState(NvmlError, FailedPreconditionError):
    default_code = ERROR_INVALID_STATE
    nvml_name = "NVML_ERROR_INVALID_STATE"


_BY_CODE: dict[int, type[NvmlError]] = {
    cls.default_code: cls
    for cls in (
        NvmlUninitialized,
        NvmlInvalidArgument,
        NvmlNotSupported,
        NvmlNoPermission,
        NvmlNotFound,
        NvmlDriverNotLoaded,
        NvmlTimeout,
        NvmlLibraryNotFound,
        NvmlFunctionNotFound,
        NvmlGpuLost,
        NvmlResetRequired,
        NvmlVersionMismatch,
        NvmlInUse,
        NvmlInsufficientMemory,
        NvmlNoData,
        NvmlInsufficientResources,
        NvmlArgumentVersionMismatch,
        NvmlNotReady,
        NvmlGpuNotFound,
        NvmlInvalidState,
    )
}


def error_class(code: int) -> type[NvmlError]:
    """The :class:`NvmlError` subclass for an NVML return code (the base class if unmapped)."""
    return _BY_CODE.get(code, NvmlError)


def nvml_error(code: int, context: str, detail: str = "") -> NvmlError:
    """Build the error NVML's ``code`` means, worded ``"<context>: <description>[ (<detail>)]"``.

    Both backends word errors this way, so a log line reads the same whoever raised it.
    """
    message = f"{context}: {describe(code)}"
    if detail:
        message = f"{message} ({detail})"
    return error_class(code)(message, code=code)
