"""A stand-in ``nvidia-smi`` for services on the mock libnvidia-ml: ``--gpu-reset -i <bus id>``
and ``compute-policy -i <UUID> --set-timeslice=<0..3>`` (``gpuslice_nvml.fake.smi``), launched
from a shim on the service's ``PATH``.

NVML has no reset call; the real backend's ``reset_gpu`` runs ``nvidia-smi --gpu-reset -i
<bus id>`` (as NVIDIA's mig-parted does), which is how a pending MIG mode takes effect. On the
mock's node there is no nvidia-smi, so ``nvml_env("mock", config)`` puts this one first on the
service's ``PATH``: it resets the GPU of that bus id in the fake node's state with the fake's own
``reset_gpu`` (the pending MIG mode becomes current; IN_USE while processes run), so both front
ends see the reset. The time slice the real backend sets with ``compute-policy`` (NVML has no
call for it) goes to the fake's state the same way (``FakeNvmlControl.state()`` shows it).
Nothing else is implemented; any other use exits 2 and says so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuslice_nvml.fake import smi
from gpuslice_nvml.types import FAKE_NVML_CONFIG_ENV

CONFIG_ENV = FAKE_NVML_CONFIG_ENV
"""The fake node's YAML config, set by ``nvml_env`` next to the mock's own variable."""


def write_shim(directory: Path) -> Path:
    """An executable ``nvidia-smi`` in ``directory`` that runs this module with the current
    interpreter (written to a temp file and renamed: services may start at once)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-smi"
    text = f'#!/bin/sh\nexec "{sys.executable}" -m gpuslice_testkit.nvidia_smi "$@"\n'
    if not path.exists() or path.read_text() != text:
        temp = directory / f".nvidia-smi.{os.getpid()}"
        temp.write_text(text)
        temp.chmod(0o755)
        temp.replace(path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    return smi.main(argv, os.environ.get(CONFIG_ENV), config_from=CONFIG_ENV)


if __name__ == "__main__":
    sys.exit(main())
