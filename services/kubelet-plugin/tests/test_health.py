"""Health: NVML events become taints and health-stream entries, and recovery clears them (the
stream over the DRA socket is tested in e2e/tests/kubelet_plugin/test_kubelet_plugin_health.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice_kubelet_plugin.discovery import discover
from gpuslice_kubelet_plugin.health import HealthMonitor
from gpuslice_kubelet_plugin.metrics import PluginMetrics
from gpuslice_nvml import HealthEvent, HealthEventKind
from gpuslice_testkit.kubelet_plugin.harness import Node

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def monitor(node: Node, clock: Clock, quiet: float = 60.0) -> HealthMonitor:
    inventory = discover(node.nvml)
    return HealthMonitor(
        node.nvml, lambda: inventory, lambda: None, PluginMetrics(), quiet_period=quiet, clock=clock
    )


def taints(m: HealthMonitor, name: str) -> list[dict[str, Any]]:
    device = m.inventory().get(name)
    assert device is not None
    return m.taints(device)


def xid(gpu: int, code: int, clock: Clock, gi: int | None = None) -> HealthEvent:
    return HealthEvent(
        HealthEventKind.XID, gpu, "GPU-x", xid=code, gpu_instance_id=gi, timestamp=clock.now
    )


def test_critical_and_application_xids(node: Node) -> None:
    clock = Clock()
    m = monitor(node, clock)
    assert m.handle(xid(0, 79, clock)) is True
    assert m.handle(xid(0, 79, clock)) is False  # a repeat changes no taint
    assert taints(m, "gpu-0") == [
        {
            "key": "gpu.gpuslice.dev/xid",
            "value": "79",
            "effect": "NoSchedule",
            "timeAdded": "2027-01-15T08:00:00Z",
        }
    ]
    assert taints(m, "gpu-1") == []
    m.handle(xid(1, 13, clock))
    assert [t["effect"] for t in taints(m, "gpu-1")] == ["None"]
    health = {h.device: h for h in m.health()}
    assert not health["gpu-0"].healthy and "XID 79" in health["gpu-0"].message
    assert health["gpu-1"].healthy and "XID 13 (None)" in health["gpu-1"].message


def test_an_xid_on_a_mig_instance_taints_only_that_device(node: Node) -> None:
    clock = Clock()
    m = monitor(node, clock)
    mig = next(d for d in m.inventory().devices if d.name == "gpu-2-mig-3g-40gb-4")
    assert mig.mig is not None
    m.handle(xid(2, 94, clock, gi=mig.mig.gpu_instance_id))
    assert [t["value"] for t in taints(m, "gpu-2-mig-3g-40gb-4")] == ["94"]
    assert taints(m, "gpu-2-mig-1g-10gb-0") == []


def test_recovery_after_the_quiet_period_and_when_a_lost_gpu_answers(node: Node) -> None:
    clock = Clock()
    m = monitor(node, clock, quiet=60)
    m.handle(xid(0, 48, clock))
    clock.now += 30
    m.handle(xid(0, 48, clock))  # a repeat restarts the quiet period
    clock.now += 59
    assert m.check_recovery() is False
    clock.now += 2
    assert m.check_recovery() is True
    assert taints(m, "gpu-0") == []

    node.control.mark_gpu_lost(1)
    m.handle(HealthEvent(HealthEventKind.GPU_LOST, 1, "GPU-x", timestamp=clock.now))
    assert [t["key"] for t in taints(m, "gpu-1")] == ["gpu.gpuslice.dev/gpu-lost"]
    assert m.check_recovery() is False  # still lost
    node.control.mark_gpu_recovered(1)
    assert m.check_recovery() is True
    assert taints(m, "gpu-1") == []


def test_recovery_can_be_turned_off(node: Node) -> None:
    clock = Clock()
    inventory = discover(node.nvml)
    m = HealthMonitor(
        node.nvml,
        lambda: inventory,
        lambda: None,
        PluginMetrics(),
        quiet_period=1,
        recovery=False,
        clock=clock,
    )
    m.handle(xid(0, 79, clock))
    clock.now += 3600
    assert m.check_recovery() is False
    assert taints(m, "gpu-0") != []


def test_a_healthy_node_reports_zero_tainted_devices_from_the_start() -> None:
    """Alerts read the gauge: "no taint" is 0, not a missing series (which means not scraped)."""
    registry = PluginMetrics().registry
    name = "gpuslice_kubelet_plugin_tainted_devices"
    for effect in ("NoSchedule", "None"):
        assert registry.get_sample_value(name, {"effect": effect}) == 0.0
