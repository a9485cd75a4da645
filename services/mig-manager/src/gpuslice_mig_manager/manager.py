"""The MIG manager's core: read GPUs, create and destroy instances safely, on demand.

Every change to MIG state goes through :meth:`MigManager.create_batch` and
:meth:`MigManager.destroy_batch`, which record an intent in the checkpoint *before* the first
NVML call and replace it with the result afterwards. A kill -9 in between leaves the intent for
:func:`gpuslice_mig_manager.reconcile.recover` to finish at the next start. One lock serializes
all MIG changes of the process (gRPC calls, the layout controller, the reconciler); reads that
only list GPUs take it too, so they never see half a layout.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpuslice_core.checkpoint import CheckpointStore
from gpuslice_core.errors import (
    FailedPreconditionError,
    GpusliceError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from gpuslice_core.logging import get_logger
from gpuslice_mig_manager import failpoints
from gpuslice_mig_manager.metrics import Metrics
from gpuslice_mig_manager.planner import (
    NewInstance,
    Shape,
    check_placement,
    pick_placement,
)
from gpuslice_mig_manager.snapshot import GpuSnapshot, InstanceView, read_gpu
from gpuslice_mig_manager.state import InstanceRecord, Intent, MigState
from gpuslice_nvml import GpuInfo, Nvml, NvmlError, NvmlGpuLost, NvmlNotFound, Placement

log = get_logger(__name__)


@dataclass(frozen=True)
class Created:
    instance: InstanceView
    changed: bool


@dataclass(frozen=True)
class Removed:
    instance: InstanceView | None
    changed: bool


class MigManager:
    """MIG state of one node, owned by one process."""

    def __init__(
        self,
        nvml: Nvml,
        store: CheckpointStore[MigState],
        *,
        dynamic: bool = False,
        metrics: Metrics | None = None,
    ) -> None:
        self.nvml = nvml
        self.store = store
        self.dynamic = dynamic
        self.metrics = metrics or Metrics()
        self.lock = threading.RLock()
        self._uuids: dict[str, int] | None = None
        #: Drift keys the last reconcile reported (see reconcile.reconcile).
        self.reported_drift: set[str] = set()

    # -- reading ----------------------------------------------------------------------------
    def state(self) -> MigState:
        return self.store.load().state

    def gpu_infos(self) -> list[GpuInfo]:
        """Every GPU that answers (a lost GPU is logged and left out)."""
        infos = []
        for index in range(self.nvml.device_count()):
            try:
                infos.append(self.nvml.gpu(index))
            except NvmlGpuLost as exc:
                log.warning("gpu lost; skipped", gpu=index, error=str(exc))
        return infos

    def index_of(self, gpu_uuid: str) -> int:
        """The NVML index of a GPU UUID; NOT_FOUND naming the node's GPUs."""
        if not gpu_uuid:
            raise InvalidArgumentError("gpu_uuid is required")
        if self._uuids is None or gpu_uuid not in self._uuids:
            self._uuids = {g.uuid: g.index for g in self.gpu_infos()}
        try:
            return self._uuids[gpu_uuid]
        except KeyError:
            known = ", ".join(sorted(self._uuids)) or "none"
            raise NotFoundError(f"no GPU {gpu_uuid!r} on this node; GPUs: {known}") from None

    def snapshot(self, index: int, state: MigState | None = None) -> GpuSnapshot:
        return read_gpu(self.nvml, index, state if state is not None else self.state())

    def snapshots(self) -> list[GpuSnapshot]:
        with self.lock:
            state = self.state()
            snaps = [self.snapshot(g.index, state) for g in self.gpu_infos()]
        for snap in snaps:
            self.metrics.set_instances(snap.index, snap.info.uuid, snap.instances)
        return snaps

    def _observe(self, snap: GpuSnapshot, instances: Sequence[InstanceView]) -> None:
        """Refresh one GPU's instance series after a change made for a claim, so a scrape does
        not wait for the next list or reconcile to see it. ``instances`` is what the GPU holds
        now, derived from the snapshot the change was made on and the change itself: no second
        read of the GPU on the prepare path."""
        self.metrics.set_instances(snap.index, snap.info.uuid, instances)

    # -- on-demand instances ----------------------------------------------------------------
    def create_instance(
        self, gpu_uuid: str, profile_name: str, placement_start: int | None, owner: str
    ) -> Created:
        """Create (or return the existing) instance of ``profile_name`` on a GPU.

        An existing instance of the profile at the placement is returned unchanged when it has
        the same owner or none (then ``owner`` becomes its owner: that is how a claim takes an
        instance made by a layout). Creating a new instance needs dynamic MIG.
        """
        if not profile_name:
            raise InvalidArgumentError("profile_name is required")
        with self.lock:
            index = self.index_of(gpu_uuid)
            snap = self.snapshot(index)
            snap.require_mig()
            profile = snap.profile(profile_name)
            shape = snap.shape(profile.id)
            placement: Placement | None = None
            if placement_start is not None:
                placement = next((p for p in shape.placements if p.start == placement_start), None)
                if placement is None:
                    starts = ", ".join(str(p.start) for p in shape.placements)
                    raise InvalidArgumentError(
                        f"{profile_name} cannot start at memory slice {placement_start} on"
                        f" {snap.label()}; its placements start at {starts}"
                    )
                existing = snap.at(placement)
                if existing is not None and existing.profile_id == profile.id:
                    return self._take(snap, existing, owner)
            elif owner:
                mine = [
                    i for i in snap.instances if i.owner == owner and i.profile_id == profile.id
                ]
                if mine:
                    return self._take(snap, mine[0], owner)
            if not self.dynamic:
                raise FailedPreconditionError(
                    f"no {profile_name} instance exists"
                    + (f" at {placement}" if placement else "")
                    + f" on {snap.label()} and dynamic MIG is off (start with --dynamic-mig to"
                    " create instances on demand)"
                )
            present = snap.present()
            if placement is None:
                placement = pick_placement(shape, present, snap.total_compute)
                if placement is None:
                    raise ResourceExhaustedError(
                        f"no room for {profile_name} on {snap.label()}: {_occupancy(snap)}"
                    )
            else:
                why = check_placement(shape, placement, present, snap.total_compute)
                if why is not None:
                    raise ResourceExhaustedError(f"cannot create on {snap.label()}: {why}")
            created = self.create_batch(
                snap, [NewInstance(profile_name, shape, placement)], owner=owner, layout=""
            )
            self._observe(snap, [*snap.instances, *created])
            log.info(
                "instance created",
                gpu=index,
                profile=profile_name,
                placement=str(placement),
                gpu_instance=created[0].gpu_instance_id,
                mig_uuid=created[0].mig_uuid,
                owner=owner,
            )
            return Created(created[0], True)

    def _take(self, snap: GpuSnapshot, existing: InstanceView, owner: str) -> Created:
        if existing.owner and owner and existing.owner != owner:
            raise FailedPreconditionError(
                f"{existing.describe()} on {snap.label()} is held by claim {existing.owner}"
            )
        if existing.compute_instances == 0:  # left without a compute instance: finish it
            self._finish_gpu_instance(snap, existing)
            existing = self.snapshot(snap.index).instance(existing.gpu_instance_id) or existing
        if (owner and existing.owner != owner) or not existing.recorded:
            with self.store.transaction() as state:
                record = state.instances.get(existing.key) or _record(existing)
                state.instances[existing.key] = record.model_copy(update={"owner": owner})
            existing = replace(existing, owner=owner, recorded=True)
            log.info("instance taken", gpu_instance=existing.gpu_instance_id, owner=owner)
        return Created(existing, False)

    def destroy_instance(self, gpu_uuid: str, gpu_instance_id: int, owner: str) -> Removed:
        """Destroy an instance; gone already is success with ``changed`` false.

        With ``owner`` set only that owner's instance is destroyed: a GPU-instance id reused by
        someone else's instance is refused rather than destroyed.
        """
        with self.lock:
            index = self.index_of(gpu_uuid)
            snap = self.snapshot(index)
            if not snap.info.mig_enabled:
                return Removed(None, False)
            view = snap.instance(gpu_instance_id)
            if view is None:
                self._forget(gpu_uuid, gpu_instance_id)
                return Removed(None, False)
            if owner and view.owner != owner:
                held = f"claim {view.owner}" if view.owner else "no claim"
                raise FailedPreconditionError(
                    f"{view.describe()} on {snap.label()} is held by {held}, not {owner}"
                )
            if view.in_use:
                raise FailedPreconditionError(
                    f"{view.describe()} on {snap.label()} is in use by processes"
                    f" {', '.join(str(p) for p in view.pids)}"
                )
            self.destroy_batch(snap, [view])
            gone = view.gpu_instance_id
            self._observe(snap, [i for i in snap.instances if i.gpu_instance_id != gone])
            log.info("instance destroyed", gpu=index, gpu_instance=gpu_instance_id, owner=owner)
            return Removed(view, True)

    def release_instance(self, gpu_uuid: str, gpu_instance_id: int, owner: str) -> Removed:
        """Clear an instance's owner without destroying it (static MIG claims)."""
        with self.lock:
            index = self.index_of(gpu_uuid)
            snap = self.snapshot(index)
            view = snap.instance(gpu_instance_id) if snap.info.mig_enabled else None
            if view is None or not view.owner:
                return Removed(view, False)
            if owner and view.owner != owner:
                raise FailedPreconditionError(
                    f"{view.describe()} on {snap.label()} is held by claim {view.owner},"
                    f" not {owner}"
                )
            with self.store.transaction() as state:
                record = state.instances.get(view.key)
                if record is not None:
                    record.owner = ""
            return Removed(replace(view, owner=""), True)

    # -- the crash-safe primitives ----------------------------------------------------------
    def create_batch(
        self, snap: GpuSnapshot, items: Sequence[NewInstance], *, owner: str, layout: str
    ) -> list[InstanceView]:
        """Create each item (GPU instance + compute instance) at its placement.

        Intents are committed first; each item's result replaces its intent at the end. An
        item whose compute instance cannot be made has its GPU instance destroyed again.
        """
        uuid, index = snap.info.uuid, snap.index
        intents = [
            Intent(
                op="create",
                gpu_uuid=uuid,
                profile_id=item.shape.id,
                profile_name=item.shape.name,
                placement_start=item.placement.start,
                placement_size=item.placement.size,
                device_profile=item.device_profile,
                owner=owner,
                layout=layout,
            )
            for item in items
        ]
        with self.store.transaction() as state:
            for intent in intents:
                state.intents[intent.key] = intent
        done: list[InstanceRecord] = []
        unresolved: list[Intent] = []  # a GPU instance whose rollback failed: recovery retries
        try:
            for item, intent in zip(items, intents, strict=True):
                with self.metrics.create.time():
                    gi = self.nvml.create_gpu_instance(index, item.shape.id, item.placement)
                    failpoints.crash_point("after-create-gpu-instance")
                    try:
                        ci_profile = self._ci_profile(snap, gi.id, item.shape, item.device_profile)
                        ci = self.nvml.create_compute_instance(index, gi.id, ci_profile)
                    except GpusliceError:
                        try:
                            self.nvml.destroy_gpu_instance(index, gi.id)
                        except GpusliceError as exc:
                            log.error(
                                "rollback failed", gpu=index, gpu_instance=gi.id, error=str(exc)
                            )
                            unresolved.append(intent)
                        raise
                done.append(
                    InstanceRecord(
                        gpu_uuid=uuid,
                        gpu_instance_id=gi.id,
                        profile_id=gi.profile_id,
                        profile_name=gi.profile_name,
                        placement_start=gi.placement.start,
                        placement_size=gi.placement.size,
                        compute_instance_id=ci.id,
                        device_profile=ci.profile_name,
                        mig_uuid=ci.uuid,
                        owner=owner,
                        layout=layout,
                    )
                )
        finally:
            with self.store.transaction() as state:
                for intent in intents:
                    if intent not in unresolved:
                        state.intents.pop(intent.key, None)
                for record in done:
                    state.instances[record.key] = record
        return [_view(index, r) for r in done]

    def destroy_batch(self, snap: GpuSnapshot, views: Sequence[InstanceView]) -> None:
        """Destroy each instance's compute instances, then its GPU instance."""
        uuid, index = snap.info.uuid, snap.index
        intents = [
            Intent(
                op="destroy",
                gpu_uuid=uuid,
                profile_id=v.profile_id,
                profile_name=v.profile_name,
                placement_start=v.placement.start,
                placement_size=v.placement.size,
                gpu_instance_id=v.gpu_instance_id,
                owner=v.owner,
            )
            for v in views
        ]
        with self.store.transaction() as state:
            for intent in intents:
                state.intents[intent.key] = intent
        gone: list[InstanceView] = []
        try:
            for view in views:
                with self.metrics.destroy.time():
                    self._destroy_one(index, view.gpu_instance_id)
                gone.append(view)
        finally:
            with self.store.transaction() as state:
                for intent in intents:
                    state.intents.pop(intent.key, None)
                for view in gone:
                    state.instances.pop(view.key, None)

    def _destroy_one(self, index: int, gpu_instance_id: int) -> None:
        for ci in self.nvml.compute_instances(index, gpu_instance_id):
            self.nvml.destroy_compute_instance(index, gpu_instance_id, ci.id)
            failpoints.crash_point("after-destroy-compute-instance")
        with contextlib.suppress(NvmlNotFound):  # gone already: the goal is reached
            self.nvml.destroy_gpu_instance(index, gpu_instance_id)

    def _ci_profile(self, snap: GpuSnapshot, gi_id: int, shape: Shape, device_profile: str) -> int:
        offered = self.nvml.compute_instance_profiles(snap.index, gi_id)
        for p in offered:
            if p.name == device_profile:
                return p.id
        names = ", ".join(p.name for p in offered)
        raise NotFoundError(
            f"{shape.name} on {snap.label()} has no compute instance profile"
            f" {device_profile!r}; it offers {names}"
        )

    def _finish_gpu_instance(self, snap: GpuSnapshot, view: InstanceView) -> None:
        shape = snap.shape(view.profile_id)
        ci_profile = self._ci_profile(snap, view.gpu_instance_id, shape, shape.name)
        try:
            self.nvml.create_compute_instance(snap.index, view.gpu_instance_id, ci_profile)
        except NvmlError as exc:
            raise FailedPreconditionError(
                f"{view.describe()} on {snap.label()} has no compute instance and one cannot be"
                f" made: {exc}"
            ) from exc

    def _forget(self, gpu_uuid: str, gpu_instance_id: int) -> None:
        with self.store.transaction() as state:
            state.instances.pop(f"{gpu_uuid}/{gpu_instance_id}", None)


def _record(view: InstanceView) -> InstanceRecord:
    return InstanceRecord(
        gpu_uuid=view.gpu_uuid,
        gpu_instance_id=view.gpu_instance_id,
        profile_id=view.profile_id,
        profile_name=view.profile_name,
        placement_start=view.placement.start,
        placement_size=view.placement.size,
        compute_instance_id=view.compute_instance_id,
        device_profile=view.device_profile or "",
        mig_uuid=view.mig_uuid,
        owner=view.owner,
        layout=view.layout,
    )


def _view(index: int, r: InstanceRecord) -> InstanceView:
    return InstanceView(
        gpu_index=index,
        gpu_uuid=r.gpu_uuid,
        gpu_instance_id=r.gpu_instance_id,
        profile_id=r.profile_id,
        profile_name=r.profile_name,
        placement=r.placement,
        compute_instance_id=r.compute_instance_id,
        device_profile=r.device_profile,
        mig_uuid=r.mig_uuid,
        compute_instances=1,
        owner=r.owner,
        layout=r.layout,
        recorded=True,
    )


def record_of(view: InstanceView, **update: str) -> InstanceRecord:
    return _record(view).model_copy(update=update)


def _occupancy(snap: GpuSnapshot) -> str:
    if not snap.instances:
        return "no instances exist"
    return "instances " + ", ".join(f"{i.profile_name} at {i.placement}" for i in snap.instances)
