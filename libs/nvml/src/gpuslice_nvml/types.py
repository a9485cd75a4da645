"""Plain, immutable values the NVML interface returns.

Both backends build exactly these types, so callers never see a pynvml struct or a fake's
internals. Sizes are bytes unless a field name says otherwise (``memory_mib``); MIG placements are
counted in memory slices (eighths of the GPU on A100/H100/H200), as NVML counts them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: The environment variable that names the fake node's YAML config: read by ``--fake-nvml-config``
#: and by the fake's tools (fake.ctl, fake.workload, mock, the MPS stand-in, the fake nvidia-smi).
FAKE_NVML_CONFIG_ENV = "GPUSLICE_FAKE_NVML_CONFIG"

#: A GPU's compute time slice as ``nvidia-smi compute-policy --set-timeslice`` takes it, by the
#: names NVIDIA's DRA driver gives them (its ``timeSlicingConfig.interval``).
TIME_SLICES: dict[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


MIB = 1024 * 1024
GIB = 1024 * MIB

#: NVML's "no GPU/compute instance" value in event data and process records.
NO_INSTANCE_ID = 0xFFFFFFFF

#: How a caller names a device: a GPU index, a ``GPU-…`` UUID or a ``MIG-…`` UUID.
DeviceRef = int | str

#: ``NVML_DEVICE_MEMORY_LIMIT_MAX``: the hard limit that means "no limit" (clears a limit with a
#: soft limit of 0).
MEMORY_LIMIT_MAX = 0xFFFF_FFFF_FFFF_FFFF

#: The first driver release with driver memory partitioning by cgroup
#: (``nvmlDeviceSetMemoryLimits_v1``) and MPS protocol 3 (CUDA 13.4).
MEMORY_PARTITIONING_MIN_DRIVER = 615


def driver_major(version: str) -> int:
    """The release number of a driver version string: ``"615.10.02"`` -> 615 (0 if unparsable)."""
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


@dataclass(frozen=True, slots=True)
class SystemInfo:
    """Driver-wide facts (``nvmlSystemGetDriverVersion`` / ``…GetCudaDriverVersion``)."""

    driver_version: str
    #: As NVML encodes it: 12040 means CUDA 12.4.
    cuda_driver_version: int

    @property
    def cuda_version(self) -> str:
        """The CUDA driver API version as ``major.minor`` ("12.4")."""
        major, rest = divmod(self.cuda_driver_version, 1000)
        return f"{major}.{rest // 10}"


@dataclass(frozen=True, slots=True)
class MigMode:
    """Current and pending MIG mode; they differ until the GPU is reset."""

    current: bool
    pending: bool

    @property
    def reset_required(self) -> bool:
        """True while a mode change waits for a GPU reset to take effect."""
        return self.current != self.pending


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One physical GPU. ``mig_mode`` is read when the info is built; the rest never changes."""

    index: int
    minor: int
    uuid: str
    #: ``nvmlDeviceGetName``, e.g. "NVIDIA H100 80GB HBM3".
    name: str
    #: go-nvlib's brand string ("Nvidia", "Tesla", ...).
    brand: str
    #: go-nvlib's architecture string ("Ampere", "Hopper", "Ada Lovelace", "Turing", ...).
    architecture: str
    cuda_compute_capability: tuple[int, int]
    multiprocessors: int
    memory_total_bytes: int
    #: Lower-case, 4-digit PCI domain: "0000:18:00.0" (the Kubernetes ``pciBusID`` format).
    pci_bus_id: str
    #: ``device << 16 | vendor``, e.g. 0x233010DE.
    pci_device_id: int
    #: The PCIe root complex ("pci0000:17"), when known.
    pcie_root: str | None
    numa_node: int | None
    mig_capable: bool
    #: ``None`` when the GPU cannot do MIG.
    mig_mode: MigMode | None
    #: ``nvmlDeviceGetAddressingMode`` on coherent-memory systems: "ATS", "HMM" or "None"
    #: (supported, inactive); ``None`` where the platform or driver does not support it.
    addressing_mode: str | None = None

    @property
    def memory_total_mib(self) -> int:
        return self.memory_total_bytes // MIB

    @property
    def cuda_compute_capability_str(self) -> str:
        major, minor = self.cuda_compute_capability
        return f"{major}.{minor}"

    @property
    def mig_enabled(self) -> bool:
        return self.mig_mode is not None and self.mig_mode.current


class TopologyLevel(enum.IntEnum):
    """``nvmlDeviceGetTopologyCommonAncestor`` levels: the closest PCIe ancestor two GPUs share."""

    INTERNAL = 0
    SINGLE = 10
    MULTIPLE = 20
    HOSTBRIDGE = 30
    NODE = 40
    SYSTEM = 50

    @property
    def label(self) -> str:
        """The ``nvidia-smi topo -m`` abbreviation (X, PIX, PXB, PHB, NODE, SYS)."""
        return _TOPOLOGY_LABELS[self]


_TOPOLOGY_LABELS = {
    TopologyLevel.INTERNAL: "X",
    TopologyLevel.SINGLE: "PIX",
    TopologyLevel.MULTIPLE: "PXB",
    TopologyLevel.HOSTBRIDGE: "PHB",
    TopologyLevel.NODE: "NODE",
    TopologyLevel.SYSTEM: "SYS",
}


@dataclass(frozen=True, slots=True)
class GpuLink:
    """How two GPUs reach each other: PCIe ancestor level and the NVLinks between them."""

    level: TopologyLevel
    nvlinks: int

    @property
    def label(self) -> str:
        """As ``nvidia-smi topo -m`` prints it: ``NV18`` when NVLinked, else the PCIe level."""
        if self.level is TopologyLevel.INTERNAL:
            return "X"
        return f"NV{self.nvlinks}" if self.nvlinks else self.level.label


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """Where an instance sits: ``start`` and ``size`` in slices (memory slices for GPU
    instances, compute slices of the parent GPU instance for compute instances)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.end and other.start < self.end

    def __str__(self) -> str:
        return f"{self.start}:{self.size}"


@dataclass(frozen=True, slots=True)
class GpuInstanceProfile:
    """A GPU-instance profile as ``nvmlDeviceGetGpuInstanceProfileInfoV`` reports it."""

    #: Computed with go-nvlib's rule, e.g. "1g.10gb", "1g.10gb+me".
    name: str
    #: The NVML_GPU_INSTANCE_PROFILE_* enum the info was queried with.
    nvml_profile: int
    #: The driver's profile id (``info.id``), the one Create/Get calls take.
    id: int
    #: Compute slices (the "g" in the name).
    slice_count: int
    #: Memory slices one instance occupies (the placement size).
    memory_slices: int
    instance_count: int
    multiprocessors: int
    memory_mib: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_decoders: int
    ofa_engines: int
    p2p_supported: bool
    placements: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class ComputeInstanceProfile:
    """A compute-instance profile inside one GPU-instance profile."""

    #: e.g. "1c.3g.40gb", or the GPU-instance name when it spans the whole instance.
    name: str
    nvml_profile: int
    id: int
    gpu_instance_profile_id: int
    slice_count: int
    instance_count: int
    multiprocessors: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class GpuInstance:
    gpu_index: int
    id: int
    profile_id: int
    profile_name: str
    placement: Placement


@dataclass(frozen=True, slots=True)
class ComputeInstance:
    gpu_index: int
    gpu_instance_id: int
    id: int
    profile_id: int
    #: The MIG device's profile, e.g. "1c.3g.40gb" or "3g.40gb".
    profile_name: str
    placement: Placement
    #: The MIG device UUID (``MIG-…``) CUDA and the container runtime use.
    uuid: str


@dataclass(frozen=True, slots=True)
class MigDevice:
    """A MIG device: one compute instance inside one GPU instance, seen as a CUDA device."""

    uuid: str
    parent_uuid: str
    gpu_index: int
    gpu_instance_id: int
    compute_instance_id: int
    gpu_instance_profile_id: int
    compute_instance_profile_id: int
    #: "3g.40gb", or "1c.3g.40gb" for a compute instance smaller than its GPU instance.
    profile: str
    #: The GPU instance's placement in memory slices.
    placement: Placement
    memory_bytes: int
    multiprocessors: int


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total: int
    used: int
    free: int


@dataclass(frozen=True, slots=True)
class UtilizationRates:
    """``nvmlDeviceGetUtilizationRates``: percent of time busy over the last sample period."""

    gpu_percent: int
    memory_percent: int


class ComputeMode(enum.StrEnum):
    """A GPU's compute mode (``nvmlComputeMode_t``), by NVML's names.

    ``EXCLUSIVE_PROCESS`` lets one process at a time hold a context on the GPU; an MPS server
    counts as that one process, so every other CUDA process must go through it. ``PROHIBITED``
    lets no process create a context.
    """

    DEFAULT = "DEFAULT"
    EXCLUSIVE_THREAD = "EXCLUSIVE_THREAD"  # deprecated by NVIDIA; never set by gpuslice
    PROHIBITED = "PROHIBITED"
    EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"

    @property
    def nvml_value(self) -> int:
        return _COMPUTE_MODE_VALUES[self]

    @classmethod
    def from_nvml(cls, value: int) -> ComputeMode:
        for mode, number in _COMPUTE_MODE_VALUES.items():
            if number == value:
                return mode
        raise ValueError(f"unknown NVML compute mode {value}")


_COMPUTE_MODE_VALUES = {
    ComputeMode.DEFAULT: 0,
    ComputeMode.EXCLUSIVE_THREAD: 1,
    ComputeMode.PROHIBITED: 2,
    ComputeMode.EXCLUSIVE_PROCESS: 3,
}


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A compute process on a GPU or MIG device (``nvmlDeviceGetComputeRunningProcesses``)."""

    pid: int
    gpu_index: int
    #: The GPU or MIG device UUID the process runs on.
    device_uuid: str
    #: ``None`` where NVML cannot tell (unprivileged caller in MIG mode, Windows WDDM).
    used_memory_bytes: int | None
    gpu_instance_id: int | None
    compute_instance_id: int | None


@dataclass(frozen=True, slots=True)
class ProcessUtilization:
    """One ``nvmlDeviceGetProcessUtilization`` sample."""

    pid: int
    timestamp_us: int
    sm_percent: int
    memory_percent: int


class HealthEventKind(enum.StrEnum):
    XID = "xid"
    ECC_DOUBLE_BIT = "ecc-double-bit"
    ECC_SINGLE_BIT = "ecc-single-bit"
    #: The GPU stopped answering (NVML_ERROR_GPU_IS_LOST or a GpuUnavailableError event).
    GPU_LOST = "gpu-lost"


@dataclass(frozen=True, slots=True)
class HealthEvent:
    kind: HealthEventKind
    gpu_index: int
    gpu_uuid: str
    #: The XID code for XID events.
    xid: int | None = None
    #: Set when the event concerns one MIG instance; ``None`` means the whole GPU.
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    #: Seconds since the epoch when the backend saw the event.
    timestamp: float = 0.0


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """Memory partitioning limits of one cgroup on one GPU (``nvmlDeviceGetMemoryLimits_v1``).

    Below ``soft_limit`` memory is guaranteed; between soft and hard an allocation succeeds but
    may be evicted under contention; past ``hard_limit`` allocations fail with out-of-memory.
    No limit reads as soft 0 and hard :data:`MEMORY_LIMIT_MAX`.
    """

    #: The cgroup's full sysfs path, e.g. ``/sys/fs/cgroup/kubepods/pod…/…``.
    namespace: str
    soft_limit: int
    hard_limit: int
    #: Device memory the cgroup's processes use on the GPU now.
    current_used: int

    @property
    def limited(self) -> bool:
        return self.hard_limit != MEMORY_LIMIT_MAX or self.soft_limit != 0
