"""GPU stage: what the manager reads through the real NVML matches the fake's catalog entry.

Read-only (test machines are shared): MIG mode is never changed and no instance is created.
Skipped with the reason where there is no NVIDIA GPU and driver.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.state import open_store
from gpuslice_nvml import GpuInstanceProfile, Nvml, NvmlError
from gpuslice_nvml.fake import find_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def real() -> Iterator[Nvml]:
    from gpuslice_nvml.real import RealNvml

    try:
        nvml = RealNvml()
    except NvmlError as exc:
        pytest.skip(f"no NVIDIA GPU/driver: {exc}")
    with nvml:
        yield nvml


def test_listing_reads_every_gpu(real: Nvml, tmp_path: Path) -> None:
    manager = MigManager(real, open_store(tmp_path, boot_id="gpu-stage"))
    snaps = manager.snapshots()
    assert [s.index for s in snaps] == list(range(real.device_count()))
    for snap in snaps:
        assert snap.info.uuid.startswith("GPU-")
        if snap.info.mig_capable:
            assert snap.info.mig_mode is not None
            assert snap.profiles, f"{snap.label()} is MIG-capable but lists no profiles"
            assert snap.total_compute in (4, 7, 8)
        for view in snap.instances:
            assert view.mig_uuid.startswith("MIG-") or view.compute_instances != 1
    assert not (tmp_path / "mig-manager.json").exists()  # reading writes nothing


def table(profiles: Iterable[GpuInstanceProfile]) -> list[tuple[object, ...]]:
    return sorted(
        (p.name, p.id, p.slice_count, p.memory_slices, p.instance_count, p.placements)
        for p in profiles
    )


def test_profiles_match_the_fake_catalog(real: Nvml) -> None:
    compared = 0
    for gpu in real.gpus():
        model = find_model(gpu.name)
        if not gpu.mig_capable or model is None:
            continue

        assert table(real.gpu_instance_profiles(gpu.index)) == table(
            model.gpu_instance_profiles()
        ), f"GPU {gpu.index} ({gpu.name}) differs from the catalog entry {model.key}"
        compared += 1
    if not compared:
        pytest.skip("no MIG-capable GPU of a catalog model on this machine")
