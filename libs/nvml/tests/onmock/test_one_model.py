"""What one front end changes, the other sees; the same call gives the same answer or error."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml.interface import Nvml
from gpuslice_nvml.real import RealNvml
from gpuslice_nvml.types import GIB, ComputeMode, HealthEvent, HealthEventKind, Placement

from .conftest import OpenNode

MIG_NODE = """
name: one-model
gpus:
  - model: H100-SXM5-80GB
    migEnabled: true
  - model: A100-SXM4-40GB
  - model: L4
topology:
  nvlink:
    - gpus: [0, 1]
      links: 12
"""


def same_event(a: HealthEvent | None, b: HealthEvent | None) -> bool:
    """Equal but for the time each backend saw it."""
    assert a is not None and b is not None
    return dataclasses.replace(a, timestamp=0) == dataclasses.replace(b, timestamp=0)


def test_static_facts_agree_but_sysfs_ones(open_node: OpenNode) -> None:
    node = open_node(MIG_NODE)
    real, fake = node.real, node.fake
    assert real.system_info() == fake.system_info()
    for index in range(fake.device_count()):
        # the PCIe root comes from the host's sysfs, which the mock cannot change
        assert dataclasses.replace(real.gpu(index), pcie_root=None) == dataclasses.replace(
            fake.gpu(index), pcie_root=None
        )
        if fake.gpu(index).mig_capable:
            assert real.gpu_instance_profiles(index) == fake.gpu_instance_profiles(index)
        for other in range(fake.device_count()):
            assert real.topology(index, other) == fake.topology(index, other)


def test_an_xid_from_fake_ctl_reaches_both_watches(open_node: OpenNode) -> None:
    node = open_node(MIG_NODE)
    with node.real.watch_events() as real_watch, node.fake.watch_events() as fake_watch:
        ctl_command = [sys.executable, "-m", "gpuslice_nvml.fake.ctl", "--config", str(node.config)]
        ctl = subprocess.run(
            [*ctl_command, "xid", "--gpu", "2", "--code", "79"],
            capture_output=True,
            text=True,
            env=dict(os.environ),
            timeout=30,
            check=False,
        )
        assert ctl.returncode == 0, ctl.stderr
        from_real, from_fake = real_watch.wait(10), fake_watch.wait(10)
    assert from_real is not None and from_real.kind is HealthEventKind.XID
    assert (from_real.gpu_index, from_real.xid) == (2, 79)
    assert same_event(from_real, from_fake)


def test_an_xid_in_a_mig_instance_names_it_on_both(open_node: OpenNode) -> None:
    node = open_node(MIG_NODE)
    gi = node.real.create_gpu_instance(0, profile_id(node.real, 0, "3g.40gb"))
    ci = node.real.create_compute_instance(0, gi.id, ci_profile_id(node.real, gi.id, "3g.40gb"))
    with node.real.watch_events([0]) as real_watch, node.fake.watch_events([0]) as fake_watch:
        node.control.inject_xid(0, 48, gpu_instance_id=gi.id, compute_instance_id=ci.id)
        from_real, from_fake = real_watch.wait(10), fake_watch.wait(10)
    assert from_real is not None
    assert (from_real.gpu_instance_id, from_real.compute_instance_id) == (gi.id, ci.id)
    assert same_event(from_real, from_fake)


def test_a_lost_gpu_is_lost_for_both(open_node: OpenNode) -> None:
    node = open_node(MIG_NODE)
    with node.real.watch_events() as real_watch, node.fake.watch_events() as fake_watch:
        node.control.mark_gpu_lost(1)
        from_real, from_fake = real_watch.wait(10), fake_watch.wait(10)
    assert from_real is not None and from_real.kind is HealthEventKind.GPU_LOST
    assert same_event(from_real, from_fake)
    for backend in (node.real, node.fake):
        with pytest.raises(e.NvmlGpuLost):
            backend.memory_info(1)
        with pytest.raises(e.NvmlGpuLost):
            backend.compute_mode(1)
    node.control.mark_gpu_recovered(1)
    assert node.real.memory_info(1) == node.fake.memory_info(1)


def profile_id(nvml: Nvml, gpu: int, name: str) -> int:
    return next(p.id for p in nvml.gpu_instance_profiles(gpu) if p.name == name)


def ci_profile_id(nvml: Nvml, gi_id: int, name: str) -> int:
    return next(p.id for p in nvml.compute_instance_profiles(0, gi_id) if p.name == name)


def outcome(call: Callable[[], Any]) -> Any:
    """A call's result, or the type of the NVML error it raised."""
    try:
        return call()
    except e.NvmlError as exc:
        return type(exc)


def test_mig_changes_through_either_front_end_are_one_layout(open_node: OpenNode) -> None:
    """The same script of MIG calls on two equal nodes, one through the real backend on the
    mock and one through the fake, gives the same results and errors at every step; and each
    node's other front end sees the layout its first one made."""
    a, b = open_node(MIG_NODE), open_node(MIG_NODE)  # same node, two state files
    assert a.real.mig_devices(0) == []

    def script(nvml: Nvml) -> list[Any]:
        p3, p1, p7 = (profile_id(nvml, 0, n) for n in ("3g.40gb", "1g.10gb", "7g.80gb"))
        steps: list[Callable[[], Any]] = [
            lambda: nvml.create_gpu_instance(0, p3),
            lambda: nvml.create_gpu_instance(0, p1, Placement(0, 1)),
            lambda: nvml.create_gpu_instance(0, p1, Placement(0, 1)),  # taken
            lambda: nvml.create_gpu_instance(0, p1, Placement(0, 2)),  # not offered
            lambda: nvml.create_gpu_instance(0, p7),  # no room
            lambda: nvml.remaining_capacity(0, p1),
            lambda: nvml.create_compute_instance(0, 2, ci_profile_id(nvml, 2, "1c.3g.40gb")),
            lambda: nvml.create_compute_instance(0, 2, ci_profile_id(nvml, 2, "2c.3g.40gb")),
            lambda: nvml.compute_instances(0, 2),
            lambda: nvml.destroy_gpu_instance(0, 2),  # still has compute instances
            lambda: nvml.destroy_compute_instance(0, 2, 5),  # no such instance
            lambda: nvml.gpu_instances(1),  # MIG capable, MIG off
            lambda: nvml.gpu_instance_profiles(2),  # not MIG capable
            lambda: nvml.mig_devices(0),
        ]
        return [outcome(step) for step in steps]

    through_real, through_fake = script(a.real), script(b.fake)
    assert through_real == through_fake
    assert e.NvmlInsufficientResources in through_real and e.NvmlInUse in through_real
    assert a.fake.gpu_instances(0) == a.real.gpu_instances(0)
    assert a.fake.mig_devices(0) == a.real.mig_devices(0)
    assert b.real.mig_devices(0) == b.fake.mig_devices(0)
    for device in a.real.mig_devices(0):
        assert a.real.memory_info(device.uuid) == a.fake.memory_info(device.uuid)
    a.real.destroy_compute_instance(0, 2, 0)
    a.fake.destroy_compute_instance(0, 2, 1)
    a.real.destroy_gpu_instance(0, 2)
    assert [gi.id for gi in a.fake.gpu_instances(0)] == [7]


def test_processes_memory_and_utilization_agree(open_node: OpenNode) -> None:
    node = open_node(MIG_NODE)
    node.control.add_process(4001, 2, used_memory_bytes=3 * GIB, sm_percent=60, memory_percent=20)
    node.control.add_process(4002, 2, used_memory_bytes=1 * GIB, sm_percent=30)
    gi = node.fake.create_gpu_instance(0, profile_id(node.fake, 0, "1g.10gb"))
    ci = node.fake.create_compute_instance(0, gi.id, ci_profile_id(node.fake, gi.id, "1g.10gb"))
    node.control.add_process(4003, ci.uuid, used_memory_bytes=2 * GIB)
    for device in (0, 2, ci.uuid, node.fake.gpu(2).uuid):
        assert node.real.running_processes(device) == node.fake.running_processes(device)
        assert node.real.memory_info(device) == node.fake.memory_info(device)
    assert node.real.utilization(2) == node.fake.utilization(2)
    real_samples = node.real.process_utilization(2)
    assert {(s.pid, s.sm_percent, s.memory_percent) for s in real_samples} == {
        (4001, 60, 20),
        (4002, 30, 0),
    }
    assert node.real.process_utilization(2, since_us=real_samples[0].timestamp_us + 10**9) == []
    with pytest.raises(e.NvmlNotSupported):
        node.real.process_utilization(0)  # MIG mode


def test_reads_go_on_while_a_frozen_client_holds_the_state_lock(open_node: OpenNode) -> None:
    """A workload registered on the fake node may be frozen by the enforcer in the middle of a
    change (holding the state's lock); the watchdog's reads through either front end must not
    wait for it, or nothing would ever thaw it."""
    node = open_node(MIG_NODE)
    node.control.add_process(4001, 2, used_memory_bytes=GIB, sm_percent=60)
    lock_path = node.fake.store.path.with_name(node.fake.store.path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR)
    answers: dict[str, object] = {}

    def read() -> None:
        for name, nvml in (("real", node.real), ("fake", node.fake)):
            answers[name] = [p.pid for p in nvml.running_processes(2)]
            nvml.process_utilization(2)

    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the frozen writer
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "a read waited for the lock a frozen writer holds"
    finally:
        os.close(fd)
    assert answers == {"real": [4001], "fake": [4001]}


def test_an_mps_client_is_listed_apart_from_own_contexts(open_node: OpenNode) -> None:
    """The driver lists MPS clients among the compute processes too (seen on an H100); the
    interface keeps them apart, as the fake does."""
    node = open_node(MIG_NODE)
    node.control.add_process(5001, 2, used_memory_bytes=GIB)
    node.control.add_process(5002, 2, used_memory_bytes=GIB)
    with node.control.store.transaction() as state:
        next(p for p in state.processes if p.pid == 5002).mps_client = True
    for backend in (node.real, node.fake):
        assert [p.pid for p in backend.running_processes(2)] == [5001]
        assert [p.pid for p in backend.mps_processes(2)] == [5002]
    assert {s.pid for s in node.real.process_utilization(2)} <= {5001}


def test_compute_mode_set_through_one_is_read_by_the_other(open_node: OpenNode) -> None:
    node = open_node(MIG_NODE)
    node.control.inject_xid(0, 31)
    before = node.control.state()
    node.real.set_compute_mode(2, ComputeMode.EXCLUSIVE_PROCESS)  # the C side rewrites the file
    assert node.fake.compute_mode(2) is ComputeMode.EXCLUSIVE_PROCESS
    after = node.control.state()
    assert after.events == before.events  # the event's float time written back as it was
    assert after.gpus[2].compute_mode == "EXCLUSIVE_PROCESS"
    node.fake.set_compute_mode(2, ComputeMode.PROHIBITED)
    assert node.real.compute_mode(2) is ComputeMode.PROHIBITED


def test_memory_partitioning_needs_a_615_driver_on_both(open_node: OpenNode) -> None:
    node = open_node(MIG_NODE)
    for backend in (node.real, node.fake):
        with pytest.raises(e.NvmlFunctionNotFound):
            backend.memory_limits(2, "/sys/fs/cgroup")


def test_calls_from_many_threads_while_the_layout_changes(open_node: OpenNode) -> None:
    """The library is thread safe: readers on eight threads see whole layouts while the main
    thread creates and destroys GPU instances."""
    node = open_node(MIG_NODE)
    profile = profile_id(node.real, 0, "1g.10gb")
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                ids = {gi.id for gi in node.real.gpu_instances(0)}
                assert ids <= set(range(7, 14)), ids
                assert node.real.memory_info(2).total == node.fake.memory_info(2).total
        except BaseException as exc:  # handed to the main thread's assert
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(8)]
    for thread in readers:
        thread.start()
    try:
        for _ in range(20):
            created = [node.real.create_gpu_instance(0, profile) for _ in range(3)]
            for gi in created:
                node.real.destroy_gpu_instance(0, gi.id)
    finally:
        done.set()
        for thread in readers:
            thread.join(10)
    assert not errors, errors[0]
    assert node.fake.gpu_instances(0) == []


def test_a_gpu_lost_before_start_fails_only_itself(open_node: OpenNode) -> None:
    """The services start on a node with a GPU off the bus and skip that GPU (NvmlGpuLost for
    it alone), as with the fake; the real backend used to fail to start at all."""
    node = open_node(MIG_NODE)
    node.control.mark_gpu_lost(1)
    with RealNvml() as real:
        assert real.device_count() == node.fake.device_count() == 3
        for backend in (real, node.fake):
            with pytest.raises(e.NvmlGpuLost):
                backend.gpu(1)
        assert real.memory_info(2) == node.fake.memory_info(2)
        with real.watch_events() as watch:
            event = watch.wait(0)
        assert event is not None and (event.kind, event.gpu_index) == (HealthEventKind.GPU_LOST, 1)
        node.control.mark_gpu_recovered(1)
        assert real.gpu(1).uuid == node.fake.gpu(1).uuid
