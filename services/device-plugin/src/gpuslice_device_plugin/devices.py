"""Which devices this node offers under which resource names, as NVIDIA's plugin names them.

- MIG strategy ``none``: every GPU is one ``nvidia.com/gpu`` device, MIG mode or not.
- ``single``: every GPU must be in MIG mode with MIG devices of one profile; those devices are
  ``nvidia.com/gpu``. A node without MIG GPUs behaves as ``none``.
- ``mixed``: GPUs without MIG are ``nvidia.com/gpu``; MIG devices are
  ``nvidia.com/mig-<profile>`` (``+`` replaced by ``.``, e.g. ``mig-1g.10gb.me``).
- Device IDs are UUIDs (``GPU-…``, ``MIG-…``) or, with ``deviceIDStrategy: index``, ``<gpu>`` and
  ``<gpu>:<mig index>``.
- ``sharing.timeSlicing`` and ``sharing.mps`` give each device of a listed resource
  ``replicas`` IDs ``<id>::<n>`` (n from 0); with ``renameByDefault`` the resource is
  ``<name>.shared``. Time-slicing replicas share the GPU without limits; MPS replicas are
  equal shares the enforcer holds (whole GPUs only: a MIG device is refused, as NVIDIA does).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_device_plugin.config import Settings
from gpuslice_nvml import GpuInfo, MigDevice, Nvml

GPU_RESOURCE = "nvidia.com/gpu"
REPLICA_SEPARATOR = "::"


@dataclass(frozen=True)
class Device:
    """One device ID the kubelet sees."""

    id: str
    #: The GPU or MIG device behind it: its UUID and its index form (``3`` or ``3:1``).
    uuid: str
    index: str
    gpu_index: int
    minor: int
    numa_node: int | None
    #: Set for MIG devices: the GPU instance id (for health events on one instance).
    gpu_instance_id: int | None = None
    #: Set for time-slicing replicas.
    replica: int | None = None
    #: The GPU's UUID: ``uuid`` for a whole GPU, the parent's for a MIG device (how
    #: dcgm-exporter labels a MIG device's series).
    gpu_uuid: str = ""
    #: Set for MIG devices: the GPU instance's profile, e.g. ``1g.10gb``.
    profile: str = ""

    @property
    def visible(self) -> str:
        """What NVIDIA_VISIBLE_DEVICES and CDI names call the underlying device."""
        return self.id.split(REPLICA_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class Resource:
    name: str
    devices: tuple[Device, ...]
    replicas: int = 1
    fail_requests_greater_than_one: bool = False
    #: How the devices are shared: none, time-slicing or mps (NVIDIA's sharing-strategy words).
    sharing: str = "none"

    @property
    def socket_name(self) -> str:
        """``gpuslice-<name after the domain>.sock``, e.g. ``gpuslice-mig-1g.10gb.sock``."""
        return f"gpuslice-{self.name.split('/', 1)[1]}.sock"

    @property
    def whole_gpus(self) -> bool:
        return all(d.gpu_instance_id is None for d in self.devices)


class DiscoveryError(FailedPreconditionError):
    """The GPUs do not fit the configured MIG strategy; the message says which and why."""


def mig_resource(profile: str) -> str:
    return f"nvidia.com/mig-{profile.replace('+', '.')}"


def _gpu_device(gpu: GpuInfo, settings: Settings) -> Device:
    index = str(gpu.index)
    return Device(
        id=gpu.uuid if settings.device_id_strategy == "uuid" else index,
        uuid=gpu.uuid,
        index=index,
        gpu_index=gpu.index,
        minor=gpu.minor,
        numa_node=gpu.numa_node,
        gpu_uuid=gpu.uuid,
    )


def _mig_device(gpu: GpuInfo, mig: MigDevice, position: int, settings: Settings) -> Device:
    index = f"{gpu.index}:{position}"
    return Device(
        id=mig.uuid if settings.device_id_strategy == "uuid" else index,
        uuid=mig.uuid,
        index=index,
        gpu_index=gpu.index,
        minor=gpu.minor,
        numa_node=gpu.numa_node,
        gpu_instance_id=mig.gpu_instance_id,
        gpu_uuid=gpu.uuid,
        # "1c.3g.40gb" is a compute instance of a 3g.40gb GPU instance
        profile=mig.profile.split(".", 1)[1] if "c." in mig.profile else mig.profile,
    )


def discover(nvml: Nvml, settings: Settings) -> list[Resource]:
    """The node's resources, sorted by name; raises ``DiscoveryError`` for a bad MIG layout."""
    gpus = nvml.gpus()
    by_resource: dict[str, list[Device]] = defaultdict(list)
    strategy = settings.mig_strategy
    mig_gpus = [g for g in gpus if g.mig_enabled] if strategy != "none" else []
    if strategy == "single" and mig_gpus:
        plain = [g.index for g in gpus if not g.mig_enabled]
        if plain:
            raise DiscoveryError(
                f"migStrategy single needs every GPU in MIG mode; GPUs {plain} are not"
                " (use migStrategy mixed)"
            )
    for gpu in gpus:
        if gpu not in mig_gpus:
            by_resource[GPU_RESOURCE].append(_gpu_device(gpu, settings))
            continue
        migs = sorted(nvml.mig_devices(gpu.index), key=lambda m: (m.placement.start, m.uuid))
        if strategy == "single" and not migs:
            raise DiscoveryError(
                f"migStrategy single: GPU {gpu.index} is in MIG mode but has no MIG devices"
            )
        for position, mig in enumerate(migs):
            name = GPU_RESOURCE if strategy == "single" else mig_resource(mig.profile)
            by_resource[name].append(_mig_device(gpu, mig, position, settings))
    if strategy == "single":
        profiles = sorted({m.profile for g in mig_gpus for m in nvml.mig_devices(g.index)})
        if len(profiles) > 1:
            raise DiscoveryError(
                f"migStrategy single needs one MIG profile on every GPU; found {profiles}"
                " (use migStrategy mixed)"
            )
    return [
        _share(Resource(name, tuple(devices)), settings)
        for name, devices in sorted(by_resource.items())
    ]


def _share(resource: Resource, settings: Settings) -> Resource:
    ts, mps = settings.time_slicing, settings.mps
    sharing, wanted = (
        "time-slicing",
        next((r for r in ts.resources if r.name == resource.name), None),
    )
    rename, fail_many = ts.renameByDefault, ts.failRequestsGreaterThanOne
    if wanted is None:
        sharing, wanted = "mps", next((r for r in mps.resources if r.name == resource.name), None)
        rename, fail_many = mps.renameByDefault, mps.failRequestsGreaterThanOne
    if wanted is None:
        return resource
    if sharing == "mps" and not resource.whole_gpus:
        raise DiscoveryError(
            f"sharing.mps: {resource.name} is made of MIG devices; MPS shares whole GPUs only"
            " (a MIG device is isolated by MIG already)"
        )
    replicated = tuple(
        Device(
            id=f"{d.id}{REPLICA_SEPARATOR}{n}",
            uuid=d.uuid,
            index=d.index,
            gpu_index=d.gpu_index,
            minor=d.minor,
            numa_node=d.numa_node,
            gpu_instance_id=d.gpu_instance_id,
            replica=n,
            gpu_uuid=d.gpu_uuid,
            profile=d.profile,
        )
        for d in resource.devices
        for n in range(wanted.replicas)
    )
    name = f"{resource.name}.shared" if rename else resource.name
    return Resource(name, replicated, wanted.replicas, fail_many, sharing)


def unknown_shared_resources(resources: list[Resource], settings: Settings) -> list[str]:
    """Sharing entries that name no resource of this node (worth a warning, not an error: one
    ConfigMap serves nodes with different GPUs)."""
    base = {r.name.removesuffix(".shared") for r in resources}
    listed = [*settings.time_slicing.resources, *settings.mps.resources]
    return [r.name for r in listed if r.name not in base]
