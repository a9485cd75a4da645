"""How a pool is split into ResourceSlices (pure logic; publishing against the real API
server is tested in e2e/tests/kubelet_plugin/test_kubelet_plugin_slices.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice_draplugin import Pool
from gpuslice_draplugin.slices import build_specs

pytestmark = pytest.mark.timeout(30)
Obj = dict[str, Any]


def plain(n: int, start: int = 0) -> list[Obj]:
    return [{"name": f"d-{i}", "attributes": {}} for i in range(start, start + n)]


def test_slices_hold_128_devices_or_64_with_taints_or_counters() -> None:
    specs = build_specs(Pool(plain(300)), counters_in_own_slices=True)
    assert [len(s["devices"]) for s in specs] == [128, 128, 44]
    tainted = plain(130)
    tainted[100]["taints"] = [{"key": "k", "effect": "NoSchedule"}]
    specs = build_specs(Pool(tainted), counters_in_own_slices=True)
    assert all(
        len(s["devices"]) <= 64 or not any("taints" in d for d in s["devices"]) for s in specs
    )
    assert sum(len(s["devices"]) for s in specs) == 130
    assert [d["name"] for s in specs for d in s["devices"]] == [d["name"] for d in tainted]


def _counter_pool(gpus: int) -> Pool:
    devices, sets = [], []
    for g in range(gpus):
        counters = {"memory-slice-0": {"value": "1"}}
        sets.append({"name": f"gpu-{g}-counter-set", "counters": counters})
        for p in range(25):
            devices.append(
                {
                    "name": f"gpu-{g}-mig-{p}",
                    "consumesCounters": [{"counterSet": f"gpu-{g}-counter-set", "counters": {}}],
                }
            )
    return Pool(devices, sets)


def test_counters_get_their_own_slices_on_1_35_and_later() -> None:
    specs = build_specs(_counter_pool(10), counters_in_own_slices=True)
    counters = [s for s in specs if "sharedCounters" in s]
    devices = [s for s in specs if "devices" in s]
    assert [len(s["sharedCounters"]) for s in counters] == [8, 2]
    assert not any("devices" in s for s in counters)
    assert [len(s["devices"]) for s in devices] == [64, 64, 64, 58]


def test_on_1_34_each_counter_set_shares_a_slice_with_its_devices() -> None:
    specs = build_specs(_counter_pool(3), counters_in_own_slices=False)
    assert len(specs) == 3
    for g, spec in enumerate(specs):
        assert [c["name"] for c in spec["sharedCounters"]] == [f"gpu-{g}-counter-set"]
        assert {d["consumesCounters"][0]["counterSet"] for d in spec["devices"]} == {
            f"gpu-{g}-counter-set"
        }


def test_an_empty_pool_still_publishes_one_slice() -> None:
    assert build_specs(Pool(), counters_in_own_slices=True) == [{"devices": []}]
