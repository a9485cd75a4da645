"""Applying a declarative layout to the node's GPUs.

Per selected GPU: MIG mode first (set it, then reset the GPU so it takes effect), then a plan
(:mod:`gpuslice_mig_manager.planner`) that keeps matching instances, destroys the rest and
creates the missing ones at explicit placements. A GPU whose plan would destroy an instance held
by a claim or a process is left untouched and reported as *waiting*; the caller retries. The
outcome of the whole layout is the worst of its GPUs: failed > rebooting > pending > success.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_mig_manager.layouts import (
    GpuTarget,
    LayoutConfig,
    LayoutError,
    gpu_instance_profile_of,
    select_targets,
)
from gpuslice_mig_manager.manager import MigManager, record_of
from gpuslice_mig_manager.planner import NewInstance, Plan, PlanError, Want, plan
from gpuslice_mig_manager.snapshot import GpuSnapshot, InstanceView
from gpuslice_nvml import NvmlError, NvmlInUse

log = get_logger(__name__)


class LayoutState(enum.StrEnum):
    """The values of the ``gpuslice.dev/mig.config.state`` label."""

    SUCCESS = "success"
    PENDING = "pending"
    REBOOTING = "rebooting"
    FAILED = "failed"


_VERB = {
    LayoutState.PENDING: "waits",
    LayoutState.REBOOTING: "needs a GPU reset or a node reboot",
    LayoutState.FAILED: "failed",
}
_RANK = {LayoutState.SUCCESS: 0, LayoutState.PENDING: 1, LayoutState.REBOOTING: 2}


@dataclass
class GpuChange:
    """What applying the layout did (or, in a dry run, would do) to one GPU."""

    gpu_index: int
    gpu_uuid: str
    previous_mode: bool | None = None
    mode: bool | None = None
    destroyed: list[InstanceView] = field(default_factory=list)
    created: list[InstanceView] = field(default_factory=list)
    reset_required: bool = False
    #: The mode change's GPU reset failed: the node needs a GPU reset or a reboot.
    reboot_required: bool = False
    #: Why the GPU failed (permanent until the layout or the label changes).
    error: str = ""
    #: Why the GPU waits (an instance in use, a busy GPU); retrying may succeed.
    waiting: str = ""
    #: Why the GPU was left alone (not MIG-capable under ``devices: all``).
    skipped: str = ""

    @property
    def state(self) -> LayoutState:
        if self.error:
            return LayoutState.FAILED
        if self.reboot_required:
            return LayoutState.REBOOTING
        if self.waiting:
            return LayoutState.PENDING
        return LayoutState.SUCCESS

    @property
    def changed(self) -> bool:
        return bool(self.destroyed or self.created or self.previous_mode != self.mode)


@dataclass
class LayoutResult:
    name: str
    state: LayoutState
    changed: bool
    gpus: list[GpuChange]
    message: str
    dry_run: bool = False

    def reasons(self) -> str:
        """The per-GPU errors or waits, one clause per GPU."""
        parts = []
        for g in self.gpus:
            why = g.error or g.waiting
            if why:
                parts.append(f"GPU {g.gpu_index}: {why}")
        return "; ".join(parts)


def apply_layout(
    manager: MigManager, name: str, config: LayoutConfig, *, dry_run: bool = False
) -> LayoutResult:
    """Apply layout ``name`` of ``config`` to every GPU it selects."""
    start = time.perf_counter()
    with manager.lock:
        try:
            targets = select_targets(config, name, manager.gpu_infos())
        except LayoutError as exc:
            message = f"MIG layout {name} failed: {exc}"
            result = LayoutResult(name, LayoutState.FAILED, False, [], message, dry_run)
        else:
            changes = [_apply_gpu(manager, name, t, dry_run) for _, t in sorted(targets.items())]
            result = _summarize(name, changes, dry_run)
    if not dry_run:
        manager.metrics.observe_apply(result.state.value, time.perf_counter() - start)
        manager.snapshots()  # refresh the instance gauges
    log.info(
        "layout applied" if result.state is LayoutState.SUCCESS else "layout not applied",
        layout=name,
        state=result.state.value,
        changed=result.changed,
        dry_run=dry_run,
        reason=result.reasons() or None,
    )
    return result


def _summarize(name: str, changes: list[GpuChange], dry_run: bool) -> LayoutResult:
    state = LayoutState.SUCCESS
    for c in changes:
        s = c.state
        if s is LayoutState.FAILED or state is LayoutState.FAILED:
            state = LayoutState.FAILED
        elif _RANK[s] > _RANK[state]:
            state = s
    created = sum(len(c.created) for c in changes)
    destroyed = sum(len(c.destroyed) for c in changes)
    changed = any(c.changed for c in changes) and not dry_run
    verb = "would apply" if dry_run else "applied"
    counts = f"{len(changes)} GPUs, {created} instances created, {destroyed} destroyed"
    if not changes:
        message = f"MIG layout {name} selects no GPU of this node; nothing to do"
    elif state is LayoutState.SUCCESS:
        message = (
            f"{verb} MIG layout {name}: {counts}"
            if changed or dry_run
            else f"MIG layout {name} is in place ({len(changes)} GPUs)"
        )
    else:
        result = LayoutResult(name, state, changed, changes, "", dry_run)
        message = f"MIG layout {name} {_VERB[state]}: {result.reasons()}"
    return LayoutResult(name, state, changed, changes, message, dry_run)


def _apply_gpu(manager: MigManager, name: str, target: GpuTarget, dry_run: bool) -> GpuChange:
    index = target.gpu_index
    snap = manager.snapshot(index)
    change = GpuChange(index, snap.info.uuid)
    info = snap.info
    if not info.mig_capable:
        if target.mig_enabled and target.explicit:
            change.error = f"{snap.label()} does not support MIG ({target.entry} selects it)"
        elif target.mig_enabled:
            change.skipped = "not MIG-capable"
        return change
    assert info.mig_mode is not None
    change.previous_mode = info.mig_mode.current
    change.mode = target.mig_enabled
    try:
        if target.mig_enabled:
            _enable(manager, name, target, snap, change, dry_run)
        else:
            _disable(manager, snap, change, dry_run)
    except NvmlInUse as exc:
        change.waiting = f"in use: {exc}"
    except GpusliceError as exc:
        if exc.retryable:
            change.waiting = str(exc)
        else:
            change.error = str(exc)
    return change


def _disable(manager: MigManager, snap: GpuSnapshot, change: GpuChange, dry_run: bool) -> None:
    held = [(i, snap.pinned_by(i)) for i in snap.instances if snap.pinned_by(i)]
    if held:
        change.waiting = "; ".join(f"{i.describe()} is held by {why}" for i, why in held)
        return
    change.destroyed = list(snap.instances)
    mode = snap.info.mig_mode
    assert mode is not None
    if dry_run:
        change.reset_required = mode.current
        return
    if snap.instances:
        manager.destroy_batch(snap, snap.instances)
    _set_mode(manager, snap, False, change)


def _set_mode(manager: MigManager, snap: GpuSnapshot, enabled: bool, change: GpuChange) -> None:
    """Request the mode and reset the GPU so it takes effect now."""
    index = snap.index
    mode = manager.nvml.mig_mode(index)
    if mode.pending != enabled:
        mode = manager.nvml.set_mig_mode(index, enabled)
    if mode.current == enabled:
        return
    try:
        manager.nvml.reset_gpu(index)
    except NvmlInUse as exc:
        change.waiting = f"MIG mode change needs an idle GPU: {exc}"
    except NvmlError as exc:
        change.reset_required = change.reboot_required = True
        change.waiting = (
            f"MIG mode is {'enabled' if enabled else 'disabled'} pending a GPU reset that"
            f" failed ({exc}); reset the GPU or reboot the node"
        )
        log.warning("gpu reset failed; reboot required", gpu=index, error=str(exc))


def _enable(
    manager: MigManager,
    name: str,
    target: GpuTarget,
    snap: GpuSnapshot,
    change: GpuChange,
    dry_run: bool,
) -> None:
    mode = snap.info.mig_mode
    assert mode is not None
    if not snap.profiles and not mode.current and not dry_run:
        # Older drivers (535) list profiles only in MIG mode: switch first, then check names.
        _set_mode(manager, snap, True, change)
        if change.waiting:
            return
        snap = manager.snapshot(snap.index)
        mode = snap.info.mig_mode
        assert mode is not None
    names = {p.name: p for p in snap.profiles}
    unknown = [n for n in target.devices if gpu_instance_profile_of(n) not in names]
    if unknown:
        listed = ", ".join(repr(n) for n in unknown)
        change.error = (
            f"{target.entry}: {snap.label()} has no MIG profile {listed}; it supports:"
            f" {snap.supported()}"
        )
        return
    wants = []
    for device_profile, count in sorted(target.devices.items()):
        profile = names[gpu_instance_profile_of(device_profile)]
        wants += [Want(device_profile, snap.shape(profile.id))] * count
    if not mode.current and dry_run:
        change.reset_required = True
    elif not mode.current or mode.pending != mode.current:
        _set_mode(manager, snap, True, change)
        if change.waiting:
            return
        snap = manager.snapshot(snap.index)
    try:
        result: Plan = plan(wants, snap.present(), snap.total_compute)
    except PlanError as exc:
        if exc.blocked:
            change.waiting = str(exc)
        else:
            change.error = f"{target.entry} on {snap.label()}: {exc}"
        return
    by_id = {i.gpu_instance_id: i for i in snap.instances}
    change.destroyed = [by_id[p.gpu_instance_id] for p in result.destroy]
    if dry_run:
        change.created = [_planned(snap, n) for n in result.create]
        return
    if result.destroy:
        manager.destroy_batch(snap, change.destroyed)
    kept = [by_id[p.gpu_instance_id] for p in result.keep]
    _adopt(manager, name, kept)
    if result.create:
        change.created = manager.create_batch(snap, result.create, owner="", layout=name)


def _adopt(manager: MigManager, name: str, kept: list[InstanceView]) -> None:
    """Record kept instances as the layout's (owners are kept)."""
    stale = [i for i in kept if not i.recorded or i.layout != name]
    if not stale:
        return
    with manager.store.transaction() as state:
        for view in stale:
            record = state.instances.get(view.key) or record_of(view)
            state.instances[view.key] = record.model_copy(update={"layout": name})


def _planned(snap: GpuSnapshot, item: NewInstance) -> InstanceView:
    return InstanceView(
        gpu_index=snap.index,
        gpu_uuid=snap.info.uuid,
        gpu_instance_id=0,
        profile_id=item.shape.id,
        profile_name=item.shape.name,
        placement=item.placement,
        device_profile=item.device_profile,
    )
