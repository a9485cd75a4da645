"""A fake CUDA program: a real process that holds memory and keeps SMs busy on a fake GPU.

    python -m gpuslice_nvml.fake.workload --config node.yaml --device 0 --sm 80 --memory 1GiB

It registers itself in the fake node as a *real* process (``FakeNvmlControl.add_process(…,
real=True)``), so NVML sees it exactly while it lives, the memory-partitioning limits of its
cgroup apply to its allocations, and it uses SM only while it is not frozen. With ``--sm`` above
0 it spins at ``SCHED_IDLE`` priority (it takes only CPU nobody else wants) and its SM use is
accounted from its runnable time (``accounting="runnable"``): throttling it with the cgroup
freezer shows in NVML's per-process utilization and in ``FakeNvmlControl.sm_accounting``.

Like a CUDA program it uses the MPS daemon of ``$CUDA_MPS_PIPE_DIRECTORY`` when one serves its
GPU there (it is then an MPS client), and otherwise a context of its own (``fake.contexts``).

It prints ``ready <pid>`` once registered (``oom <reason>`` and exit status 2 if the initial
``--memory`` does not fit; ``unavailable <reason>`` and exit status 3 if the GPU's compute mode
refuses it a context), then reads commands from stdin, one per line, answering each with
one line:

    alloc <bytes>   -> ok <bytes used>   | oom <reason>     (cudaMalloc)
    free <bytes>    -> ok <bytes used>
    sm <percent>    -> ok <percent>
    exit            -> bye, then exits 0

SIGTERM (or ``exit``) unregisters it; if it is killed the fake forgets it on its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from gpuslice_core.cli import EnvArgumentParser
from gpuslice_core.errors import GpusliceError
from gpuslice_core.grpcserver import StopSignals
from gpuslice_nvml.errors import NvmlInsufficientMemory, NvmlInUse
from gpuslice_nvml.fake.control import FakeNvmlControl
from gpuslice_nvml.fake.ctl import parse_bytes, parse_device
from gpuslice_nvml.types import FAKE_NVML_CONFIG_ENV, DeviceRef


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog="python -m gpuslice_nvml.fake.workload",
        description="Run a fake CUDA program on a fake NVML node (see the module docstring).",
    )
    parser.add_flag(
        "--config",
        env=FAKE_NVML_CONFIG_ENV,
        deprecated=["FAKE_NVML_CONFIG"],
        required=True,
        help="The fake node's YAML config.",
    )
    parser.add_argument("--device", type=parse_device, default=0, help="GPU index or UUID.")
    parser.add_argument("--sm", type=int, default=0, help="SM percent it uses while running.")
    parser.add_argument("--memory", type=parse_bytes, default=0, help="Memory it allocates first.")
    parser.add_argument(
        "--cgroup",
        type=Path,
        action="append",
        default=[],
        help="Move into this cgroup directory first (repeatable: one per hierarchy).",
    )
    return parser


class Workload:
    def __init__(self, control: FakeNvmlControl, device: DeviceRef) -> None:
        self.control = control
        self.device = device
        self.pid = os.getpid()
        self.stop = threading.Event()

    def command(self, line: str) -> str:
        verb, _, arg = line.strip().partition(" ")
        try:
            if verb == "alloc":
                info = self.control.allocate_memory(self.pid, self.device, parse_bytes(arg))
                return f"ok {info.used_memory_bytes}"
            if verb == "free":
                info = self.control.allocate_memory(self.pid, self.device, -parse_bytes(arg))
                return f"ok {info.used_memory_bytes}"
            if verb == "sm":
                self.control.set_process_utilization(self.pid, self.device, sm_percent=int(arg))
                return f"ok {int(arg)}"
            if verb == "exit":
                self.stop.set()
                return "bye"
        except NvmlInsufficientMemory as exc:
            return f"oom {exc}"
        except (GpusliceError, ValueError, argparse.ArgumentTypeError) as exc:
            return f"error {exc}"
        return f"error unknown command {verb!r}"

    def serve_stdin(self) -> None:
        for line in sys.stdin:
            if line.strip():
                print(self.command(line), flush=True)
            if self.stop.is_set():
                return


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for cgroup in args.cgroup:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    control = FakeNvmlControl.from_config_file(args.config)
    workload = Workload(control, args.device)
    accounting = "runnable" if args.sm > 0 else "constant"
    try:
        control.add_process(
            workload.pid,
            args.device,
            used_memory_bytes=args.memory,
            sm_percent=args.sm,
            real=True,
            accounting=accounting,
            mps_pipe_dir=os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        )
    except NvmlInsufficientMemory as exc:
        print(f"oom {exc}", flush=True)
        return 2
    except NvmlInUse as exc:  # the compute mode refuses a context, as CUDA would at cuInit
        print(f"unavailable {exc}", flush=True)
        return 3

    # An Event.set in a handler can wait for the main thread's own lock (StopSignals).
    signals = StopSignals(workload.stop, (signal.SIGTERM,))
    print(f"ready {workload.pid}", flush=True)
    threading.Thread(target=workload.serve_stdin, daemon=True).start()
    try:
        if accounting == "runnable":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            while not workload.stop.is_set() and not signals.received:
                pass  # busy: runnable whenever it is not frozen
        else:
            signals.wait()
    finally:
        control.remove_process(workload.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
