"""What one GPU looks like now: NVML's view joined with the manager's ownership records.

Every decision (list, create, destroy, plan a layout, reconcile) starts from a fresh
:class:`GpuSnapshot`, so nothing acts on a stale picture of the GPU.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from gpuslice_core.errors import FailedPreconditionError, NotFoundError
from gpuslice_mig_manager.planner import Present, Shape, total_compute_slices
from gpuslice_mig_manager.state import MigState, instance_key
from gpuslice_nvml import GpuInfo, GpuInstanceProfile, Nvml, Placement


@dataclass(frozen=True)
class InstanceView:
    """A GPU instance with its compute instance, who holds it and what runs on it."""

    gpu_index: int
    gpu_uuid: str
    gpu_instance_id: int
    profile_id: int
    profile_name: str
    placement: Placement
    #: The only compute instance's id and profile; ``None`` with no or several compute instances.
    compute_instance_id: int | None = None
    device_profile: str | None = None
    mig_uuid: str = ""
    compute_instances: int = 0
    pids: tuple[int, ...] = ()
    owner: str = ""
    layout: str = ""
    #: True when the manager has a record of the instance (it made or adopted it).
    recorded: bool = False

    @property
    def key(self) -> str:
        return instance_key(self.gpu_uuid, self.gpu_instance_id)

    @property
    def in_use(self) -> bool:
        return bool(self.pids)

    def describe(self) -> str:
        return f"GPU instance {self.gpu_instance_id} ({self.profile_name} at {self.placement})"


@dataclass(frozen=True)
class GpuSnapshot:
    info: GpuInfo
    profiles: tuple[GpuInstanceProfile, ...]
    instances: tuple[InstanceView, ...]
    #: Processes on a MIG GPU that no instance accounts for (NVML could not say where).
    unplaced_pids: tuple[int, ...] = ()
    _shapes: dict[int, Shape] = field(default_factory=dict, repr=False, compare=False)

    @property
    def index(self) -> int:
        return self.info.index

    @property
    def total_compute(self) -> int:
        return total_compute_slices(self.profiles)

    def label(self) -> str:
        return f"GPU {self.info.index} ({self.info.name})"

    def supported(self) -> str:
        return ", ".join(p.name for p in self.profiles) or "none"  # in NVML's enum order

    def require_mig(self) -> None:
        if not self.info.mig_capable:
            raise FailedPreconditionError(f"{self.label()} does not support MIG")
        if not self.info.mig_enabled:
            raise FailedPreconditionError(
                f"MIG mode is off on {self.label()}; apply a layout with mig-enabled: true first"
            )

    def profile(self, name: str) -> GpuInstanceProfile:
        """The GPU-instance profile named ``name``; NOT_FOUND listing the supported ones."""
        for p in self.profiles:
            if p.name == name:
                return p
        raise NotFoundError(
            f"{self.label()} has no MIG profile {name!r}; it supports: {self.supported()}"
        )

    def shape(self, profile_id: int) -> Shape:
        if profile_id not in self._shapes:
            profile = next(p for p in self.profiles if p.id == profile_id)
            self._shapes[profile_id] = Shape.of(profile)
        return self._shapes[profile_id]

    def instance(self, gpu_instance_id: int) -> InstanceView | None:
        return next((i for i in self.instances if i.gpu_instance_id == gpu_instance_id), None)

    def at(self, placement: Placement) -> InstanceView | None:
        return next((i for i in self.instances if i.placement == placement), None)

    def pinned_by(self, view: InstanceView) -> str:
        """Why ``view`` must not be destroyed; empty when nothing holds it."""
        reasons = []
        if view.owner:
            reasons.append(f"claim {view.owner}")
        pids = view.pids or self.unplaced_pids
        if pids:
            reasons.append("processes " + ", ".join(str(p) for p in pids))
        return " and ".join(reasons)

    def present(self) -> list[Present]:
        return [
            Present(
                gpu_instance_id=i.gpu_instance_id,
                shape=self.shape(i.profile_id),
                placement=i.placement,
                device_profile=i.device_profile,
                pinned_by=self.pinned_by(i),
            )
            for i in self.instances
        ]


def read_gpu(nvml: Nvml, index: int, state: MigState) -> GpuSnapshot:
    """Read one GPU's MIG state from NVML and join it with ``state``'s records."""
    info = nvml.gpu(index)
    if not info.mig_capable:
        return GpuSnapshot(info=info, profiles=(), instances=())
    profiles = tuple(nvml.gpu_instance_profiles(index))
    if not info.mig_enabled:
        return GpuSnapshot(info=info, profiles=profiles, instances=())
    gis = nvml.gpu_instances(index)
    devices = defaultdict(list)
    for device in nvml.mig_devices(index):
        devices[device.gpu_instance_id].append(device)
    pids: dict[int, set[int]] = defaultdict(set)
    by_uuid = {d.uuid: d.gpu_instance_id for ds in devices.values() for d in ds}
    unplaced: set[int] = set()
    for proc in nvml.running_processes(index):
        gi_id = proc.gpu_instance_id
        if gi_id is None:
            gi_id = by_uuid.get(proc.device_uuid)
        if gi_id is None:
            unplaced.add(proc.pid)
        else:
            pids[gi_id].add(proc.pid)
    views = []
    for gi in gis:
        cis = devices.get(gi.id, [])
        only = cis[0] if len(cis) == 1 else None
        record = state.instances.get(instance_key(info.uuid, gi.id))
        if record is not None and (
            record.profile_id != gi.profile_id or record.placement != gi.placement
        ):
            record = None  # the id was reused by another instance: the record is stale
        views.append(
            InstanceView(
                gpu_index=index,
                gpu_uuid=info.uuid,
                gpu_instance_id=gi.id,
                profile_id=gi.profile_id,
                profile_name=gi.profile_name,
                placement=gi.placement,
                compute_instance_id=only.compute_instance_id if only else None,
                device_profile=only.profile if only else None,
                mig_uuid=only.uuid if only else "",
                compute_instances=len(cis),
                pids=tuple(sorted(pids.get(gi.id, ()))),
                owner=record.owner if record else "",
                layout=record.layout if record else "",
                recorded=record is not None,
            )
        )
    return GpuSnapshot(
        info=info,
        profiles=profiles,
        instances=tuple(sorted(views, key=lambda v: v.gpu_instance_id)),
        unplaced_pids=tuple(sorted(unplaced)),
    )
