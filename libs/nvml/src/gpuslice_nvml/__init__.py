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
    ComputeInstance,
    ComputeInstanceProfile,
    DeviceRef,
    GpuInfo,
    GpuInstance,
    GpuInstanceProfile,
    GpuLink,
    HealthEvent,
    HealthEventKind,
    MemoryInfo,
    MigDevice,
    MigMode,
    Placement,
    ProcessInfo,
    ProcessUtilization,
    SystemInfo,
    TopologyLevel,
    UtilizationRates,
)

__all__ = [
    "ComputeInstance",
    "ComputeInstanceProfile",
    "DeviceRef",
    "EventWatch",
    "GpuInfo",
    "GpuInstance",
    "GpuInstanceProfile",
    "GpuLink",
    "HealthEvent",
    "HealthEventKind",
    "MemoryInfo",
    "MigDevice",
    "MigMode",
    "Nvml",
    "NvmlError",
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
    "nvml_from_args",
    "open_nvml",
]
