"""The real backend without a GPU: pynvml's functions are replaced by a small stub H100.

These tests pin what cannot be seen on a GPU-less machine: which NVML calls are made, how
their results are decoded, how profile names are computed and how pynvml errors map.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml import open_nvml
from gpuslice_nvml.real import RealNvml
from gpuslice_nvml.types import ComputeMode, HealthEventKind, Placement, TopologyLevel

UUID = "GPU-11111111-2222-3333-4444-555555555555"
MIG_UUID = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
TOTAL = 81559 * 1024 * 1024

# enum: (driver id, slices, count, SMs, memory MiB, placement starts, memory slices)
H100 = {
    0: (19, 1, 7, 16, 9984, range(7), 1),
    7: (20, 1, 1, 16, 9984, range(7), 1),
    9: (15, 1, 4, 26, 20096, (0, 2, 4, 6), 2),
    1: (14, 2, 3, 32, 20096, (0, 2, 4), 2),
    2: (9, 3, 2, 60, 40448, (0, 4), 4),
    3: (5, 4, 1, 64, 40448, (0,), 4),
    4: (0, 7, 1, 132, 81152, (0,), 8),
}
BY_ID = {v[0]: (enum, v) for enum, v in H100.items()}


def raise_(cls: Any) -> Any:
    def fn(*_args: Any) -> Any:
        raise cls()

    return fn


class StubH100:
    """Installs pynvml replacements for one H100 at 0000:18:00.0 with MIG enabled."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mp = monkeypatch
        self.calls: list[str] = []
        fns: dict[str, Any] = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda i: "h0",
            "nvmlDeviceGetUUID": lambda h: MIG_UUID if h == "mig0" else UUID,
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(
                busId=b"00000000:18:00.0", pciDeviceId=0x233010DE
            ),
            "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
            "nvmlDeviceGetMinorNumber": lambda h: 0,
            "nvmlDeviceGetName": lambda h: "NVIDIA H100 80GB HBM3",
            "nvmlDeviceGetBrand": lambda h: 14,
            "nvmlDeviceGetArchitecture": lambda h: 9,
            "nvmlDeviceGetAttributes": raise_(pynvml.NVMLError_NotSupported),
            "nvmlDeviceGetNumGpuCores": lambda h: 16896,
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(
                total=TOTAL, used=1 << 30, free=TOTAL - (1 << 30)
            ),
            "nvmlDeviceGetNumaNodeId": lambda h: 0,
            "nvmlDeviceGetAddressingMode": raise_(pynvml.NVMLError_NotSupported),  # PCIe
            "nvmlDeviceGetMigMode": lambda h: [1, 1],
            "nvmlDeviceGetGpuInstanceProfileInfo": self.profile_info,
            "nvmlDeviceGetGpuInstancePossiblePlacements": self.placements,
        }
        for name, fn in fns.items():
            monkeypatch.setattr(pynvml, name, fn)

    def set(self, name: str, fn: Any) -> None:
        self.mp.setattr(pynvml, name, fn)

    @staticmethod
    def profile_info(h: Any, enum: int, version: int = 2) -> Any:
        if enum in H100:
            pid, slices, count, sms, mem, _, _ = H100[enum]
            return SimpleNamespace(
                id=pid,
                isP2pSupported=0,
                sliceCount=slices,
                instanceCount=count,
                multiprocessorCount=sms,
                copyEngineCount=slices,
                decoderCount=slices,
                encoderCount=0,
                jpegCount=slices,
                ofaCount=1 if enum in (4, 7) else 0,
                memorySizeMB=mem,
            )
        if enum % 2:
            raise pynvml.NVMLError_InvalidArgument()
        raise pynvml.NVMLError_NotSupported()

    @staticmethod
    def placements(h: Any, profile_id: int, array: Any, count_ref: Any) -> int:
        _, (_, _, _, _, _, starts, size) = BY_ID[profile_id]
        for i, start in enumerate(starts):
            array[i].start, array[i].size = start, size
        count_ref._obj.value = len(starts)
        return 0


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> StubH100:
    return StubH100(monkeypatch)


@pytest.fixture
def nvml(stub: StubH100) -> Iterator[RealNvml]:
    backend = RealNvml()
    yield backend
    backend.close()


def test_library_not_found_is_mapped_with_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", raise_(pynvml.NVMLError_LibraryNotFound))
    with pytest.raises(e.NvmlLibraryNotFound) as info:
        open_nvml("real")
    assert info.value.code == e.ERROR_LIBRARY_NOT_FOUND
    assert isinstance(info.value.__cause__, pynvml.NVMLError_LibraryNotFound)
    assert "libnvidia-ml.so.1" in str(info.value)
    assert "--nvml=fake" in str(info.value)


def test_driver_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", raise_(pynvml.NVMLError_DriverNotLoaded))
    with pytest.raises(e.NvmlDriverNotLoaded, match="kernel module"):
        RealNvml()


def test_static_info_is_decoded(nvml: RealNvml) -> None:
    gpu = nvml.gpu(0)
    assert gpu.uuid == UUID
    assert gpu.pci_bus_id == "0000:18:00.0"
    assert gpu.pci_device_id == 0x233010DE
    assert (gpu.brand, gpu.architecture) == ("Nvidia", "Hopper")
    assert gpu.cuda_compute_capability == (9, 0)
    assert gpu.multiprocessors == 132  # 16896 cores / 128 per SM (attributes unsupported)
    assert gpu.memory_total_mib == 81559
    assert gpu.mig_capable and gpu.mig_enabled
    assert gpu.addressing_mode is None  # not supported on a PCIe system: no attribute


@pytest.mark.parametrize(("value", "mode"), [(0, "None"), (1, "HMM"), (2, "ATS")])
def test_addressing_mode_of_coherent_systems(stub: StubH100, value: int, mode: str) -> None:
    stub.set("nvmlDeviceGetAddressingMode", lambda h: value)
    with contextlib.closing(RealNvml()) as nvml:
        assert nvml.gpu(0).addressing_mode == mode


def test_bad_index_and_unknown_uuid(nvml: RealNvml) -> None:
    with pytest.raises(e.NvmlInvalidArgument):
        nvml.gpu(3)
    with pytest.raises(e.NvmlNotFound):
        nvml.memory_info("GPU-00000000-0000-0000-0000-000000000000")


def test_profiles_skip_unsupported_enums_and_get_go_nvlib_names(
    nvml: RealNvml, stub: StubH100
) -> None:
    profiles = nvml.gpu_instance_profiles(0)
    # asked enum by enum, listed smallest first like nvidia-smi and the fake
    assert [p.name for p in profiles] == [
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    ]
    by_name = {p.name: p for p in profiles}
    assert by_name["1g.20gb"].placements == tuple(Placement(s, 2) for s in (0, 2, 4, 6))
    assert by_name["1g.20gb"].id == 15 and by_name["1g.20gb"].nvml_profile == 9
    assert by_name["3g.40gb"].memory_slices == 4


def test_profiles_fall_back_to_v1_on_old_drivers(nvml: RealNvml, stub: StubH100) -> None:
    def old_driver(h: Any, enum: int, version: int = 2) -> Any:
        if version == 2:
            raise pynvml.NVMLError_FunctionNotFound()
        return StubH100.profile_info(h, enum, version)

    stub.set("nvmlDeviceGetGpuInstanceProfileInfo", old_driver)
    assert len(nvml.gpu_instance_profiles(0)) == 7


def test_non_mig_gpu_reports_not_supported(nvml: RealNvml, stub: StubH100) -> None:
    stub.set("nvmlDeviceGetMigMode", raise_(pynvml.NVMLError_NotSupported))
    assert nvml.gpu(0).mig_mode is None
    with pytest.raises(e.NvmlNotSupported):
        nvml.gpu_instance_profiles(0)
    assert nvml.mig_devices(0) == []


def test_create_error_is_mapped_with_cause(nvml: RealNvml, stub: StubH100) -> None:
    stub.set(
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        raise_(pynvml.NVMLError_InsufficientResources),
    )
    with pytest.raises(e.NvmlInsufficientResources) as info:
        nvml.create_gpu_instance(0, 19, Placement(6, 1))
    assert isinstance(info.value.__cause__, pynvml.NVMLError_InsufficientResources)
    assert "nvmlDeviceCreateGpuInstanceWithPlacement" in str(info.value)


def test_create_passes_the_placement_by_reference(nvml: RealNvml, stub: StubH100) -> None:
    seen: dict[str, Any] = {}

    def create(h: Any, profile_id: int, placement_ref: Any) -> str:
        seen["placement"] = (placement_ref._obj.start, placement_ref._obj.size)
        return "gi"

    stub.set("nvmlDeviceCreateGpuInstanceWithPlacement", create)
    stub.set(
        "nvmlGpuInstanceGetInfo",
        lambda gi: SimpleNamespace(id=13, profileId=19, placement=SimpleNamespace(start=6, size=1)),
    )
    gi = nvml.create_gpu_instance(0, 19, Placement(6, 1))
    assert seen["placement"] == (6, 1)
    assert (gi.id, gi.profile_name, gi.placement) == (13, "1g.10gb", Placement(6, 1))


def test_mig_devices_skip_empty_slots(nvml: RealNvml, stub: StubH100) -> None:
    def by_index(h: Any, i: int) -> str:
        if i == 1:
            return "mig0"
        raise (pynvml.NVMLError_NotFound if i == 0 else pynvml.NVMLError_InvalidArgument)()

    gi_info = SimpleNamespace(id=2, profileId=9, placement=SimpleNamespace(start=4, size=4))
    for name, fn in {
        "nvmlDeviceGetMaxMigDeviceCount": lambda h: 3,
        "nvmlDeviceGetMigDeviceHandleByIndex": by_index,
        "nvmlDeviceGetGpuInstanceId": lambda h: 2,
        "nvmlDeviceGetComputeInstanceId": lambda h: 0,
        "nvmlDeviceGetGpuInstanceById": lambda h, gi: "gi2",
        "nvmlGpuInstanceGetInfo": lambda gi: gi_info,
        "nvmlGpuInstanceGetComputeInstanceById": lambda gi, ci: "ci0",
        "nvmlComputeInstanceGetInfo": lambda ci: SimpleNamespace(
            id=0, profileId=1, placement=SimpleNamespace(start=0, size=2)
        ),
        "nvmlDeviceGetAttributes": lambda h: SimpleNamespace(
            multiprocessorCount=32, computeInstanceSliceCount=2, memorySizeMB=40448
        ),
    }.items():
        stub.set(name, fn)
    (device,) = nvml.mig_devices(0)
    assert device.uuid == MIG_UUID and device.parent_uuid == UUID
    assert device.profile == "2c.3g.40gb"
    assert (device.gpu_instance_id, device.compute_instance_id) == (2, 0)
    assert device.placement == Placement(4, 4)


def test_no_utilization_samples_is_an_empty_list(nvml: RealNvml, stub: StubH100) -> None:
    stub.set("nvmlDeviceGetProcessUtilization", raise_(pynvml.NVMLError_NotFound))
    assert nvml.process_utilization(0) == []


def test_topology_counts_nvswitch_links(stub: StubH100) -> None:
    buses = {"h0": b"00000000:18:00.0", "h1": b"00000000:2A:00.0"}
    for name, fn in {
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: f"h{i}",
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h}",
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=buses[h], pciDeviceId=0),
        "nvmlDeviceGetTopologyCommonAncestor": lambda a, b: 40,
        # 18 links to NVSwitches on each GPU; link ids beyond 17 do not exist
        "nvmlDeviceGetNvLinkState": lambda h, link: (
            1 if link < 18 else raise_(pynvml.NVMLError_InvalidArgument)()
        ),
        "nvmlDeviceGetNvLinkRemotePciInfo": lambda h, link: SimpleNamespace(
            busId=b"00000000:C5:00.0"
        ),
        "nvmlDeviceGetNvLinkRemoteDeviceType": lambda h, link: 2,
    }.items():
        stub.set(name, fn)
    with RealNvml() as nvml:
        link = nvml.topology(0, 1)
        assert (link.level, link.nvlinks, link.label) == (TopologyLevel.NODE, 18, "NV18")
        assert nvml.topology(1, 1).level is TopologyLevel.INTERNAL


def test_event_wait(nvml: RealNvml, stub: StubH100) -> None:
    events = [
        SimpleNamespace(
            device="h0", eventType=0x8, eventData=79, gpuInstanceId=0xFFFFFFFF,
            computeInstanceId=0xFFFFFFFF,
        ),
    ]  # fmt: skip

    def wait(event_set: Any, timeout_ms: int) -> Any:
        if events:
            return events.pop()
        raise pynvml.NVMLError_Timeout()

    registered: list[int] = []
    for name, fn in {
        "nvmlEventSetCreate": lambda: "set",
        "nvmlEventSetFree": lambda s: None,
        "nvmlDeviceGetSupportedEventTypes": lambda h: 0xFFFF,
        "nvmlDeviceRegisterEvents": lambda h, mask, s: registered.append(mask),
        "nvmlEventSetWait": wait,
    }.items():
        stub.set(name, fn)
    with nvml.watch_events() as watch:
        assert registered == [0x8 | 0x2 | 0x4000]
        event = watch.wait(1.0)
        assert event is not None
        assert (event.kind, event.xid, event.gpu_uuid) == (HealthEventKind.XID, 79, UUID)
        assert event.gpu_instance_id is None
        assert watch.wait(0.01) is None


def test_lost_gpu_during_wait_becomes_an_event(nvml: RealNvml, stub: StubH100) -> None:
    for name, fn in {
        "nvmlEventSetCreate": lambda: "set",
        "nvmlEventSetFree": lambda s: None,
        "nvmlDeviceGetSupportedEventTypes": lambda h: 0xFFFF,
        "nvmlDeviceRegisterEvents": lambda h, mask, s: None,
        "nvmlEventSetWait": raise_(pynvml.NVMLError_GpuIsLost),
        "nvmlDeviceGetMemoryInfo": raise_(pynvml.NVMLError_GpuIsLost),
    }.items():
        stub.set(name, fn)
    with nvml.watch_events([0]) as watch:
        event = watch.wait(1.0)
    assert event is not None and event.kind is HealthEventKind.GPU_LOST


def test_memory_limits_pass_the_cgroup_and_decode(nvml: RealNvml, stub: StubH100) -> None:
    seen: list[tuple[object, int, int]] = []

    def set_limits(handle: Any, limits: Any) -> None:
        seen.append((limits.nameSpace, limits.softLimit, limits.hardLimit))

    def get_limits(handle: Any, limits: Any) -> None:
        limits.softLimit, limits.hardLimit, limits.currentUsed = 1 << 20, 2 << 20, 12345

    stub.set("nvmlDeviceSetMemoryLimits_v1", set_limits)
    stub.set("nvmlDeviceGetMemoryLimits_v1", get_limits)
    nvml.set_memory_limits(0, "/sys/fs/cgroup/pod/c", 1 << 20, 2 << 20)
    assert seen == [("/sys/fs/cgroup/pod/c", 1 << 20, 2 << 20)]  # pynvml decodes char*
    got = nvml.memory_limits(0, "/sys/fs/cgroup/pod/c")
    assert (got.soft_limit, got.hard_limit, got.current_used) == (1 << 20, 2 << 20, 12345)


def test_memory_limits_on_an_old_driver_are_function_not_found(
    nvml: RealNvml, stub: StubH100
) -> None:
    stub.set("nvmlDeviceGetMemoryLimits_v1", raise_(pynvml.NVMLError_FunctionNotFound))
    with pytest.raises(e.NvmlFunctionNotFound) as caught:
        nvml.memory_limits(0, "/sys/fs/cgroup")
    assert isinstance(caught.value.__cause__, pynvml.NVMLError)


def test_compute_mode_and_mps_clients_use_their_nvml_calls(stub: StubH100, nvml: RealNvml) -> None:
    modes: list[int] = [0]
    stub.set("nvmlDeviceGetMigMode", lambda h: [0, 0])
    stub.set("nvmlDeviceGetComputeMode", lambda h: modes[-1])
    stub.set("nvmlDeviceSetComputeMode", lambda h, mode: modes.append(mode))
    stub.set(
        "nvmlDeviceGetComputeRunningProcesses",
        lambda h: [SimpleNamespace(pid=10, usedGpuMemory=1 << 30)],
    )
    stub.set(
        "nvmlDeviceGetMPSComputeRunningProcesses",
        lambda h: [SimpleNamespace(pid=11, usedGpuMemory=None)],
    )
    assert nvml.compute_mode(0) is ComputeMode.DEFAULT
    nvml.set_compute_mode(0, ComputeMode.EXCLUSIVE_PROCESS)
    assert modes == [0, 3]  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert nvml.compute_mode(0) is ComputeMode.EXCLUSIVE_PROCESS
    assert [p.pid for p in nvml.running_processes(0)] == [10]
    mps = nvml.mps_processes(0)
    assert [(p.pid, p.used_memory_bytes, p.device_uuid) for p in mps] == [(11, None, UUID)]
    stub.set("nvmlDeviceSetComputeMode", raise_(pynvml.NVMLError_NoPermission))
    with pytest.raises(e.NvmlNoPermission, match="nvmlDeviceSetComputeMode"):
        nvml.set_compute_mode(0, ComputeMode.DEFAULT)
