"""The node's devices as DRA sees them, discovered through the NVML interface.

Device model (docs/kubelet-plugin.md, "Device model"):

- ``gpu-<index>``: a whole GPU that is not in MIG mode. ``allowMultipleAllocations``; capacity
  ``cores`` (100, request policy default 100, range 1..100 step 1) and ``memory`` (bytes, rounded
  down to whole MiB; default all of it, range 1Mi..total step 1Mi). A claim that asks for no
  capacity consumes all of both, so it is exclusive.
- ``gpu-<index>-mig-<profile as DNS label>-<placement start>``: a MIG device. Static MIG (the
  default): the instances that exist on GPUs in MIG mode. Dynamic MIG: every possible placement
  of every profile, each consuming counters of the GPU's CounterSet ``gpu-<index>-counter-set``
  (``memory-slice-<i>`` per memory slice, ``compute-slices``, and ``<profile>-instances`` for
  profiles the driver allows fewer instances of than they have placements).
- Attributes are named like NVIDIA's driver (``type``, ``uuid``, ``productName``,
  ``addressingMode``, ...), so users' CEL selectors carry over; the standard
  ``resource.kubernetes.io/pciBusID``, ``pcieRoot`` and ``numaNode`` are set where known. A MIG
  device also carries NVIDIA's capacities: ``multiprocessors``, ``copyEngines``, ``decoders``,
  ``encoders``, ``jpegEngines``, ``ofaEngines`` (MIG devices are not shareable, so capacities
  without a request policy are fine there; a whole GPU carries only ``cores`` and ``memory``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuslice_api.quantity import MIB, format_bytes
from gpuslice_core.logging import get_logger
from gpuslice_draplugin import Pool
from gpuslice_kubelet_plugin.enforcer import GpuEnforcement
from gpuslice_nvml import GpuInfo, GpuInstanceProfile, MigDevice, Nvml, NvmlGpuLost, SystemInfo

log = get_logger(__name__)

STANDARD = "resource.kubernetes.io"
CORES = "cores"
MEMORY = "memory"
MEMORY_SLICES = 8

Attributes = dict[str, dict[str, Any]]


def dns_label(text: str) -> str:
    """``1g.10gb+me`` → ``1g-10gb-me``: lower case, runs of other characters become ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def semver(version: str) -> str | None:
    """A driver's version as strict semver: ``570.158.01`` → ``570.158.1``, ``12.8`` →
    ``12.8.0``; ``None`` when it has no numeric form."""
    parts = version.strip().split(".")
    if not parts or len(parts) > 3 or not all(p.isdigit() for p in parts):
        return None
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)


@dataclass(frozen=True)
class MigSpec:
    """What a MIG device is: its profile and placement, and for static MIG the live instance."""

    profile: str
    placement_start: int
    placement_size: int
    profile_id: int
    dynamic: bool
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True)
class Device:
    """One published device and what prepare needs to know about it."""

    name: str
    kind: str  # "gpu" | "mig"
    gpu_index: int
    gpu_uuid: str
    gpu_minor: int
    uuid: str  # the CUDA device: GPU-… or MIG-… (empty for a dynamic MIG placement)
    memory_bytes: int
    shareable: bool
    attributes: Attributes
    capacity: dict[str, dict[str, Any]]
    consumes_counters: tuple[dict[str, Any], ...] = ()
    mig: MigSpec | None = None

    def api(self, taints: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """The device as resource.k8s.io/v1 writes it, with its health taints."""
        out: dict[str, Any] = {"name": self.name, "attributes": self.attributes}
        if self.capacity:
            out["capacity"] = self.capacity
        if self.shareable:
            out["allowMultipleAllocations"] = True
        if self.consumes_counters:
            out["consumesCounters"] = list(self.consumes_counters)
        if taints:
            out["taints"] = list(taints)
        return out


@dataclass(frozen=True)
class CounterSet:
    name: str
    gpu_index: int
    counters: dict[str, int]

    def api(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "counters": {k: {"value": str(v)} for k, v in self.counters.items()},
        }


@dataclass(frozen=True)
class Inventory:
    devices: tuple[Device, ...] = ()
    counter_sets: tuple[CounterSet, ...] = ()
    gpus: tuple[GpuInfo, ...] = ()
    _by_name: dict[str, Device] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({d.name: d for d in self.devices})

    def get(self, name: str) -> Device | None:
        return self._by_name.get(name)

    def on_gpu(self, index: int) -> list[Device]:
        return [d for d in self.devices if d.gpu_index == index]

    def pool(self, taints: Callable[[Device], Sequence[dict[str, Any]]] = lambda _d: ()) -> Pool:
        """What the node's pool publishes: every device with its taints, the counter sets."""
        return Pool(
            devices=[d.api(taints(d)) for d in self.devices],
            shared_counters=[c.api() for c in self.counter_sets],
        )


def _gpu_attributes(gpu: GpuInfo, system: SystemInfo) -> Attributes:
    attrs: Attributes = {
        "type": {"string": "gpu"},
        "uuid": {"string": gpu.uuid},
        "index": {"int": gpu.index},
        "minor": {"int": gpu.minor},
        "productName": {"string": gpu.name},
        "brand": {"string": gpu.brand},
        "architecture": {"string": gpu.architecture},
        "multiprocessors": {"int": gpu.multiprocessors},
    }
    for name, raw in (
        ("cudaComputeCapability", gpu.cuda_compute_capability_str),
        ("driverVersion", system.driver_version),
        ("cudaDriverVersion", system.cuda_version),
    ):
        version = semver(raw)
        if version is not None:
            attrs[name] = {"version": version}
    if gpu.addressing_mode is not None:
        attrs["addressingMode"] = {"string": gpu.addressing_mode}
    attrs[f"{STANDARD}/pciBusID"] = {"string": gpu.pci_bus_id}
    if gpu.pcie_root:
        attrs[f"{STANDARD}/pcieRoot"] = {"string": gpu.pcie_root}
    if gpu.numa_node is not None:
        attrs[f"{STANDARD}/numaNode"] = {"int": gpu.numa_node}
    return attrs


def whole_gpu(gpu: GpuInfo, system: SystemInfo, enforcement: GpuEnforcement | None) -> Device:
    memory = gpu.memory_total_bytes // MIB * MIB
    attrs = _gpu_attributes(gpu, system)
    if enforcement:
        attrs["enforcement"] = {"string": enforcement.level}
        attrs["memoryEnforcement"] = {"string": enforcement.memory}
        attrs["coresEnforcement"] = {"string": enforcement.cores}
    capacity = {
        CORES: {
            "value": "100",
            "requestPolicy": {
                "default": "100",
                "validRange": {"min": "1", "max": "100", "step": "1"},
            },
        },
        MEMORY: {
            "value": format_bytes(memory),
            "requestPolicy": {
                "default": format_bytes(memory),
                "validRange": {"min": "1Mi", "max": format_bytes(memory), "step": "1Mi"},
            },
        },
    }
    return Device(
        name=f"gpu-{gpu.index}",
        kind="gpu",
        gpu_index=gpu.index,
        gpu_uuid=gpu.uuid,
        gpu_minor=gpu.minor,
        uuid=gpu.uuid,
        memory_bytes=memory,
        shareable=True,
        attributes=attrs,
        capacity=capacity,
    )


def _mig_attributes(
    gpu: GpuInfo, system: SystemInfo, profile: str, start: int, sms: int
) -> Attributes:
    attrs = _gpu_attributes(gpu, system)
    attrs.update(
        {
            "type": {"string": "mig"},
            "parentUUID": {"string": gpu.uuid},
            "profile": {"string": profile},
            "placementStart": {"int": start},
            "multiprocessors": {"int": sms},
        }
    )
    del attrs["uuid"]
    return attrs


def _mig_capacity(
    memory: int, sms: int, profile: GpuInstanceProfile | None
) -> dict[str, dict[str, Any]]:
    """NVIDIA's MIG capacities: memory, SMs and the GPU instance's engines."""
    capacity = {MEMORY: {"value": format_bytes(memory)}, "multiprocessors": {"value": str(sms)}}
    if profile is not None:
        engines = {
            "copyEngines": profile.copy_engines,
            "decoders": profile.decoders,
            "encoders": profile.encoders,
            "jpegEngines": profile.jpeg_decoders,
            "ofaEngines": profile.ofa_engines,
        }
        capacity.update({k: {"value": str(v)} for k, v in engines.items()})
    return capacity


def static_mig(
    gpu: GpuInfo,
    system: SystemInfo,
    mig: MigDevice,
    name: str,
    profile: GpuInstanceProfile | None,
) -> Device:
    attrs = _mig_attributes(gpu, system, mig.profile, mig.placement.start, mig.multiprocessors)
    attrs["uuid"] = {"string": mig.uuid}
    attrs["memorySlices"] = {"int": mig.placement.size}
    return Device(
        name=name,
        kind="mig",
        gpu_index=gpu.index,
        gpu_uuid=gpu.uuid,
        gpu_minor=gpu.minor,
        uuid=mig.uuid,
        memory_bytes=mig.memory_bytes,
        shareable=False,
        attributes=attrs,
        capacity=_mig_capacity(mig.memory_bytes, mig.multiprocessors, profile),
        mig=MigSpec(
            profile=mig.profile,
            placement_start=mig.placement.start,
            placement_size=mig.placement.size,
            profile_id=mig.gpu_instance_profile_id,
            dynamic=False,
            gpu_instance_id=mig.gpu_instance_id,
            compute_instance_id=mig.compute_instance_id,
        ),
    )


def counter_set_name(index: int) -> str:
    return f"gpu-{index}-counter-set"


def _limited(profile: GpuInstanceProfile) -> bool:
    return profile.instance_count < len(profile.placements)


def dynamic_mig(
    gpu: GpuInfo, system: SystemInfo, profiles: list[GpuInstanceProfile]
) -> tuple[list[Device], CounterSet | None]:
    """Every placement of every profile, consuming the GPU's counters."""
    if not profiles:
        return [], None
    set_name = counter_set_name(gpu.index)
    counters = {f"memory-slice-{i}": 1 for i in range(MEMORY_SLICES)}
    counters["compute-slices"] = max(p.slice_count for p in profiles)
    for p in profiles:
        if _limited(p):
            counters[f"{dns_label(p.name)}-instances"] = p.instance_count
    devices = []
    for p in profiles:
        for placement in p.placements:
            consumed = {f"memory-slice-{i}": 1 for i in range(placement.start, placement.end)}
            consumed["compute-slices"] = p.slice_count
            if _limited(p):
                consumed[f"{dns_label(p.name)}-instances"] = 1
            memory = p.memory_mib * MIB
            attrs = _mig_attributes(gpu, system, p.name, placement.start, p.multiprocessors)
            attrs["memorySlices"] = {"int": placement.size}
            devices.append(
                Device(
                    name=f"gpu-{gpu.index}-mig-{dns_label(p.name)}-{placement.start}",
                    kind="mig",
                    gpu_index=gpu.index,
                    gpu_uuid=gpu.uuid,
                    gpu_minor=gpu.minor,
                    uuid="",
                    memory_bytes=memory,
                    shareable=False,
                    attributes=attrs,
                    capacity=_mig_capacity(memory, p.multiprocessors, p),
                    consumes_counters=(
                        {
                            "counterSet": set_name,
                            "counters": {k: {"value": str(v)} for k, v in consumed.items()},
                        },
                    ),
                    mig=MigSpec(
                        profile=p.name,
                        placement_start=placement.start,
                        placement_size=placement.size,
                        profile_id=p.id,
                        dynamic=True,
                    ),
                )
            )
    return devices, CounterSet(set_name, gpu.index, counters)


def _static_names(gpu: GpuInfo, migs: list[MigDevice]) -> list[str]:
    names = [f"gpu-{gpu.index}-mig-{dns_label(m.profile)}-{m.placement.start}" for m in migs]
    for i, name in enumerate(names):  # two compute instances of one size in one GPU instance
        if names.count(name) > 1:
            names[i] = f"{name}-ci{migs[i].compute_instance_id}"
    return names


def discover(
    nvml: Nvml,
    *,
    dynamic_mig_enabled: bool = False,
    enforcement: Mapping[str, GpuEnforcement] | None = None,
    previous: Inventory | None = None,
) -> Inventory:
    """Build the inventory. A lost GPU keeps its devices from ``previous`` (if any), so a GPU
    that falls off the bus is tainted rather than silently unpublished."""
    system = nvml.system_info()
    devices: list[Device] = []
    counter_sets: list[CounterSet] = []
    gpus: list[GpuInfo] = []
    for index in range(nvml.device_count()):
        try:
            gpu = nvml.gpu(index)
            if gpu.mig_enabled:
                if dynamic_mig_enabled:
                    mig_devices, cset = dynamic_mig(gpu, system, nvml.gpu_instance_profiles(index))
                    devices += mig_devices
                    counter_sets += [cset] if cset else []
                else:
                    migs = sorted(nvml.mig_devices(index), key=lambda m: m.placement)
                    profiles = {p.id: p for p in nvml.gpu_instance_profiles(index)}
                    for mig, name in zip(migs, _static_names(gpu, migs), strict=True):
                        profile = profiles.get(mig.gpu_instance_profile_id)
                        devices.append(static_mig(gpu, system, mig, name, profile))
            else:
                level = (enforcement or {}).get(gpu.uuid)
                devices.append(whole_gpu(gpu, system, level))
            gpus.append(gpu)
        except NvmlGpuLost:
            kept = previous.on_gpu(index) if previous else []
            log.warning("GPU is lost; keeping its last known devices", gpu=index, kept=len(kept))
            devices += kept
            if previous:
                counter_sets += [c for c in previous.counter_sets if c.gpu_index == index]
                gpus += [g for g in previous.gpus if g.index == index]
    return Inventory(tuple(devices), tuple(counter_sets), tuple(gpus))
