"""hack/nvml-mock.sh: builds once per source tree into its cache, says where, and says why not.

Runs the script as CI does, into a cache of its own (GPUSLICE_NVML_MOCK_CACHE) with the header
the default cache already holds (NVML_HEADER), so nothing is downloaded twice.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "nvml-mock.sh"

pytestmark = pytest.mark.timeout(300)  # a cold default cache fetches nvml.h from PyPI first


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.fixture(scope="module")
def header() -> str:
    default = run(env={})
    assert default.returncode == 0, default.stderr
    found = sorted(Path(default.stdout.split()[-1]).parent.glob("include-*/nvml.h"))
    assert found, "the default cache has no nvml.h"
    return str(found[-1])


def test_builds_once_then_reuses_the_cache(tmp_path: Path, header: str) -> None:
    env = {"GPUSLICE_NVML_MOCK_CACHE": str(tmp_path), "NVML_HEADER": header}
    assert run("--print-dir", env=env).returncode == 1  # nothing built yet
    first = run(env=env)
    assert first.returncode == 0, first.stderr
    lib_dir = Path(first.stdout.strip().splitlines()[-1])
    assert lib_dir.parent == tmp_path and (lib_dir / "libnvidia-ml.so.1").is_file()
    assert "NVML functions" in first.stderr
    again = run(env=env)
    assert again.stdout.strip() == str(lib_dir) and "built" not in again.stderr
    assert run("--print-dir", env=env).stdout.strip() == str(lib_dir)


def test_a_missing_header_is_named(tmp_path: Path) -> None:
    env = {"GPUSLICE_NVML_MOCK_CACHE": str(tmp_path), "NVML_HEADER": str(tmp_path / "nvml.h")}
    result = run(env=env)
    assert result.returncode != 0
    assert f"NVML_HEADER={tmp_path / 'nvml.h'} is not a file" in result.stderr
