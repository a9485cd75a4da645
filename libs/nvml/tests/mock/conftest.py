"""The mock libnvidia-ml these modules load, built (or found in the cache) once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_testkit.nvml_mock import mock_library_dir


@pytest.fixture(scope="session")
def mock_lib_dir() -> Path:
    """The directory of the built mock (hack/nvml-mock.sh, cached by source hash)."""
    lib_dir = mock_library_dir()
    assert (lib_dir / "libnvidia-ml.so.1").is_file()
    return lib_dir
