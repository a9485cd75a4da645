"""What every backend reports about the node and its GPUs."""

from __future__ import annotations

import re

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml.interface import Nvml
from gpuslice_nvml.types import ComputeMode, TopologyLevel

UUID = re.compile(r"^GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")
BUS_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def test_system_info(nvml: Nvml) -> None:
    info = nvml.system_info()
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", info.driver_version)
    assert info.cuda_driver_version >= 10000
    assert re.fullmatch(r"\d+\.\d", info.cuda_version)


def test_gpus(nvml: Nvml) -> None:
    gpus = nvml.gpus()
    assert len(gpus) == nvml.device_count() > 0
    assert [g.index for g in gpus] == list(range(len(gpus)))
    assert len({g.uuid for g in gpus}) == len(gpus)
    assert len({g.pci_bus_id for g in gpus}) == len(gpus)
    for gpu in gpus:
        assert UUID.match(gpu.uuid), gpu.uuid
        assert BUS_ID.match(gpu.pci_bus_id), gpu.pci_bus_id
        assert gpu.pci_device_id & 0xFFFF == 0x10DE  # NVIDIA's PCI vendor id
        assert gpu.name and gpu.brand and gpu.architecture
        assert gpu.memory_total_bytes > 1 << 30
        assert gpu.multiprocessors > 0
        assert gpu.cuda_compute_capability[0] >= 3
        assert gpu.mig_capable == (gpu.mig_mode is not None)
        assert nvml.gpu(gpu.index) == gpu


def test_memory_info(nvml: Nvml) -> None:
    for gpu in nvml.gpus():
        by_index = nvml.memory_info(gpu.index)
        by_uuid = nvml.memory_info(gpu.uuid)
        assert by_index.total == by_uuid.total == gpu.memory_total_bytes
        assert by_index.used + by_index.free <= by_index.total


def test_lookup_errors(nvml: Nvml) -> None:
    with pytest.raises(e.NvmlInvalidArgument):
        nvml.gpu(nvml.device_count())
    with pytest.raises(e.NvmlNotFound):
        nvml.memory_info("GPU-00000000-0000-0000-0000-000000000000")


def test_topology_is_symmetric(nvml: Nvml) -> None:
    count = nvml.device_count()
    for a in range(count):
        assert nvml.topology(a, a).level is TopologyLevel.INTERNAL
        for b in range(a + 1, count):
            ab, ba = nvml.topology(a, b), nvml.topology(b, a)
            assert ab == ba
            assert ab.level is not TopologyLevel.INTERNAL
            assert ab.nvlinks >= 0


def test_processes(nvml: Nvml) -> None:
    for gpu in nvml.gpus():
        for proc in nvml.running_processes(gpu.index):
            assert proc.pid > 0 and proc.gpu_index == gpu.index
        if not gpu.mig_enabled:
            for sample in nvml.process_utilization(gpu.index):
                assert sample.pid > 0 and 0 <= sample.sm_percent <= 100


def test_compute_mode_and_mps_clients(nvml: Nvml) -> None:
    """Read-only: the mode is a known one, MPS clients and contexts of their own are apart."""
    for gpu in nvml.gpus():
        assert nvml.compute_mode(gpu.index) in set(ComputeMode)
        mps = {p.pid for p in nvml.mps_processes(gpu.index)}
        own = {p.pid for p in nvml.running_processes(gpu.index)}
        assert not mps & own, "a process is either an MPS client or has a context of its own"
    with pytest.raises(e.NvmlInvalidArgument):
        nvml.compute_mode(nvml.device_count())
