"""The stand-in ``nvidia-smi`` resets a GPU in the fake node's state, as the real one would."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_testkit import nvidia_smi

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text("name: smi\nstatePath: state.json\ngpus:\n  - model: A100-SXM4-40GB\n")
    monkeypatch.setenv(nvidia_smi.CONFIG_ENV, str(path))
    return path


def test_a_reset_makes_the_pending_mig_mode_current_unless_in_use(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeNvml.from_config_file(config) as nvml:
        nvml.set_mig_mode(0, True)
        bus = nvml.gpu(0).pci_bus_id
        uuid = nvml.gpu(0).uuid
    control = FakeNvmlControl.from_config_file(config)
    control.add_process(77, uuid, used_memory_bytes=1 << 20)
    long_domain = "0000" + bus.upper()  # NVML's busId has an 8-digit domain

    assert nvidia_smi.main(["--gpu-reset", "-i", long_domain]) == 1
    assert "(in use)" in capsys.readouterr().err  # what the real backend maps to IN_USE
    control.remove_process(77)
    assert nvidia_smi.main(["--gpu-reset", "-i", long_domain]) == 0
    with FakeNvml.from_config_file(config) as nvml:
        assert (nvml.mig_mode(0).current, nvml.mig_mode(0).pending) == (True, True)


def test_other_uses_and_unknown_gpus_are_refused(config: Path) -> None:
    assert nvidia_smi.main(["-q"]) == 2
    assert nvidia_smi.main(["--gpu-reset", "-i", "0000:ff:00.0"]) == 6


def test_the_shim_runs_the_module_from_path(config: Path, tmp_path: Path) -> None:
    shim = nvidia_smi.write_shim(tmp_path / "bin")
    done = subprocess.run([str(shim), "-q"], capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    assert "only `nvidia-smi --gpu-reset -i <bus id>`" in done.stderr


def test_compute_policy_sets_the_time_slice_in_the_fake_state(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the real backend's ``set_compute_time_slice`` runs, as NVIDIA's DRA driver runs it."""
    with FakeNvml.from_config_file(config) as nvml:
        uuid = nvml.gpu(0).uuid
    control = FakeNvmlControl.from_config_file(config)
    assert control.state().gpus[0].time_slice == 0
    assert nvidia_smi.main(["compute-policy", "-i", uuid, "--set-timeslice=3"]) == 0
    assert control.state().gpus[0].time_slice == 3
    assert nvidia_smi.main(["compute-policy", "-i", "GPU-none", "--set-timeslice=1"]) == 6
    with pytest.raises(SystemExit):
        nvidia_smi.main(["compute-policy", "-i", uuid, "--set-timeslice=4"])
    assert "invalid choice: 4" in capsys.readouterr().err
    assert control.state().gpus[0].time_slice == 3
