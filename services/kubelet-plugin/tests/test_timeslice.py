"""Which nvidia-smi sets a GPU's time slice: the driver root's, with its libnvidia-ml."""

from __future__ import annotations

from pathlib import Path

from gpuslice_core.driverroot import DriverRoot
from gpuslice_kubelet_plugin.timeslice import nvidia_smi
from gpuslice_nvml.types import NvidiaSmi

LIB = "usr/lib/x86_64-linux-gnu"


def test_the_driver_roots_nvidia_smi_runs_with_its_libraries(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    smi = tmp_path / "usr/bin/nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    (tmp_path / LIB).mkdir(parents=True)
    (tmp_path / LIB / "libnvidia-ml.so.580.65.06").write_bytes(b"\x7fELF")
    assert nvidia_smi(DriverRoot(tmp_path)) == NvidiaSmi(
        str(smi), (("LD_LIBRARY_PATH", str(tmp_path / LIB)),)
    )


def test_without_one_under_the_root_the_one_on_path_is_used(tmp_path: Path) -> None:
    """A driver the container runtime put into the image, or the sandbox's stand-in."""
    assert nvidia_smi(DriverRoot(tmp_path)) == NvidiaSmi("nvidia-smi", ())
