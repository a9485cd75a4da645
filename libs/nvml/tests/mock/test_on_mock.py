"""The real backend on the mock libnvidia-ml, in every run (issue 33).

The mock is built by hack/nvml-mock.sh (cached; ~2 s when the sources change) and loaded the
way a user loads it: a child pytest whose ``LD_LIBRARY_PATH`` finds it first. The child runs the
contract suites (``tests/contract``, "mock" backend only) and the one-model tests
(``tests/onmock``), which need the mock in the process and are not collected elsewhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice_nvml import mock

ROOT = Path(__file__).resolve().parents[4]
TESTS = Path(__file__).resolve().parents[1]
SUITES = [TESTS / "contract", TESTS / "onmock"]

pytestmark = pytest.mark.timeout(300)  # a cold build fetches nvml.h from PyPI first


def test_the_library_exports_what_the_real_backend_calls(mock_lib_dir: Path) -> None:
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(mock_lib_dir / "libnvidia-ml.so.1")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert exported and all(name.startswith("nvml") for name in exported)
    called = set()
    for source in (ROOT / "libs/nvml/src/gpuslice_nvml/real").glob("*.py"):
        called |= set(re.findall(r"pynvml\.(nvml\w+)", source.read_text()))
    # pynvml's names for the versioned C symbols it resolves
    versioned = {
        "nvmlDeviceGetCount": "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex": "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetPciInfo": "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetAttributes": "nvmlDeviceGetAttributes_v2",
        "nvmlDeviceGetGpuInstancePossiblePlacements": (
            "nvmlDeviceGetGpuInstancePossiblePlacements_v2"
        ),
        "nvmlComputeInstanceGetInfo": "nvmlComputeInstanceGetInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses": "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses": "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlEventSetWait": "nvmlEventSetWait_v2",
        "nvmlDeviceGetNvLinkRemotePciInfo": "nvmlDeviceGetNvLinkRemotePciInfo_v2",
        "nvmlInit": "nvmlInitWithFlags",
        "nvmlGpuInstanceGetComputeInstanceProfileInfo": (
            "nvmlGpuInstanceGetComputeInstanceProfileInfoV"
        ),
        "nvmlDeviceGetGpuInstanceProfileInfo": "nvmlDeviceGetGpuInstanceProfileInfoV",
    }
    missing = {versioned.get(name, name) for name in called} - exported
    assert not missing, f"the real backend calls what the mock lacks: {sorted(missing)}"


def test_contract_and_one_model_suites_pass_on_the_mock(mock_lib_dir: Path) -> None:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(mock_lib_dir), env.get("LD_LIBRARY_PATH", "")) if p
    )
    env[mock.ON_MOCK_ENV] = "1"
    env.pop(mock.NODE_ENV, None)  # each test points the mock at its own node
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, SUITES)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"{summary}\n{run.stdout[-8000:]}\n{run.stderr[-2000:]}"
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, run.stdout[-4000:]
