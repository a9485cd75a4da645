from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuslice_device_plugin.devices import discover
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_nvml import HealthEvent, HealthEventKind, Nvml
from gpuslice_testkit.device_plugin import H100_MIXED, H100X8_NVLINK, settings

Factory = Callable[[dict[str, Any]], Nvml]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def xid(gpu: int, code: int, instance: int | None = None) -> HealthEvent:
    return HealthEvent(HealthEventKind.XID, gpu, f"GPU-{gpu}", xid=code, gpu_instance_id=instance)


def test_critical_xid_marks_the_gpu_unhealthy_until_recovery(fake_node: Factory) -> None:
    nvml = fake_node(H100X8_NVLINK)
    [gpu] = discover(nvml, settings())
    clock = Clock()
    health = HealthTracker(nvml, quiet_period=60, clock=clock)
    g0, g1 = gpu.devices[0], gpu.devices[1]
    assert health.handle(xid(0, 79))
    assert not health.healthy(g0) and health.healthy(g1)
    assert health.reasons(g0) == ["XID 79"]
    generation = health.generation
    assert not health.handle(xid(0, 79))  # a repeat changes nothing but the quiet period
    clock.now += 59
    assert not health.check_recovery()
    clock.now += 1
    assert health.check_recovery()
    assert health.healthy(g0) and health.generation > generation


def test_application_xids_are_ignored(fake_node: Factory) -> None:
    nvml = fake_node(H100X8_NVLINK)
    [gpu] = discover(nvml, settings())
    health = HealthTracker(nvml)
    for code in (13, 31, 43, 45, 68, 109):
        assert not health.handle(xid(0, code))
    assert health.healthy(gpu.devices[0])
    custom = HealthTracker(nvml, ignored_xids=[79])
    assert not custom.handle(xid(0, 79)) and custom.handle(xid(0, 13))


def test_no_recovery_keeps_devices_unhealthy(fake_node: Factory) -> None:
    nvml = fake_node(H100X8_NVLINK)
    [gpu] = discover(nvml, settings())
    clock = Clock()
    health = HealthTracker(nvml, quiet_period=1, clock=clock, recovery=False)
    health.handle(xid(3, 48))
    clock.now += 100
    assert not health.check_recovery()
    assert not health.healthy(gpu.devices[3])


def test_lost_gpu_recovers_when_it_answers(fake_node: Factory, tmp_path: Any) -> None:
    from gpuslice_nvml.fake import FakeNvmlControl

    nvml = fake_node(H100X8_NVLINK)
    [gpu] = discover(nvml, settings())
    control = FakeNvmlControl.from_config_file(next(tmp_path.glob("*-nvml.yaml")))
    health = HealthTracker(nvml, clock=Clock())
    event = control.mark_gpu_lost(2)
    assert event is not None and health.handle(event)
    assert not health.check_recovery()  # still lost
    control.mark_gpu_recovered(2)
    assert health.check_recovery() and health.healthy(gpu.devices[2])


def test_xid_on_a_mig_instance_marks_only_its_devices(fake_node: Factory) -> None:
    nvml = fake_node(H100_MIXED)
    found = {r.name: r for r in discover(nvml, settings("flags: {migStrategy: mixed}"))}
    small = found["nvidia.com/mig-1g.10gb"].devices
    big = found["nvidia.com/mig-3g.40gb"].devices
    target = big[0]
    health = HealthTracker(nvml)
    health.handle(xid(target.gpu_index, 79, target.gpu_instance_id))
    assert not health.healthy(target)
    assert all(health.healthy(d) for d in small)
    assert health.healthy(big[1])


def test_events_from_the_watch_thread(fake_node: Factory, tmp_path: Any) -> None:
    from gpuslice_nvml.fake import FakeNvmlControl

    nvml = fake_node(H100X8_NVLINK)
    [gpu] = discover(nvml, settings())
    control = FakeNvmlControl.from_config_file(next(tmp_path.glob("*-nvml.yaml")))
    health = HealthTracker(nvml, quiet_period=0.5, check_interval=0.1)
    health.start()
    try:
        generation = health.generation
        control.inject_xid(5, 79)
        generation = health.wait_change(generation, timeout=5)
        assert not health.healthy(gpu.devices[5])
        health.wait_change(generation, timeout=5)
        assert health.healthy(gpu.devices[5])
    finally:
        health.stop()
