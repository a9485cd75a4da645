"""XID and lost-GPU events, waited for with bounded timeouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl, load_node
from gpuslice_nvml.types import HealthEventKind


def test_xid_is_delivered(fake: FakeNvml, control: FakeNvmlControl) -> None:
    gi = fake.create_gpu_instance(0, 9)
    fake.create_compute_instance(0, gi.id, 2)
    with fake.watch_events() as watch:
        control.inject_xid(1, 79)
        control.inject_xid(0, 31, gpu_instance_id=gi.id, compute_instance_id=0)
        first = watch.wait(timeout_s=5)
        second = watch.wait(timeout_s=5)
        assert watch.wait(timeout_s=0) is None
    assert first is not None and second is not None
    assert (first.kind, first.gpu_index, first.xid, first.gpu_instance_id) == (
        HealthEventKind.XID,
        1,
        79,
        None,
    )
    assert first.gpu_uuid == fake.gpu(1).uuid
    assert (second.xid, second.gpu_instance_id, second.compute_instance_id) == (31, gi.id, 0)


def test_watch_sees_only_its_gpus_and_only_new_events(
    fake: FakeNvml, control: FakeNvmlControl
) -> None:
    control.inject_xid(2, 48)  # before the watch exists
    with fake.watch_events([2]) as watch:
        control.inject_xid(1, 79)
        control.inject_xid(2, 63)
        event = watch.wait(timeout_s=5)
        assert event is not None and (event.gpu_index, event.xid) == (2, 63)
        assert watch.gpus == (2,)


def test_xid_for_a_missing_instance_is_refused(control: FakeNvmlControl) -> None:
    with pytest.raises(e.NvmlNotFound):
        control.inject_xid(0, 31, gpu_instance_id=7)


def test_lost_gpu(fake: FakeNvml, control: FakeNvmlControl) -> None:
    with fake.watch_events() as watch:
        control.mark_gpu_lost(1)
        event = watch.wait(timeout_s=5)
    assert event is not None and (event.kind, event.gpu_index) == (HealthEventKind.GPU_LOST, 1)
    assert fake.device_count() == 3
    with pytest.raises(e.NvmlGpuLost) as info:
        fake.memory_info(1)
    assert info.value.code == 15
    with pytest.raises(e.NvmlGpuLost):
        fake.gpus()
    assert fake.gpu(2).name == "NVIDIA L4"
    # a watch created while the GPU is lost reports it at once
    with fake.watch_events([1]) as watch:
        again = watch.wait(timeout_s=0)
        assert again is not None and again.kind is HealthEventKind.GPU_LOST
    control.mark_gpu_recovered(1)
    assert fake.memory_info(1).used == 0


def test_wait_times_out_on_a_fake_clock(mixed_config: Path) -> None:
    now = [1000.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    nvml = FakeNvml(load_node(mixed_config), clock=lambda: now[0], sleep=sleep)
    with nvml.watch_events() as watch:
        assert watch.wait(timeout_s=30) is None
    assert sum(slept) == pytest.approx(30)
    assert max(slept) <= 0.02 + 1e-9  # polls, never one long sleep


def test_closed_watch_cannot_wait(fake: FakeNvml) -> None:
    watch = fake.watch_events()
    watch.close()
    with pytest.raises(e.NvmlInvalidArgument):
        watch.wait(0)
