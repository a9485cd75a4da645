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
import subprocess
from pathlib import Path
from typing import Literal

from gpuslice_nvml import mock
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
    stand-in ``nvidia-smi`` (``gpuslice_testkit.nvidia_smi``) first on ``PATH`` for GPU resets."""
    path = os.pathsep.join(
        p for p in (str(mock_library_dir()), os.environ.get("LD_LIBRARY_PATH", "")) if p
    )
    env = mock.prepare(config)
    shim = nvidia_smi.write_shim(Path(env[mock.NODE_ENV]).parent / "bin")
    return {
        "LD_LIBRARY_PATH": path,
        **env,
        # the real backend resets a GPU with nvidia-smi: the stand-in, on this node
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
