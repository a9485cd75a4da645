"""Which nvidia-smi the real backend runs for a GPU reset and the compute time slice: the driver
root's, with the loaded libnvidia-ml's directory first on ``LD_LIBRARY_PATH``; else the one on
``PATH`` (toolkit injection, a host install, the test kit's stand-in)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_nvml.real import library

LIB = "usr/lib/x86_64-linux-gnu"


def test_the_driver_roots_nvidia_smi_runs_on_the_loaded_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other")
    (tmp_path / "usr/bin").mkdir(parents=True)
    smi = tmp_path / "usr/bin/nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    loaded = library.Library(path=tmp_path / LIB / "libnvidia-ml.so.1", root=tmp_path)
    command, env = library.nvidia_smi(tmp_path, loaded)
    assert command == str(smi)
    assert env is not None
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path / LIB}:/opt/other"


@pytest.mark.parametrize("root", [None, Path("/"), "empty"])
def test_without_one_under_the_root_the_one_on_path_runs(
    tmp_path: Path, root: Path | str | None
) -> None:
    driver_root = tmp_path if root == "empty" else root
    assert isinstance(driver_root, Path | None)
    assert library.nvidia_smi(driver_root, library.Library()) == ("nvidia-smi", None)
