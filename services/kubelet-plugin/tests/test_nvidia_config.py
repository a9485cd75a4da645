"""NVIDIA's GpuConfig and MigDeviceConfig under our driver name: decoded strictly, mapped onto
gpuslice's limits, and what prepare would ask the enforcer for (the plan), from claim objects as
the API server returns them. No API server: parse_claim and make_plan are pure."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice_api.gpuconfig import decode
from gpuslice_api.names import DRIVER
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_draplugin import ClaimRef
from gpuslice_kubelet_plugin.claims import ClaimError, parse_claim
from gpuslice_kubelet_plugin.discovery import Inventory, discover
from gpuslice_kubelet_plugin.plan import Plan, make_plan
from gpuslice_testkit.kubelet_plugin.dra import gpu_config, result
from gpuslice_testkit.kubelet_plugin.harness import Node

GIB = 1024**3
POOL = "node-a"
NV = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
NV_MIG = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"}
MIG = "gpu-2-mig-3g-40gb-4"


def mps(**fields: Any) -> dict[str, Any]:
    return {**NV, "sharing": {"strategy": "MPS", "mpsConfig": fields}}


def claim(
    results: list[dict[str, Any]],
    config: list[dict[str, Any]],
    requests: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim as the API returns it; ``requests``: its spec's requests (default: one
    ``exactly`` request per result, asking for no capacity)."""
    names = dict.fromkeys(r["request"] for r in results)
    spec_requests = requests or [
        {"name": n, "exactly": {"deviceClassName": "gpu.gpuslice.dev"}} for n in names
    ]
    return {
        "metadata": {"uid": "u1", "namespace": "ns", "name": "c"},
        "spec": {"devices": {"requests": spec_requests}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}},
    }


@pytest.fixture
def inventory(node: Node) -> Inventory:
    return discover(node.nvml)  # gpu-0, gpu-1 (H100), gpu-2 in MIG mode


def plan(inventory: Inventory, obj: dict[str, Any]) -> Plan:
    parsed = parse_claim(obj, ClaimRef("ns", "c", "u1"), driver=DRIVER, pool=POOL)
    return make_plan(parsed, inventory, POOL)


def refused(inventory: Inventory, obj: dict[str, Any]) -> str:
    with pytest.raises(ClaimError) as err:
        plan(inventory, obj)
    assert err.value.reason == "BadConfig"
    return str(err.value)


def test_every_field_of_nvidia_mps_maps_onto_our_limits() -> None:
    config = decode(
        mps(
            defaultActiveThreadPercentage=50,
            defaultPinnedDeviceMemoryLimit="10Gi",
            defaultPerDevicePinnedMemoryLimit={"0": "4Gi", "GPU-x": "1.5Gi"},
            multiUser=False,
        )
    )
    assert config.sharing.strategy == "MPS"
    assert (config.limits.cores, config.limits.memory) == (50, 10 * GIB)
    assert config.device_memory == {"0": 4 * GIB, "GPU-x": 1536 * 1024**2}
    assert config.origin == "resource.nvidia.com/v1beta1 GpuConfig" and config.targets == "gpu"


def test_nvidia_time_slicing_is_accepted_and_mig_time_slicing_too() -> None:
    intervals: list[dict[str, Any]] = [
        {},
        {"timeSlicingConfig": {}},
        {"timeSlicingConfig": {"interval": "Default"}},
        {"timeSlicingConfig": {"interval": "Short"}},
        {"timeSlicingConfig": {"interval": "Medium"}},
        {"timeSlicingConfig": {"interval": "Long"}},
    ]
    for interval in intervals:
        config = decode({**NV, "sharing": {"strategy": "TimeSlicing", **interval}})
        assert config.sharing.strategy == "TimeSlicing" and config.limits.cores is None
        assert config.time_slice == (interval.get("timeSlicingConfig") or {}).get("interval")
    mig = decode({**NV_MIG, "sharing": {"strategy": "TimeSlicing"}})
    assert mig.targets == "mig" and mig.sharing.strategy == "TimeSlicing"
    assert decode(NV).sharing.strategy is None  # no sharing: the GPU is the claim's alone


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {**NV, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "X"}}},
            "sharing.timeSlicingConfig.interval: 'X' is not allowed",
        ),
        (mps(multiUser=True), "sharing.mpsConfig.multiUser: true cannot be honoured"),
        (
            mps(defaultActiveThreadPercentage=0),
            "defaultActiveThreadPercentage: 0 is not allowed (Input should be greater than or "
            "equal to 1); allowed: an integer 1..100",
        ),
        (
            mps(defaultPinnedDeviceMemoryLimit="512Ki"),
            "defaultPinnedDeviceMemoryLimit: '512Ki' is not allowed (must be at least 1Mi)",
        ),
        (mps(defaultPerDevicePinnedMemoryLimit={"0": "lots"}), "device '0': 'lots': not a"),
        (mps(activeThreads=3), "unknown field 'activeThreads' in sharing.mpsConfig"),
        ({**NV, "sharing": {"strategy": "MPS"}, "limits": {}}, "unknown field 'limits'"),
        (
            {**NV, "sharing": {"strategy": "TimeSlicing", "mpsConfig": {}}},
            "sharing.mpsConfig is not allowed with sharing.strategy TimeSlicing",
        ),
        ({**NV, "sharing": {}}, "sharing.strategy: required (allowed: TimeSlicing, MPS)"),
        (
            {**NV_MIG, "sharing": {"strategy": "MPS"}},
            "sharing.strategy: 'MPS' cannot be honoured: the gpuslice enforcer does not run MPS "
            "inside MIG devices",
        ),
        (
            {**NV_MIG, "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {}}},
            "unknown field 'timeSlicingConfig' in sharing",
        ),
        (
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig"},
            "this driver accepts gpu.gpuslice.dev/v1alpha1 GpuConfig and NVIDIA's "
            "resource.nvidia.com/v1beta1 GpuConfig and MigDeviceConfig",
        ),
    ],
)
def test_what_we_cannot_honour_is_refused_by_name(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        decode(parameters, what="GpuConfig #0")
    assert str(err.value).startswith("GpuConfig #0: ")
    assert message in str(err.value)


def test_nvidia_mps_quickstart_asks_the_enforcer_for_its_limits(inventory: Inventory) -> None:
    """NVIDIA's gpu-test-mps: no capacity asked for (the claim holds the whole GPU), MPS at 50 %
    and 10Gi: the enforcer gets one hard share with those limits for the claim."""
    obj = claim(
        [result("gpu-0", pool=POOL, request="mps-gpu", cores="100", memory="81559Mi")],
        [gpu_config(mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi"))],
    )
    share = plan(inventory, obj).share
    assert share is not None
    assert (share.cores, share.memory_bytes, share.mode) == (50, 10 * GIB, "Hard")


def test_time_slicing_and_mps_requests_of_one_claim(inventory: Inventory) -> None:
    """NVIDIA's gpu-test5 with the Default interval: the time-sliced GPU needs no share."""
    obj = claim(
        [
            result("gpu-0", pool=POOL, request="ts-gpu"),
            result("gpu-1", pool=POOL, request="mps-gpu"),
        ],
        [
            gpu_config({**NV, "sharing": {"strategy": "TimeSlicing"}}, requests=["ts-gpu"]),
            gpu_config(mps(defaultActiveThreadPercentage=50), requests=["mps-gpu"]),
        ],
    )
    got = plan(inventory, obj)
    assert [(p.device.name, p.cores, p.is_share) for p in got.devices] == [
        ("gpu-0", 100, False),
        ("gpu-1", 50, True),
    ]
    assert got.share is not None and got.share.device_uuids == (got.devices[1].device.uuid,)


def test_per_device_memory_limits_by_index_or_uuid(inventory: Inventory) -> None:
    gpu1 = inventory.get("gpu-1")
    assert gpu1 is not None
    two = [result("gpu-0", pool=POOL), result("gpu-1", pool=POOL)]
    same = {"0": "4Gi", gpu1.uuid: "4Gi"}
    got = plan(inventory, claim(two, [gpu_config(mps(defaultPerDevicePinnedMemoryLimit=same))]))
    assert got.share is not None and got.share.memory_bytes == 4 * GIB
    # the enforcer holds one limit per claim: different per-device limits are refused
    differ = mps(
        defaultPinnedDeviceMemoryLimit="10Gi", defaultPerDevicePinnedMemoryLimit={"1": "4Gi"}
    )
    message = refused(inventory, claim(two, [gpu_config(differ)]))
    assert "one cores/memory limit" in message and "gpu-0 (100 cores, 10Gi)" in message
    bad_key = mps(defaultPerDevicePinnedMemoryLimit={"2": "4Gi"})
    message = refused(inventory, claim(two, [gpu_config(bad_key)]))
    assert "defaultPerDevicePinnedMemoryLimit: device '2' is neither an index (0..1)" in message


def test_nvidia_kinds_configure_their_own_device_type(inventory: Inventory) -> None:
    results = [result("gpu-0", pool=POOL, request="gpu"), result(MIG, pool=POOL, request="mig")]
    # without requests, each kind passes over the other device type
    got = plan(
        inventory,
        claim(
            results,
            [
                gpu_config(mps(defaultActiveThreadPercentage=30)),
                gpu_config({**NV_MIG, "sharing": {"strategy": "TimeSlicing"}}),
            ],
        ),
    )
    assert [(p.device.name, p.cores) for p in got.devices] == [("gpu-0", 30), (MIG, None)]
    # naming the MIG request, NVIDIA's GpuConfig is an error, as in NVIDIA's driver
    message = refused(inventory, claim(results, [gpu_config(mps(), requests=["mig"])]))
    assert f"resource.nvidia.com/v1beta1 GpuConfig cannot configure {MIG}, a MIG device" in message


def test_a_config_limit_that_contradicts_the_requested_capacity_is_refused(
    inventory: Inventory,
) -> None:
    capacity = [
        {
            "name": "gpu",
            "exactly": {
                "deviceClassName": "gpu.gpuslice.dev",
                "capacity": {"requests": {"cores": "30", "memory": "8Gi"}},
            },
        }
    ]
    results = [result("gpu-0", pool=POOL, cores="30", memory="8Gi")]
    message = refused(inventory, claim(results, [gpu_config(limits={"cores": 50})], capacity))
    assert (
        "request gpu asks for cores 30 (capacity) and its gpu.gpuslice.dev/v1alpha1 GpuConfig "
        "sets limits.cores to 50: capacity requests win, so the two contradict" in message
    )
    nvidia = gpu_config(mps(defaultPinnedDeviceMemoryLimit="4Gi"))
    message = refused(inventory, claim(results, [nvidia], capacity))
    assert "sets sharing.mpsConfig.defaultPinnedDeviceMemoryLimit to 4Gi" in message
    # equal values agree; a limit on a capacity the request did not name applies within it
    agree = gpu_config(limits={"cores": 30})
    share = plan(inventory, claim(results, [agree], capacity)).share
    assert share is not None and (share.cores, share.memory_bytes) == (30, 8 * GIB)
    whole = [result("gpu-0", pool=POOL, cores="100", memory="81559Mi")]
    share = plan(inventory, claim(whole, [gpu_config(limits={"cores": 25})])).share
    assert share is not None and share.cores == 25
