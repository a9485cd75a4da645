"""A driver root of files: the mock as libnvidia-ml.so.1, the device nodes the fake node names
as character devices with NVIDIA's majors, the driver's MIG capability listing, and a real
backend that runs on it with nothing but ``--driver-root``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice_core.driverroot import DriverRoot
from gpuslice_nvml import mock
from gpuslice_nvml.fake.control import FakeNvmlControl
from gpuslice_testkit.nvml_mock import (
    CAPS_MAJOR,
    CONFIG_IN_ROOT,
    NVIDIA_MAJOR,
    UVM_MAJOR,
    DriverRootFiles,
    mig_cap_minor,
    write_driver_root,
)

pytestmark = [
    pytest.mark.timeout(300),  # a cold build of the mock fetches nvml.h from PyPI first
    pytest.mark.skipif(os.geteuid() != 0, reason="mknod of character devices needs root"),
]

#: GPU 0: A100 in MIG mode with one 3g.20gb instance; GPU 1: L4 (no MIG).
CONFIG = """\
driverVersion: 570.158.01
gpus:
  - model: A100-SXM4-40GB
    migEnabled: true
    migInstances:
      - profile: 3g.20gb
  - model: L4
"""


@pytest.fixture
def files(tmp_path: Path) -> DriverRootFiles:
    config = tmp_path / "node.yaml"
    config.write_text(CONFIG)
    return write_driver_root(tmp_path / "root", config, "node-a", tmp_path / "state")


def chardev(path: Path) -> tuple[int, int]:
    st = path.lstat()
    assert stat.S_ISCHR(st.st_mode), f"{path} is not a character device"
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def test_the_fake_nodes_device_nodes_are_character_devices_with_nvidias_numbers(
    files: DriverRootFiles,
) -> None:
    dev = files.root / "dev"
    assert chardev(dev / "nvidia0") == (NVIDIA_MAJOR, 0)
    assert chardev(dev / "nvidia1") == (NVIDIA_MAJOR, 1)
    assert chardev(dev / "nvidiactl") == (NVIDIA_MAJOR, 255)
    assert chardev(dev / "nvidia-uvm") == (UVM_MAJOR, 0)
    assert chardev(dev / "nvidia-uvm-tools") == (UVM_MAJOR, 1)
    assert not (dev / "nvidia2").exists()
    # MIG: the config and monitor capabilities and every instance of the MIG-capable GPU 0
    # (the driver's static numbering), none for the L4
    caps = {int(p.name.removeprefix("nvidia-cap")) for p in (dev / "nvidia-caps").iterdir()}
    assert caps == {1, 2} | set(range(3, 3 + 15 * 9))
    assert chardev(dev / "nvidia-caps/nvidia-cap3") == (CAPS_MAJOR, 3)  # gpu0/gi0
    assert mig_cap_minor(0, 1, 0) == 13 and mig_cap_minor(1, 0) == 138
    assert chardev(dev / "nvidia-caps/nvidia-cap13") == (CAPS_MAJOR, 13)  # gpu0/gi1/ci0
    # the driver's listing of them, as DriverRoot reads procfs
    driver = DriverRoot(files.root, proc=files.proc)
    assert driver.caps_major() == CAPS_MAJOR
    nodes = driver.mig_nodes(0, 1, 0)
    assert [(n.path, n.major, n.minor) for n in nodes] == [
        ("/dev/nvidia-caps/nvidia-cap12", CAPS_MAJOR, 12),
        ("/dev/nvidia-caps/nvidia-cap13", CAPS_MAJOR, 13),
    ]
    assert files.devices[dev / "nvidia0"] == (NVIDIA_MAJOR, 0)


PRELUDE = (
    "import json, sys\n"
    "from pathlib import Path\n"
    "from gpuslice_nvml import open_nvml\n"
    "n = open_nvml('real', None, Path(sys.argv[1]))\n"
)


def on_root(root: Path, body: str, *, smi: bool = False) -> str:
    """``body`` in a child process (one libnvidia-ml per process) with ``n``, the real backend
    opened on the driver root ``root``, and neither LD_LIBRARY_PATH nor the mock's node variable:
    what it prints. ``smi``: the root's stand-in nvidia-smi may run (it imports gpuslice_nvml
    with the python3 beside ours) and no other nvidia-smi is on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", mock.NODE_ENV)}
    if smi:
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        env["PATH"] = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    run = subprocess.run(
        [sys.executable, "-c", PRELUDE + body, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_the_real_backend_runs_on_the_root_with_no_environment_of_its_own(
    files: DriverRootFiles,
) -> None:
    """The mock finds its node file beside itself; the state is where the node file says."""
    assert json.loads(files.node_file.read_text())["statePath"] == str(files.state_path)
    out = on_root(
        files.root,
        "print(json.dumps([str(n.library.path), n.system_info().driver_version,\n"
        "    [(g.name, g.minor, bool(g.mig_mode and g.mig_mode.current)) for g in n.gpus()],\n"
        "    len(n.mig_devices(0))]))\n",
    )
    library, driver, gpus, migs = json.loads(out)
    assert library == str(files.library)
    assert driver == "570.158.01"
    assert gpus == [["NVIDIA A100-SXM4-40GB", 0, True], ["NVIDIA L4", 1, False]]
    assert migs == 1
    assert files.state_path.is_file()


def test_a_pending_mig_mode_takes_effect_through_the_roots_nvidia_smi(tmp_path: Path) -> None:
    """The real backend resets a GPU with the driver root's nvidia-smi (here the fake node's
    stand-in), not one on PATH: the node pods have none without the toolkit."""
    config = tmp_path / "node.yaml"
    config.write_text("gpus:\n  - model: A100-SXM4-40GB\n")
    files = write_driver_root(tmp_path / "root", config, "node-b", tmp_path / "state")
    out = on_root(
        files.root,
        "before = n.set_mig_mode(0, True)\n"
        "after = n.reset_gpu(0)\n"
        "print(json.dumps([[before.current, before.pending], [after.current, after.pending]]))\n",
        smi=True,
    )
    assert json.loads(out) == [[False, True], [True, True]]


def test_a_time_slice_reaches_the_fake_node_through_the_roots_nvidia_smi(tmp_path: Path) -> None:
    """``set_compute_time_slice`` runs the same driver root's nvidia-smi as a reset (one helper
    finds it), so NVIDIA's ``timeSlicingConfig.interval`` works on a root of files too."""
    config = tmp_path / "node.yaml"
    config.write_text("gpus:\n  - model: A100-SXM4-40GB\n  - model: L4\n")
    files = write_driver_root(tmp_path / "root", config, "node-c", tmp_path / "state")
    on_root(files.root, "n.set_compute_time_slice(1, 2)\n", smi=True)
    control = FakeNvmlControl.from_config_file(files.root / CONFIG_IN_ROOT)
    assert [g.time_slice for g in control.state().gpus] == [0, 2]
