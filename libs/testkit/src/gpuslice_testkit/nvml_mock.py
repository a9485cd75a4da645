"""The mock libnvidia-ml.so.1 for service tests: build it, and the environment that makes a
service started with ``--nvml=real`` load it and answer for a fake node (docs/nvml-mock.md).

    for key, value in mock_nvml_env(config).items():   # LD_LIBRARY_PATH, GPUSLICE_NVML_MOCK_NODE
        monkeypatch.setenv(key, value)
    EnforcerProcess(config, workdir, ["--nvml=real"]).start()   # inherits the environment

Starters of services take a backend choice instead (``backend="mock"``) and build the flags and the
environment from ``nvml_flags`` and ``nvml_env``: the fake backend on the config, or the real
one on the mock driven by the same fake node.

The loader reads ``LD_LIBRARY_PATH`` when a process starts, so it works for child processes
only; the test process itself keeps whatever NVML it has.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from gpuslice_nvml import mock
from gpuslice_nvml.fake import mps_control
from gpuslice_nvml.fake.node import load_node
from gpuslice_nvml.types import FAKE_NVML_CONFIG_ENV
from gpuslice_testkit import nvidia_smi

NvmlBackend = Literal["fake", "mock"]
"""How a started service reaches a fake node's GPUs: ``fake``, the Python fake backend
(``--nvml=fake``); ``mock``, the real backend (``--nvml=real``) on the mock library."""

ROOT = Path(__file__).resolve().parents[4]


@functools.cache
def mock_library_dir() -> Path:
    """Build (or find in the cache) the mock library; its directory."""
    build = subprocess.run(
        ["bash", str(ROOT / "hack" / "nvml-mock.sh")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    if build.returncode != 0:
        raise RuntimeError(f"hack/nvml-mock.sh failed:\n{build.stderr}")
    return Path(build.stdout.strip().splitlines()[-1])


def mock_nvml_env(config: Path) -> dict[str, str]:
    """What to add to a service's environment so its real NVML backend is the mock on the fake
    node of ``config`` (the node file is written, the state created if missing), with the
    stand-in ``nvidia-smi`` (``gpuslice_testkit.nvidia_smi``) first on ``PATH`` for GPU resets
    and time slices."""
    path = os.pathsep.join(
        p for p in (str(mock_library_dir()), os.environ.get("LD_LIBRARY_PATH", "")) if p
    )
    env = mock.prepare(config)
    shim = nvidia_smi.write_shim(Path(env[mock.NODE_ENV]).parent / "bin")
    return {
        "LD_LIBRARY_PATH": path,
        **env,
        # the real backend resets a GPU and sets its time slice with nvidia-smi: the stand-in
        "PATH": os.pathsep.join((str(shim.parent), os.environ.get("PATH", os.defpath))),
        nvidia_smi.CONFIG_ENV: str(Path(config).resolve()),
    }


def nvml_flags(backend: NvmlBackend, config: Path) -> list[str]:
    """A service's flags for ``backend`` on the fake node of ``config``. On the mock the service
    gets only ``--nvml=real``, as on a node with a GPU: the node reaches it through the
    environment (``nvml_env``)."""
    if backend == "mock":
        return ["--nvml=real"]
    return ["--nvml=fake", f"--fake-nvml-config={config}"]


def nvml_env(backend: NvmlBackend, config: Path) -> dict[str, str]:
    """What a service started with ``nvml_flags(backend, config)`` adds to its environment."""
    return mock_nvml_env(config) if backend == "mock" else {}


def mock_mps_control(config: Path) -> str:
    """The enforcer's ``--mps-control`` on the mock's node: the fake's stand-in control daemon
    (``gpuslice_nvml.fake.mps_control``, the default with ``--nvml=fake``), told the fake node.
    The real daemon learns the driver version and the GPUs from the driver; the stand-in reads
    them from the node's config (protocol 3 needs driver 615+, ``allowed_devices`` must name
    its GPUs). The enforcer starts daemons and control commands with an environment of its own
    (``PATH`` and the ``CUDA_MPS_*`` variables), so the variable goes in the command line,
    through ``env``, which execs the stand-in (the daemon keeps ``env``'s pid, which the
    enforcer records)."""
    env = shutil.which("env") or "/usr/bin/env"
    node = f"{FAKE_NVML_CONFIG_ENV}={Path(config).resolve()}"
    return shlex.join([env, node, *mps_control.COMMAND])


def enforcer_flags(backend: NvmlBackend, config: Path) -> list[str]:
    """The enforcer's own flags for ``backend``: on the mock, the stand-in MPS control daemon
    (``mock_mps_control``), since a test node has no ``nvidia-cuda-mps-control``; nothing on
    the fake, whose stand-in is the enforcer's default there."""
    return [f"--mps-control={mock_mps_control(config)}"] if backend == "mock" else []


# ---- the mock as a driver library: a driver root of files -------------------------------------
#: Character-device majors of the nodes a driver root of files holds. 195 is NVIDIA's fixed
#: major (``/dev/nvidia<minor>``, ``/dev/nvidiactl`` = 255); ``nvidia-uvm`` and ``nvidia-caps``
#: get dynamic majors from the kernel, these are values seen on GPU hosts (caps: 241 on the
#: H200 host of docs/cdi.md). Nothing opens them: the runtime stats or makes them.
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
UVM_MAJOR = 510
CAPS_MAJOR = 241
#: The driver's static MIG capability minors (``/proc/driver/nvidia-caps/mig-minors``):
#: config 1, monitor 2, then per GPU 15 GPU instances x (1 + 8 compute instances).
MIG_CONFIG_MINOR = 1
MIG_MONITOR_MINOR = 2
_GI_STRIDE = 1 + mock.MAX_COMPUTE_INSTANCES
_GPU_STRIDE = mock.MAX_GPU_INSTANCES * _GI_STRIDE
LIBRARY_DIR = "usr/lib/x86_64-linux-gnu"
#: Stand-ins for what CDI injects besides libnvidia-ml: empty files, only ever bind-mounted.
STAND_IN_LIBRARIES = ("libcuda.so", "libnvidia-ptxjitcompiler.so")
STAND_IN_BINARIES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
#: The fake node's config inside the root, for the stand-in nvidia-smi (relative to the root).
CONFIG_IN_ROOT = "usr/share/gpuslice/fake-nvml.yaml"
#: ``usr/bin/nvidia-smi``: resets a GPU of the fake node and sets its compute time slice
#: (gpuslice_nvml.fake.smi), finding the
#: config from its own path, so it works wherever the root is mounted; a service image that
#: opens NVML has python3 and gpuslice_nvml on its PATH.
NVIDIA_SMI = f"""#!/usr/bin/env python3
import sys
from pathlib import Path

from gpuslice_nvml.fake import smi

config = Path(__file__).resolve().parents[2] / "{CONFIG_IN_ROOT}"
sys.exit(smi.main(sys.argv[1:], config, config_from=str(config)))
"""


def mig_cap_minor(gpu_minor: int, gpu_instance: int, compute_instance: int | None = None) -> int:
    """The ``nvidia-cap<N>`` minor of a GPU instance (or one of its compute instances)."""
    base = 3 + gpu_minor * _GPU_STRIDE + gpu_instance * _GI_STRIDE
    return base if compute_instance is None else base + 1 + compute_instance


@dataclass(frozen=True)
class DriverRootFiles:
    """What :func:`write_driver_root` laid out (every path is under ``root`` except the
    state). ``devices``: path -> (major, minor) of every character device made."""

    root: Path
    library: Path
    node_file: Path
    state_path: Path
    proc: Path
    devices: dict[Path, tuple[int, int]]


def write_driver_root(
    root: Path, nvml_config: Path, node_name: str, state_dir: Path
) -> DriverRootFiles:
    """Lay out under ``root`` a driver root whose ``libnvidia-ml.so.1`` is the mock answering
    for the fake node of ``nvml_config`` named ``node_name``, its state kept in ``state_dir``
    (a directory every NVML container mounts read-write at the same path; the chart's
    ``hostPaths.runDir`` is one). A service started with ``--nvml=real --driver-root=<root>``
    (or the chart with ``nvml.driverRoot=<root>``) runs on it with no environment of its own.

    The layout (docs/nvml-mock.md, "As a driver root"): the mock and its node file in
    ``usr/lib/x86_64-linux-gnu``; ``dev/nvidia<minor>`` per GPU, ``dev/nvidiactl``,
    ``dev/nvidia-uvm``, ``dev/nvidia-uvm-tools`` and, for MIG-capable GPUs, every
    ``dev/nvidia-caps/nvidia-cap<N>`` as character devices with NVIDIA's majors (made with
    ``mknod``: root only; containerd's CDI refuses a regular file); ``proc/devices`` and
    ``proc/driver/nvidia/capabilities`` as the driver lists them (for a kubelet plugin given
    ``--proc-root=<root>/proc``); ``usr/bin/nvidia-smi``, a stand-in that resets a GPU of the
    fake node (how a pending MIG mode takes effect) and sets its compute time slice
    (``compute-policy``), with the node's config in
    ``usr/share/gpuslice``; empty stand-ins for the other libraries and binaries CDI specs
    mount. Re-running it on the same root replaces the files."""
    # the node is the config as given, named and with its state in state_dir, kept in the
    # root (the same file, so the same digest, for the mock and the stand-in nvidia-smi)
    state_path = Path(state_dir).resolve() / f"{node_name}.json"
    raw = yaml.safe_load(Path(nvml_config).read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{nvml_config}: a fake NVML config is a mapping")
    raw.update(name=node_name, statePath=str(state_path))
    config = root / CONFIG_IN_ROOT
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    node = load_node(config)
    lib_dir = root / LIBRARY_DIR
    lib_dir.mkdir(parents=True, exist_ok=True)
    state_path.parent.mkdir(parents=True, exist_ok=True)
    library = lib_dir / "libnvidia-ml.so.1"
    staged = lib_dir / ".libnvidia-ml.so.1.new"  # renamed over: a running process keeps its copy
    shutil.copyfile(mock_library_dir() / "libnvidia-ml.so.1", staged)
    staged.chmod(0o755)
    staged.replace(library)
    node_file = mock.write_node_file(node, lib_dir / mock.LIBRARY_NODE_FILE)
    version = node.driver_version
    for name in STAND_IN_LIBRARIES:
        (lib_dir / f"{name}.{version}").write_bytes(b"")
        _link(lib_dir / f"{name}.1", f"{name}.{version}")
    _link(lib_dir / f"libnvidia-ml.so.{version}", "libnvidia-ml.so.1")
    bin_dir = root / "usr/bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in STAND_IN_BINARIES:
        (bin_dir / name).write_bytes(b"")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)

    devices: dict[Path, tuple[int, int]] = {
        Path(f"dev/nvidia{gpu.index}"): (NVIDIA_MAJOR, gpu.index) for gpu in node.gpus
    }
    devices[Path("dev/nvidiactl")] = (NVIDIA_MAJOR, NVIDIACTL_MINOR)
    devices[Path("dev/nvidia-uvm")] = (UVM_MAJOR, 0)
    devices[Path("dev/nvidia-uvm-tools")] = (UVM_MAJOR, 1)
    proc = root / "proc"
    caps = proc / "driver/nvidia/capabilities"
    if any(gpu.model.mig_capable for gpu in node.gpus):
        for name, minor in (("config", MIG_CONFIG_MINOR), ("monitor", MIG_MONITOR_MINOR)):
            _access(caps / "mig" / name, minor)
            devices[Path(f"dev/nvidia-caps/nvidia-cap{minor}")] = (CAPS_MAJOR, minor)
    for gpu in node.gpus:
        if not gpu.model.mig_capable:
            continue
        for gi in range(mock.MAX_GPU_INSTANCES):
            cis: list[int | None] = [None, *range(mock.MAX_COMPUTE_INSTANCES)]
            for ci in cis:
                minor = mig_cap_minor(gpu.index, gi, ci)
                where = caps / f"gpu{gpu.index}/mig/gi{gi}" / ("" if ci is None else f"ci{ci}")
                _access(where / "access", minor)
                devices[Path(f"dev/nvidia-caps/nvidia-cap{minor}")] = (CAPS_MAJOR, minor)
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "devices").write_text(
        "Character devices:\n"
        f"{NVIDIA_MAJOR} nvidia-frontend\n{UVM_MAJOR} nvidia-uvm\n{CAPS_MAJOR} nvidia-caps\n"
    )
    for relative, (major, minor) in devices.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    return DriverRootFiles(
        root=root,
        library=library,
        node_file=node_file,
        state_path=state_path,
        proc=proc,
        devices={root / p: v for p, v in devices.items()},
    )


def _link(path: Path, target: str) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def _access(path: Path, minor: int) -> None:
    """A capability's ``access`` file as the driver writes it (``DeviceFileMinor: N``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
