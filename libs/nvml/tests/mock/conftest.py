"""The mock libnvidia-ml these modules load, built (or found in the cache) once per session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="session")
def mock_lib_dir() -> Path:
    """The directory of the built mock (hack/nvml-mock.sh, cached by source hash)."""
    build = subprocess.run(
        ["bash", str(ROOT / "hack" / "nvml-mock.sh")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert build.returncode == 0, f"hack/nvml-mock.sh failed:\n{build.stderr}"
    lib_dir = Path(build.stdout.strip().splitlines()[-1])
    assert (lib_dir / "libnvidia-ml.so.1").is_file()
    return lib_dir
