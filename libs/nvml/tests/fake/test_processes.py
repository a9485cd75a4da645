"""Processes, memory and utilization on the fake node."""

from __future__ import annotations

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl

GIB = 1 << 30


def test_process_on_a_whole_gpu(fake: FakeNvml, control: FakeNvmlControl) -> None:
    control.add_process(1000, 1, used_memory_bytes=8 * GIB, sm_percent=60, memory_percent=20)
    control.add_process(1001, fake.gpu(1).uuid, used_memory_bytes=2 * GIB, sm_percent=30)
    memory = fake.memory_info(1)
    assert (memory.used, memory.free) == (10 * GIB, memory.total - 10 * GIB)
    procs = fake.running_processes(1)
    assert [(p.pid, p.used_memory_bytes, p.gpu_instance_id) for p in procs] == [
        (1000, 8 * GIB, None),
        (1001, 2 * GIB, None),
    ]
    samples = {s.pid: s for s in fake.process_utilization(1)}
    assert (samples[1000].sm_percent, samples[1000].memory_percent) == (60, 20)
    assert fake.process_utilization(1, since_us=samples[1000].timestamp_us + 10**9) == []
    assert fake.utilization(1).gpu_percent == 90
    control.set_process_utilization(1000, 1, sm_percent=10)
    assert fake.utilization(1).gpu_percent == 40
    assert control.remove_process(1000) == 1
    assert [p.pid for p in fake.running_processes(1)] == [1001]


def test_memory_must_fit(fake: FakeNvml, control: FakeNvmlControl) -> None:
    with pytest.raises(e.NvmlInsufficientMemory):
        control.add_process(7, 2, used_memory_bytes=24 * GIB)  # an L4 has 22.5 GiB


def test_processes_in_mig_mode_run_on_mig_devices(fake: FakeNvml, control: FakeNvmlControl) -> None:
    with pytest.raises(e.NvmlInvalidArgument, match="start the process on a MIG device"):
        control.add_process(5, 0)
    gi = fake.create_gpu_instance(0, 19)
    ci = fake.create_compute_instance(0, gi.id, 0)
    control.add_process(5, ci.uuid, used_memory_bytes=GIB, sm_percent=50)
    (proc,) = fake.running_processes(0)
    assert (proc.gpu_instance_id, proc.compute_instance_id, proc.device_uuid) == (
        gi.id,
        ci.id,
        ci.uuid,
    )
    assert fake.running_processes(ci.uuid) == [proc]
    assert fake.memory_info(ci.uuid).used == GIB
    with pytest.raises(e.NvmlInsufficientMemory):
        control.add_process(6, ci.uuid, used_memory_bytes=10 * GIB)  # 1g.10gb has 9.75 GiB
    with pytest.raises(e.NvmlNotSupported):
        fake.process_utilization(0)


def test_device_lookup_errors(fake: FakeNvml) -> None:
    with pytest.raises(e.NvmlInvalidArgument, match="no GPU 9"):
        fake.memory_info(9)
    with pytest.raises(e.NvmlNotFound):
        fake.memory_info("MIG-00000000-0000-0000-0000-000000000000")
    with pytest.raises(e.NvmlInvalidArgument):
        fake.running_processes("nvidia0")
