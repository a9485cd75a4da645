"""Domain values to gpuslice.v1 MigManager messages (and nothing else)."""

from __future__ import annotations

from gpuslice_mig_manager.apply import GpuChange, LayoutResult, LayoutState
from gpuslice_mig_manager.snapshot import GpuSnapshot, InstanceView
from gpuslice_nvml import GpuInstanceProfile, Placement
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as pb

_STATES = {
    LayoutState.SUCCESS: pb.LAYOUT_STATE_SUCCESS,
    LayoutState.PENDING: pb.LAYOUT_STATE_PENDING,
    LayoutState.REBOOTING: pb.LAYOUT_STATE_REBOOT_REQUIRED,
    LayoutState.FAILED: pb.LAYOUT_STATE_FAILED,
}


def mode(enabled: bool | None) -> pb.MigMode.ValueType:
    if enabled is None:
        return pb.MIG_MODE_UNSPECIFIED
    return pb.MIG_MODE_ENABLED if enabled else pb.MIG_MODE_DISABLED


def placement(p: Placement) -> pb.MigPlacement:
    return pb.MigPlacement(start=p.start, size=p.size)


def profile(p: GpuInstanceProfile) -> pb.MigProfile:
    return pb.MigProfile(
        name=p.name,
        profile_id=p.id,
        compute_slices=p.slice_count,
        memory_slices=p.memory_slices,
        max_instances=p.instance_count,
        multiprocessors=p.multiprocessors,
        memory_mib=p.memory_mib,
        placements=[placement(x) for x in sorted(p.placements)],
    )


def instance(v: InstanceView) -> pb.MigInstance:
    return pb.MigInstance(
        gpu_instance_id=v.gpu_instance_id,
        compute_instance_id=v.compute_instance_id or 0,
        profile_name=v.profile_name,
        placement=placement(v.placement),
        mig_uuid=v.mig_uuid,
        in_use=v.in_use,
        owner=v.owner,
        gpu_uuid=v.gpu_uuid,
        device_profile=v.device_profile or "",
        layout=v.layout,
        pids=list(v.pids),
    )


def gpu(s: GpuSnapshot) -> pb.MigGpu:
    m = s.info.mig_mode
    return pb.MigGpu(
        uuid=s.info.uuid,
        index=s.info.index,
        product_name=s.info.name,
        mig_capable=s.info.mig_capable,
        current_mode=mode(m.current if m else None),
        pending_mode=mode(m.pending if m else None),
        profiles=[profile(p) for p in sorted(s.profiles, key=lambda p: p.id)],
        instances=[instance(i) for i in s.instances],
    )


def gpu_change(c: GpuChange) -> pb.GpuLayoutChange:
    return pb.GpuLayoutChange(
        gpu_uuid=c.gpu_uuid,
        index=c.gpu_index,
        previous_mode=mode(c.previous_mode),
        mode=mode(c.mode),
        destroyed=[instance(i) for i in c.destroyed],
        created=[instance(i) for i in c.created],
        reset_required=c.reset_required,
        error=c.error,
        waiting=c.waiting,
        skipped=c.skipped,
    )


def layout_result(r: LayoutResult) -> pb.ApplyLayoutResponse:
    return pb.ApplyLayoutResponse(
        state=_STATES[r.state],
        changed=r.changed,
        gpus=[gpu_change(c) for c in r.gpus],
        message=r.message,
    )
