"""MPS clients, processes that bypass MPS, and compute mode on the fake (``fake.contexts``)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl, mps_control
from gpuslice_nvml.types import ComputeMode, ProcessInfo

pytestmark = pytest.mark.timeout(30)

NODE = """
name: contexts-node
driverVersion: "580.159.04"
gpus:
  - model: NVIDIA H100 80GB HBM3
  - model: L4
"""


@pytest.fixture
def config(write_config: Callable[[str], Path]) -> Path:
    return write_config(NODE)


@pytest.fixture
def daemon(config: Path) -> Iterator[Path]:
    """A stand-in MPS control daemon for GPU 0; yields its pipe directory."""
    gpu0 = FakeNvml.from_config_file(config).gpu(0).uuid
    with tempfile.TemporaryDirectory(prefix="gs-ctx-") as directory:
        pipe = Path(directory)
        env = {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(pipe / "log"),
            "CUDA_VISIBLE_DEVICES": gpu0,
            "GPUSLICE_FAKE_NVML_CONFIG": str(config),
        }
        proc = subprocess.Popen([*mps_control.COMMAND, "-f"], env=env)
        try:
            deadline = time.monotonic() + 10
            while not (pipe / mps_control.PID_FILE).exists():
                assert proc.poll() is None and time.monotonic() < deadline, "daemon did not start"
                time.sleep(0.02)
            yield pipe
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _pids(processes: list[ProcessInfo]) -> set[int]:
    return {p.pid for p in processes}


def test_a_process_using_the_pipe_directory_is_an_mps_client(config: Path, daemon: Path) -> None:
    nvml, control = FakeNvml.from_config_file(config), FakeNvmlControl.from_config_file(config)
    control.add_process(101, 0, sm_percent=50, mps_pipe_dir=str(daemon))
    control.add_process(102, 0, sm_percent=50, mps_pipe_dir=None)  # CUDA's default: no daemon
    control.add_process(103, 0, mps_pipe_dir=str(daemon / "gpuslice" / "sh-1"))  # a namespace
    control.add_process(104, 1, mps_pipe_dir=str(daemon))  # the daemon does not serve GPU 1
    assert _pids(nvml.mps_processes(0)) == {101, 103}
    assert _pids(nvml.running_processes(0)) == {102}
    assert _pids(nvml.running_processes(1)) == {104}
    # MPS clients have no utilization samples of their own (their server has them)
    assert {s.pid for s in nvml.process_utilization(0)} == {102}


def test_a_pipe_directory_without_a_live_daemon_means_a_context_of_its_own(
    config: Path, tmp_path: Path
) -> None:
    (tmp_path / "control").touch()
    (tmp_path / mps_control.PID_FILE).write_text("999999999\n")  # no such process
    control = FakeNvmlControl.from_config_file(config)
    control.add_process(201, 0, mps_pipe_dir=str(tmp_path))
    nvml = FakeNvml.from_config_file(config)
    assert _pids(nvml.running_processes(0)) == {201}
    assert nvml.mps_processes(0) == []


def test_exclusive_process_mode_admits_only_the_mps_server(config: Path, daemon: Path) -> None:
    nvml, control = FakeNvml.from_config_file(config), FakeNvmlControl.from_config_file(config)
    assert nvml.compute_mode(0) is ComputeMode.DEFAULT
    nvml.set_compute_mode(0, ComputeMode.EXCLUSIVE_PROCESS)
    assert nvml.compute_mode(0) is ComputeMode.EXCLUSIVE_PROCESS
    assert nvml.compute_mode(1) is ComputeMode.DEFAULT
    control.add_process(301, 0, mps_pipe_dir=str(daemon))
    control.add_process(302, 0, mps_pipe_dir=str(daemon))  # clients share the server's context
    with pytest.raises(e.NvmlInUse, match=r"EXCLUSIVE_PROCESS.*MPS server"):
        control.add_process(303, 0)  # bypassing MPS: refused while the server holds the GPU
    control.add_process(301, 0, sm_percent=10, mps_pipe_dir=str(daemon))  # an update is fine
    control.remove_process(301)
    control.remove_process(302)
    control.add_process(304, 0)  # nobody holds it: one process may take it...
    with pytest.raises(e.NvmlInUse, match="pid 304"):
        control.add_process(305, 0, mps_pipe_dir=str(daemon))  # ...and then MPS cannot start
    nvml.set_compute_mode(0, ComputeMode.PROHIBITED)
    with pytest.raises(e.NvmlInUse, match="PROHIBITED"):
        control.add_process(306, 0)
    nvml.set_compute_mode(0, ComputeMode.DEFAULT)
    control.add_process(307, 0)
    assert _pids(nvml.running_processes(0)) == {304, 307}
