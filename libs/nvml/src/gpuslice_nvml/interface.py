"""The one NVML interface every gpuslice service uses.

Two backends implement it: :class:`gpuslice_nvml.real.RealNvml` (libnvidia-ml through pynvml)
and :class:`gpuslice_nvml.fake.FakeNvml` (a simulated node). Callers get one from
:func:`gpuslice_nvml.open_nvml` and cannot tell them apart: same values, same error types with
the same NVML codes.

Conventions:

* GPUs are named by index (``gpu: int``); where a MIG device is also accepted the parameter is a
  :data:`~gpuslice_nvml.types.DeviceRef` (index, ``GPU-…`` or ``MIG-…`` UUID).
* An index outside ``range(device_count())`` raises ``NvmlInvalidArgument``; a UUID that names
  no device raises ``NvmlNotFound`` (what ``nvmlDeviceGetHandleBy*`` return).
* Calls on a GPU that fell off the bus raise ``NvmlGpuLost``. ``device_count()`` still counts it.
* MIG calls on a GPU that cannot do MIG raise ``NvmlNotSupported``; calls that need MIG mode on a
  GPU whose *current* mode is off raise ``NvmlNotSupported`` too (a pending mode does not count).
* Profile ids are the driver's ids (``info.id``: 19, 15, 14, 9, 5, 0 on A100/H100), never the
  NVML enums; :class:`~gpuslice_nvml.types.GpuInstanceProfile` carries both.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, Self

from gpuslice_nvml.types import (
    ComputeInstance,
    ComputeInstanceProfile,
    ComputeMode,
    DeviceRef,
    GpuInfo,
    GpuInstance,
    GpuInstanceProfile,
    GpuLink,
    HealthEvent,
    MemoryInfo,
    MemoryLimits,
    MigDevice,
    MigMode,
    Placement,
    ProcessInfo,
    ProcessUtilization,
    SystemInfo,
    UtilizationRates,
)


class EventWatch(Protocol):
    """Health events of a set of GPUs (an NVML event set), from its creation on.

    Watches XID critical errors, double-bit ECC errors and lost GPUs. A GPU that is already lost
    when the watch is created yields a ``GPU_LOST`` event at once instead of failing the watch.
    """

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPU indices the watch receives events for."""
        ...

    def wait(self, timeout_s: float) -> HealthEvent | None:
        """The next event, or ``None`` when ``timeout_s`` passes without one."""
        ...

    def close(self) -> None:
        """Free the event set; ``wait`` must not be called afterwards."""
        ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Nvml(Protocol):
    """NVML for one node. Not bound to a thread; safe to share between threads."""

    #: "real" or "fake".
    backend: str

    def close(self) -> None:
        """Release NVML (``nvmlShutdown``). The object must not be used afterwards."""
        ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- node and GPUs --------------------------------------------------------------------
    def system_info(self) -> SystemInfo:
        """Driver and CUDA driver versions."""
        ...

    def device_count(self) -> int:
        """Number of physical GPUs, lost ones included."""
        ...

    def gpu(self, index: int) -> GpuInfo:
        """One GPU, with its MIG mode as of now."""
        ...

    def gpus(self) -> list[GpuInfo]:
        """Every GPU in index order. Raises ``NvmlGpuLost`` if any is lost; to list the others,
        call :meth:`gpu` per index."""
        ...

    def memory_info(self, device: DeviceRef) -> MemoryInfo:
        """Framebuffer use of a GPU or a MIG device (its GPU instance's memory)."""
        ...

    def utilization(self, gpu: int) -> UtilizationRates:
        """GPU and memory busy percentages. ``NvmlNotSupported`` in MIG mode."""
        ...

    def topology(self, gpu_a: int, gpu_b: int) -> GpuLink:
        """PCIe common ancestor and NVLink count between two GPUs (INTERNAL for a GPU itself)."""
        ...

    # -- MIG ------------------------------------------------------------------------------
    def mig_mode(self, gpu: int) -> MigMode:
        """Current and pending MIG mode; ``NvmlNotSupported`` if the GPU cannot do MIG."""
        ...

    def set_mig_mode(self, gpu: int, enabled: bool) -> MigMode:
        """Request MIG on or off. The change is pending until :meth:`reset_gpu`; disabling
        while GPU instances exist raises ``NvmlInUse``."""
        ...

    def reset_gpu(self, gpu: int) -> MigMode:
        """Reset the GPU so a pending MIG mode takes effect (MIG instances do not survive).
        Raises ``NvmlInUse`` while processes run on it."""
        ...

    def gpu_instance_profiles(self, gpu: int) -> list[GpuInstanceProfile]:
        """The GPU-instance profiles the GPU offers, with their possible placements, smallest
        first as ``nvidia-smi mig -lgip`` lists them (slices, then memory, then NVML enum)."""
        ...

    def remaining_capacity(self, gpu: int, profile_id: int) -> int:
        """How many more instances of the profile fit next to the existing ones."""
        ...

    def gpu_instances(self, gpu: int) -> list[GpuInstance]:
        """Live GPU instances, by id."""
        ...

    def create_gpu_instance(
        self, gpu: int, profile_id: int, placement: Placement | None = None
    ) -> GpuInstance:
        """Create a GPU instance at ``placement`` (one of the profile's placements) or, without
        one, where the driver chooses. ``NvmlInsufficientResources`` when it does not fit,
        ``NvmlInvalidArgument`` for an unknown profile or a placement the profile lacks."""
        ...

    def destroy_gpu_instance(self, gpu: int, gpu_instance_id: int) -> None:
        """Destroy a GPU instance; ``NvmlInUse`` while it holds compute instances or
        processes, ``NvmlNotFound`` if there is no such instance."""
        ...

    def compute_instance_profiles(
        self, gpu: int, gpu_instance_id: int
    ) -> list[ComputeInstanceProfile]:
        """The compute-instance profiles of a live GPU instance (NVML needs the instance)."""
        ...

    def compute_instances(self, gpu: int, gpu_instance_id: int) -> list[ComputeInstance]:
        """Live compute instances of a GPU instance, by id."""
        ...

    def create_compute_instance(
        self, gpu: int, gpu_instance_id: int, profile_id: int
    ) -> ComputeInstance:
        """Create a compute instance (a MIG device) in a GPU instance."""
        ...

    def destroy_compute_instance(
        self, gpu: int, gpu_instance_id: int, compute_instance_id: int
    ) -> None:
        """Destroy a compute instance; ``NvmlInUse`` while processes run on it."""
        ...

    def mig_devices(self, gpu: int) -> list[MigDevice]:
        """Every MIG device (compute instance) of a GPU; empty when MIG is off."""
        ...

    # -- processes ------------------------------------------------------------------------
    def running_processes(self, device: DeviceRef) -> list[ProcessInfo]:
        """Compute processes on a GPU (all its MIG devices included) or on one MIG device."""
        ...

    def process_utilization(self, gpu: int, since_us: int = 0) -> list[ProcessUtilization]:
        """Per-process SM/memory utilization samples newer than ``since_us`` (microseconds
        since the epoch); empty when there are none. ``NvmlNotSupported`` in MIG mode."""
        ...

    def mps_processes(self, device: DeviceRef) -> list[ProcessInfo]:
        """Processes with an MPS client context on a GPU or MIG device
        (``nvmlDeviceGetMPSComputeRunningProcesses``). A process that bypassed the GPU's MPS
        server has a context of its own and is listed by :meth:`running_processes` instead;
        MPS clients have no per-process utilization (their server has)."""
        ...

    # -- compute mode ---------------------------------------------------------------------
    def compute_mode(self, gpu: int) -> ComputeMode:
        """The GPU's compute mode (``nvmlDeviceGetComputeMode``)."""
        ...

    def set_compute_mode(self, gpu: int, mode: ComputeMode) -> None:
        """Set the GPU's compute mode (``nvmlDeviceSetComputeMode``; root). Contexts that
        exist keep running; the mode applies to contexts created afterwards. It does not
        survive a driver reload or a reboot."""
        ...

    def set_compute_time_slice(self, gpu: int, level: int) -> None:
        """Set how long each process's work runs on the GPU before the next one's when they
        time-share it: 0 default, 1 short, 2 medium, 3 long (:data:`~gpuslice_nvml.types.
        TIME_SLICES`). NVML has no call for it: ``nvidia-smi compute-policy -i <UUID>
        --set-timeslice=<level>`` (root), as NVIDIA's DRA driver runs it. It does not survive
        a driver reload or a reboot."""
        ...

    # -- memory partitioning (driver 615+) ------------------------------------------------
    def set_memory_limits(self, gpu: int, namespace: str, soft_limit: int, hard_limit: int) -> None:
        """Limit the device memory of the processes of one cgroup on a GPU
        (``nvmlDeviceSetMemoryLimits_v1``). ``namespace`` is the cgroup's full sysfs path (a
        cgroup v2 directory). Soft 0 with hard :data:`~gpuslice_nvml.types.MEMORY_LIMIT_MAX`
        clears the limits; removing the cgroup clears them too.

        Raises ``NvmlFunctionNotFound`` on drivers older than 615 (the capability probe),
        ``NvmlNotSupported`` on a GPU in MIG mode or for a cgroup outside a cgroup v2 hierarchy,
        ``NvmlNotFound`` for a cgroup that does not exist, ``NvmlInvalidArgument`` for a
        relative path or soft > hard, ``NvmlNoPermission`` unless root."""
        ...

    def memory_limits(self, gpu: int, namespace: str) -> MemoryLimits:
        """The limits of one cgroup on a GPU and what its processes use
        (``nvmlDeviceGetMemoryLimits_v1``); the same errors as :meth:`set_memory_limits`."""
        ...

    # -- health ---------------------------------------------------------------------------
    def watch_events(self, gpus: Sequence[int] | None = None) -> EventWatch:
        """Start receiving health events of ``gpus`` (all GPUs when ``None``)."""
        ...
