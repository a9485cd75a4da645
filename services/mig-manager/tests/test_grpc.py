"""The gpuslice.v1.MigManager API over a real unix socket."""

from __future__ import annotations

import grpc
import pytest

from gpuslice_mig_manager.apply import apply_layout
from gpuslice_mig_manager.layouts import LayoutConfig
from gpuslice_mig_manager.manager import MigManager
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as pb

from .conftest import Serve

pytestmark = pytest.mark.timeout(30)
T = 5.0  # per-call timeout


def rpc_error(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        assert callable(call)
        call()
    return info.value


@pytest.fixture
def mig_on(dynamic_manager: MigManager, layouts: LayoutConfig) -> MigManager:
    apply_layout(dynamic_manager, "all-enabled", layouts)
    return dynamic_manager


def test_list_gpus_reports_profiles_from_nvml(
    fake: FakeNvml, manager: MigManager, serve: Serve
) -> None:
    stub = serve(manager)

    reply = stub.ListGpus(pb.ListGpusRequest(), timeout=T)

    assert [g.index for g in reply.gpus] == list(range(8))
    gpu = reply.gpus[0]
    assert gpu.uuid == fake.gpu(0).uuid
    assert gpu.product_name == "NVIDIA A100-SXM4-40GB"
    assert gpu.mig_capable and gpu.current_mode == pb.MIG_MODE_DISABLED
    by_name = {p.name: p for p in gpu.profiles}
    assert [p.profile_id for p in gpu.profiles] == sorted(p.profile_id for p in gpu.profiles)
    assert set(by_name) == {p.name for p in fake.gpu_instance_profiles(0)}
    three = by_name["3g.20gb"]
    assert (three.profile_id, three.compute_slices, three.memory_slices) == (9, 3, 4)
    assert (three.max_instances, three.multiprocessors, three.memory_mib) == (2, 42, 19968)
    assert [(p.start, p.size) for p in three.placements] == [(0, 4), (4, 4)]
    assert not gpu.instances


def test_dynamic_instances_at_given_placements_and_overlap_refused(
    fake: FakeNvml, mig_on: MigManager, serve: Serve
) -> None:
    stub = serve(mig_on)
    gpu = fake.gpu(0).uuid

    three = stub.CreateInstance(
        pb.CreateInstanceRequest(
            gpu_uuid=gpu, profile_name="3g.20gb", placement_start=0, owner="claim-a"
        ),
        timeout=T,
    )
    two = stub.CreateInstance(
        pb.CreateInstanceRequest(
            gpu_uuid=gpu, profile_name="2g.10gb", placement_start=4, owner="claim-b"
        ),
        timeout=T,
    )

    assert three.changed and two.changed
    assert (three.instance.placement.start, three.instance.placement.size) == (0, 4)
    assert (two.instance.placement.start, two.instance.placement.size) == (4, 2)
    assert three.instance.mig_uuid.startswith("MIG-") and three.instance.owner == "claim-a"
    assert three.instance.device_profile == "3g.20gb"
    devices = {d.uuid: d for d in fake.mig_devices(0)}
    assert devices[two.instance.mig_uuid].profile == "2g.10gb"
    assert devices[two.instance.mig_uuid].gpu_instance_id == two.instance.gpu_instance_id

    overlap = rpc_error(
        lambda: stub.CreateInstance(
            pb.CreateInstanceRequest(
                gpu_uuid=gpu, profile_name="2g.10gb", placement_start=2, owner="claim-c"
            ),
            timeout=T,
        )
    )
    assert overlap.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2g.10gb at 2:2 overlaps GPU instance" in str(overlap.details())
    assert "3g.20gb at 0:4" in str(overlap.details())
    assert len(fake.gpu_instances(0)) == 2

    listed = stub.ListGpus(pb.ListGpusRequest(), timeout=T).gpus[0]
    assert [(i.profile_name, i.owner) for i in listed.instances] == [
        ("3g.20gb", "claim-a"),
        ("2g.10gb", "claim-b"),
    ]  # ordered by GPU instance id: 1 (the 4-slice half at 0), 5 (the quarter at 4)


def test_create_is_idempotent_and_destroy_too(
    fake: FakeNvml, mig_on: MigManager, serve: Serve
) -> None:
    stub = serve(mig_on)
    request = pb.CreateInstanceRequest(
        gpu_uuid=fake.gpu(1).uuid, profile_name="1g.5gb", placement_start=3, owner="claim-x"
    )

    first = stub.CreateInstance(request, timeout=T)
    again = stub.CreateInstance(request, timeout=T)
    unplaced = stub.CreateInstance(
        pb.CreateInstanceRequest(gpu_uuid=fake.gpu(1).uuid, profile_name="1g.5gb", owner="claim-x"),
        timeout=T,
    )

    assert first.changed and not again.changed and not unplaced.changed
    assert again.instance == first.instance == unplaced.instance
    assert len(fake.gpu_instances(1)) == 1

    gi = first.instance.gpu_instance_id
    destroy = pb.DestroyInstanceRequest(
        gpu_uuid=fake.gpu(1).uuid, gpu_instance_id=gi, owner="claim-x"
    )
    gone = stub.DestroyInstance(destroy, timeout=T)
    assert gone.changed and gone.destroyed.mig_uuid == first.instance.mig_uuid
    assert not stub.DestroyInstance(destroy, timeout=T).changed
    assert fake.gpu_instances(1) == []
    assert not mig_on.state().instances and not mig_on.state().intents


def test_without_placement_the_lowest_free_one_is_used(
    fake: FakeNvml, mig_on: MigManager, serve: Serve
) -> None:
    stub = serve(mig_on)
    gpu = fake.gpu(0).uuid
    starts = [
        stub.CreateInstance(
            pb.CreateInstanceRequest(gpu_uuid=gpu, profile_name="2g.10gb", owner=f"c{i}"),
            timeout=T,
        ).instance.placement.start
        for i in range(3)
    ]
    assert starts == [0, 2, 4]
    full = rpc_error(
        lambda: stub.CreateInstance(
            pb.CreateInstanceRequest(gpu_uuid=gpu, profile_name="2g.10gb", owner="c9"),
            timeout=T,
        )
    )
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no room for 2g.10gb" in str(full.details())


def test_an_unsupported_profile_is_refused_with_the_supported_list(
    fake: FakeNvml, mig_on: MigManager, serve: Serve
) -> None:
    stub = serve(mig_on)

    err = rpc_error(
        lambda: stub.CreateInstance(
            pb.CreateInstanceRequest(
                gpu_uuid=fake.gpu(0).uuid, profile_name="3g.40gb", owner="claim"
            ),
            timeout=T,
        )
    )

    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert str(err.details()) == (
        "GPU 0 (NVIDIA A100-SXM4-40GB) has no MIG profile '3g.40gb'; it supports: 1g.5gb,"
        " 1g.5gb+me, 1g.10gb, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb"
    )


def test_a_placement_the_profile_lacks_is_refused(
    fake: FakeNvml, mig_on: MigManager, serve: Serve
) -> None:
    stub = serve(mig_on)
    err = rpc_error(
        lambda: stub.CreateInstance(
            pb.CreateInstanceRequest(
                gpu_uuid=fake.gpu(0).uuid, profile_name="3g.20gb", placement_start=2
            ),
            timeout=T,
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "placements start at 0, 4" in str(err.details())


def test_errors_for_unknown_gpu_mig_off_and_static_mode(
    fake: FakeNvml, manager: MigManager, serve: Serve, layouts: LayoutConfig
) -> None:
    stub = serve(manager)
    unknown = rpc_error(
        lambda: stub.CreateInstance(
            pb.CreateInstanceRequest(gpu_uuid="GPU-nope", profile_name="1g.5gb"), timeout=T
        )
    )
    assert unknown.code() == grpc.StatusCode.NOT_FOUND

    off = rpc_error(
        lambda: stub.CreateInstance(
            pb.CreateInstanceRequest(gpu_uuid=fake.gpu(0).uuid, profile_name="1g.5gb"), timeout=T
        )
    )
    assert off.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "MIG mode is off" in str(off.details())

    apply_layout(manager, "all-enabled", layouts)
    static = rpc_error(
        lambda: stub.CreateInstance(
            pb.CreateInstanceRequest(gpu_uuid=fake.gpu(0).uuid, profile_name="1g.5gb"), timeout=T
        )
    )
    assert static.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--dynamic-mig" in str(static.details())


def test_a_claim_takes_and_releases_a_layout_instance(
    fake: FakeNvml, manager: MigManager, serve: Serve, layouts: LayoutConfig
) -> None:
    apply_layout(manager, "all-1g.5gb", layouts)
    stub = serve(manager)
    gpu = fake.gpu(4).uuid
    take = pb.CreateInstanceRequest(gpu_uuid=gpu, profile_name="1g.5gb", placement_start=2)

    held = stub.CreateInstance(
        pb.CreateInstanceRequest(
            gpu_uuid=gpu, profile_name="1g.5gb", placement_start=2, owner="claim-1"
        ),
        timeout=T,
    )
    assert not held.changed and held.instance.owner == "claim-1"
    assert held.instance.layout == "all-1g.5gb"

    other = rpc_error(
        lambda: stub.CreateInstance(
            pb.CreateInstanceRequest(
                gpu_uuid=gpu, profile_name="1g.5gb", placement_start=2, owner="claim-2"
            ),
            timeout=T,
        )
    )
    assert other.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "held by claim claim-1" in str(other.details())
    assert stub.CreateInstance(take, timeout=T).instance.owner == "claim-1"

    gi = held.instance.gpu_instance_id
    wrong = rpc_error(
        lambda: stub.DestroyInstance(
            pb.DestroyInstanceRequest(gpu_uuid=gpu, gpu_instance_id=gi, owner="claim-2"),
            timeout=T,
        )
    )
    assert wrong.code() == grpc.StatusCode.FAILED_PRECONDITION

    released = stub.ReleaseInstance(
        pb.ReleaseInstanceRequest(gpu_uuid=gpu, gpu_instance_id=gi, owner="claim-1"), timeout=T
    )
    assert released.changed and released.instance.owner == ""
    again = stub.ReleaseInstance(
        pb.ReleaseInstanceRequest(gpu_uuid=gpu, gpu_instance_id=gi, owner="claim-1"), timeout=T
    )
    assert not again.changed
    assert len(fake.gpu_instances(4)) == 7


def test_destroying_an_instance_in_use_is_refused(
    fake: FakeNvml, control: FakeNvmlControl, mig_on: MigManager, serve: Serve
) -> None:
    stub = serve(mig_on)
    gpu = fake.gpu(0).uuid
    made = stub.CreateInstance(
        pb.CreateInstanceRequest(gpu_uuid=gpu, profile_name="4g.20gb", owner="claim"), timeout=T
    )
    control.add_process(99, made.instance.mig_uuid)

    listed = stub.ListGpus(pb.ListGpusRequest(), timeout=T).gpus[0].instances[0]
    assert listed.in_use and list(listed.pids) == [99]
    err = rpc_error(
        lambda: stub.DestroyInstance(
            pb.DestroyInstanceRequest(
                gpu_uuid=gpu, gpu_instance_id=made.instance.gpu_instance_id, owner="claim"
            ),
            timeout=T,
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "in use by processes 99" in str(err.details())


def test_apply_layout_rpc(fake: FakeNvml, manager: MigManager, serve: Serve) -> None:
    stub = serve(manager)

    reply = stub.ApplyLayout(pb.ApplyLayoutRequest(layout_name="all-3g.20gb"), timeout=20)

    assert reply.state == pb.LAYOUT_STATE_SUCCESS and reply.changed
    assert len(reply.gpus) == 8
    assert reply.gpus[0].previous_mode == pb.MIG_MODE_DISABLED
    assert reply.gpus[0].mode == pb.MIG_MODE_ENABLED
    assert [i.profile_name for i in reply.gpus[0].created] == ["3g.20gb", "3g.20gb"]
    assert "16 instances created" in reply.message

    inline = stub.ApplyLayout(
        pb.ApplyLayoutRequest(
            layout_name="mine",
            config_yaml="version: v1\nmig-configs:\n  mine:\n    - devices: [0]\n"
            "      mig-enabled: true\n      mig-devices: {'7g.40gb': 1}\n",
            dry_run=True,
        ),
        timeout=T,
    )
    assert inline.state == pb.LAYOUT_STATE_SUCCESS and not inline.changed
    assert [i.profile_name for i in inline.gpus[0].destroyed] == ["3g.20gb", "3g.20gb"]
    assert [i.profile_name for i in inline.gpus[0].created] == ["7g.40gb"]
    assert len(fake.gpu_instances(0)) == 2

    bad = rpc_error(
        lambda: stub.ApplyLayout(
            pb.ApplyLayoutRequest(layout_name="x", config_yaml="version: v1\nmig-confgs: {}\n"),
            timeout=T,
        )
    )
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mig-confgs: unknown key" in str(bad.details())
