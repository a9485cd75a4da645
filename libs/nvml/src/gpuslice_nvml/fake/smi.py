"""A stand-in ``nvidia-smi`` for a fake node (the mock libnvidia-ml's): ``--gpu-reset -i <bus
id>`` and ``compute-policy -i <UUID> --set-timeslice=<0..3>``.

NVML has no reset call; the real backend's ``reset_gpu`` runs ``nvidia-smi --gpu-reset -i
<bus id>`` (as NVIDIA's mig-parted does), which is how a pending MIG mode takes effect. A node
on the mock has no nvidia-smi: this one resets the GPU of that bus id in the fake node's state
with the fake's own ``reset_gpu`` (the pending MIG mode becomes current; IN_USE while processes
run), so both front ends see the reset. The time slice the real backend sets with
``compute-policy`` (NVML has no call for it either, as in NVIDIA's DRA driver) is recorded in
the fake node's state with the fake's ``set_compute_time_slice``. Only these two are
implemented; any other use exits 2 and says so. Two launchers use it:
``gpuslice_testkit.nvidia_smi`` (a shim on a test service's ``PATH``) and the
``usr/bin/nvidia-smi`` of a driver root of files (``gpuslice_testkit.nvml_mock.write_driver_root``),
which needs only this package, as every service image that opens NVML has it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuslice_nvml import errors
from gpuslice_nvml.fake.backend import FakeNvml


def _bus(bus_id: str) -> tuple[int, str]:
    """``00000000:18:00.0`` and ``0000:18:00.0`` alike: (domain, rest), case-insensitive."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return int(domain, 16), rest


def compute_policy(argv: Sequence[str], config: str | Path | None, *, config_from: str) -> int:
    """``compute-policy -i <UUID> --set-timeslice=<level>``, as NVIDIA's DRA driver runs it:
    0 set, 2 bad use, 6 no such GPU."""
    parser = argparse.ArgumentParser(prog="nvidia-smi compute-policy (gpuslice fake-node stand-in)")
    parser.add_argument("-i", "--id", required=True, help="The GPU's UUID.")
    parser.add_argument("--set-timeslice", type=int, required=True, choices=range(4))
    args = parser.parse_args(argv)
    if not config:
        print(f"{config_from} is not set: which fake node?", file=sys.stderr)
        return 2
    with FakeNvml.from_config_file(config) as nvml:
        index = next((g.index for g in nvml.gpus() if g.uuid == args.id), None)
        if index is None:
            print(f"No devices were found with UUID {args.id}", file=sys.stderr)
            return 6
        nvml.set_compute_time_slice(index, args.set_timeslice)
    print(f"Set timeslice to {args.set_timeslice} for GPU {args.id}.")
    return 0


def main(argv: Sequence[str] | None, config: str | Path | None, *, config_from: str) -> int:
    """nvidia-smi's exit codes: 0 done, 1 refused (in use), 2 bad use, 6 no such GPU.
    ``config``: the fake node's YAML; ``config_from`` says where it was to come from."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compute-policy"]:
        return compute_policy(argv[1:], config, config_from=config_from)
    parser = argparse.ArgumentParser(prog="nvidia-smi (gpuslice fake-node stand-in)")
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
    if not config:
        print(f"{config_from} is not set: which fake node?", file=sys.stderr)
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
