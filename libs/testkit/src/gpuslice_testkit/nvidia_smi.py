"""A stand-in ``nvidia-smi`` for services on the mock libnvidia-ml: ``--gpu-reset -i <bus id>``
and ``compute-policy -i <UUID> --set-timeslice=<0..3>``.

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

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuslice_nvml import errors
from gpuslice_nvml.fake import FakeNvml
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


def _bus(bus_id: str) -> tuple[int, str]:
    """``00000000:18:00.0`` and ``0000:18:00.0`` alike: (domain, rest), case-insensitive."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return int(domain, 16), rest


def compute_policy(argv: Sequence[str]) -> int:
    """``compute-policy -i <UUID> --set-timeslice=<level>``, as NVIDIA's DRA driver runs it."""
    parser = argparse.ArgumentParser(prog="nvidia-smi compute-policy (gpuslice test stand-in)")
    parser.add_argument("-i", "--id", required=True, help="The GPU's UUID.")
    parser.add_argument("--set-timeslice", type=int, required=True, choices=range(4))
    args = parser.parse_args(argv)
    config = os.environ.get(CONFIG_ENV)
    if not config:
        print(f"{CONFIG_ENV} is not set: which fake node?", file=sys.stderr)
        return 2
    with FakeNvml.from_config_file(config) as nvml:
        index = next((g.index for g in nvml.gpus() if g.uuid == args.id), None)
        if index is None:
            print(f"No devices were found with UUID {args.id}", file=sys.stderr)
            return 6
        nvml.set_compute_time_slice(index, args.set_timeslice)
    print(f"Set timeslice to {args.set_timeslice} for GPU {args.id}.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compute-policy"]:
        return compute_policy(argv[1:])
    parser = argparse.ArgumentParser(prog="nvidia-smi (gpuslice test stand-in)")
    parser.add_argument("-r", "--gpu-reset", action="store_true", help="Reset the GPU.")
    parser.add_argument("-i", "--id", help="The GPU's PCI bus id.")
    args, rest = parser.parse_known_args(argv)
    if not args.gpu_reset or not args.id or rest:
        print(
            "only `nvidia-smi --gpu-reset -i <bus id>` and `nvidia-smi compute-policy -i <UUID>"
            " --set-timeslice=<n>` are implemented here",
            file=sys.stderr,
        )
        return 2
    config = os.environ.get(CONFIG_ENV)
    if not config:
        print(f"{CONFIG_ENV} is not set: which fake node?", file=sys.stderr)
        return 2
    with FakeNvml.from_config_file(config) as nvml:
        index = next((g.index for g in nvml.gpus() if _bus(g.pci_bus_id) == _bus(args.id)), None)
        if index is None:
            print(f"No devices were found with bus id {args.id}", file=sys.stderr)
            return 6
        try:
            nvml.reset_gpu(index)
        except errors.NvmlError as exc:
            in_use = " (in use)" if exc.code == errors.ERROR_IN_USE else ""
            print(f"Unable to reset GPU {args.id}{in_use}: {exc}", file=sys.stderr)
            return 1
    print(f"GPU {args.id} was successfully reset.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
