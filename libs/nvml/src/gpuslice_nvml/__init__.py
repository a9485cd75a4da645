"""One NVML interface for every gpuslice service: a real backend on nvidia-ml-py and a fake.

    from gpuslice_nvml import add_nvml_arguments, nvml_from_args

    add_nvml_arguments(parser)            # --nvml=real|fake, --fake-nvml-config PATH
    with nvml_from_args(parser.parse_args()) as nvml:
        for gpu in nvml.gpus():
            ...

See docs/nvml.md for the interface, the fake's config and how faithful the fake is.
"""

from gpuslice_nvml.errors import (
    NvmlError,
    NvmlFunctionNotFound,
    NvmlGpuLost,
    NvmlInsufficientMemory,
    NvmlInsufficientResources,
    NvmlInUse,
    NvmlInvalidArgument,
    NvmlLibraryNotFound,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlTimeout,
)
from gpuslice_nvml.interface import EventWatch, Nvml
from gpuslice_nvml.select import add_nvml_arguments, nvml_from_args, open_nvml
from gpuslice_nvml.types import (
    MEMORY_LIMIT_MAX,
    MEMORY_PARTITIONING_MIN_DRIVER,
    ComputeInstance,
    ComputeInstanceProfile,
    ComputeMode,
    DeviceRef,
    GpuInfo,
    GpuInstance,
    GpuInstanceProfile,
    GpuLink,
    HealthEvent,
    HealthEventKind,
    MemoryInfo,
    MemoryLimits,
    MigDevice,
    MigMode,
    Placement,
    ProcessInfo,
    ProcessUtilization,
    SystemInfo,
    TopologyLevel,
    UtilizationRates,
    driver_major,
)

__all__ = [
    "MEMORY_LIMIT_MAX",
    "MEMORY_PARTITIONING_MIN_DRIVER",
    "ComputeInstance",
    "ComputeInstanceProfile",
    "ComputeMode",
    "DeviceRef",
    "EventWatch",
    "GpuInfo",
    "GpuInstance",
    "GpuInstanceProfile",
    "GpuLink",
    "HealthEvent",
    "HealthEventKind",
    "MemoryInfo",
    "MemoryLimits",
    "MigDevice",
    "MigMode",
    "Nvml",
    "NvmlError",
    "NvmlFunctionNotFound",
    "NvmlGpuLost",
    "NvmlInUse",
    "NvmlInsufficientMemory",
    "NvmlInsufficientResources",
    "NvmlInvalidArgument",
    "NvmlLibraryNotFound",
    "NvmlNotFound",
    "NvmlNotSupported",
    "NvmlTimeout",
    "Placement",
    "ProcessInfo",
    "ProcessUtilization",
    "SystemInfo",
    "TopologyLevel",
    "UtilizationRates",
    "add_nvml_arguments",
    "driver_major",
    "nvml_from_args",
    "open_nvml",
]
