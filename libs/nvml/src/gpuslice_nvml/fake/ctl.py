"""Drive a running fake NVML node from the command line.

    python -m gpuslice_nvml.fake.ctl --config node.yaml xid --gpu 0 --code 79
    python -m gpuslice_nvml.fake.ctl --config node.yaml lost --gpu 1
    python -m gpuslice_nvml.fake.ctl --config node.yaml process add --pid 4242 --device 0 \\
        --memory 8GiB --sm 60
    python -m gpuslice_nvml.fake.ctl --config node.yaml state

Every command changes the node's shared state file, so the services using the same config see
the change at once. Results are printed as one JSON object; errors go to stderr (exit code 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from gpuslice_core.cli import EnvArgumentParser
from gpuslice_core.errors import GpusliceError
from gpuslice_nvml.fake.control import FakeNvmlControl
from gpuslice_nvml.types import FAKE_NVML_CONFIG_ENV, DeviceRef

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``8GiB``, ``512Mi``, ``4G`` (binary units) or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8GiB, 512MiB or 1048576")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit])


def parse_device(text: str) -> DeviceRef:
    """A GPU index, or a GPU-/MIG- UUID."""
    return int(text) if text.isdigit() else text


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog="python -m gpuslice_nvml.fake.ctl",
        description="Change the state of a fake NVML node: processes, XIDs, lost GPUs.",
    )
    parser.add_flag(
        "--config",
        env=FAKE_NVML_CONFIG_ENV,
        deprecated=["FAKE_NVML_CONFIG"],
        required=True,
        help="Path of the fake node's YAML config; its statePath names the shared state.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    xid = commands.add_parser("xid", help="Inject an XID critical error event.")
    xid.add_argument("--gpu", type=int, required=True, help="GPU index.")
    xid.add_argument("--code", type=int, required=True, help="XID code, e.g. 79 or 48.")
    xid.add_argument("--gi", type=int, help="GPU instance id, for an XID in one MIG instance.")
    xid.add_argument("--ci", type=int, help="Compute instance id inside --gi.")

    lost = commands.add_parser("lost", help="Make a GPU fall off the bus (GPU_LOST event).")
    lost.add_argument("--gpu", type=int, required=True, help="GPU index.")
    recover = commands.add_parser("recover", help="Make a lost GPU answer again.")
    recover.add_argument("--gpu", type=int, required=True, help="GPU index.")

    process = commands.add_parser("process", help="Add, change or remove a GPU process.")
    actions = process.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="Start (or update) a process on a GPU or MIG device.")
    add.add_argument("--pid", type=int, required=True, help="Process id.")
    add.add_argument("--device", type=parse_device, required=True, help="GPU index or UUID.")
    add.add_argument("--memory", type=parse_bytes, default=0, help="Memory it uses (8GiB).")
    add.add_argument("--sm", type=int, default=0, help="SM utilization percent it reports.")
    add.add_argument("--mem-util", type=int, default=0, help="Memory utilization percent.")
    add.add_argument(
        "--real",
        action="store_true",
        help="Bind it to the live OS process --pid (vanishes with it, cgroup limits apply).",
    )
    add.add_argument(
        "--accounting",
        choices=("constant", "runnable"),
        default="constant",
        help="With --real: SM use constant unless frozen, or from the process's runnable time.",
    )
    alloc = actions.add_parser("alloc", help="A process allocates (or, negative, frees) memory.")
    alloc.add_argument("--pid", type=int, required=True, help="Process id.")
    alloc.add_argument("--device", type=parse_device, required=True, help="GPU index or UUID.")
    alloc.add_argument("--bytes", type=int, required=True, help="Bytes to allocate (< 0 frees).")
    accounting = actions.add_parser(
        "accounting", help="SM use a runnable-accounted process achieved (frozen time excluded)."
    )
    accounting.add_argument("--pid", type=int, required=True, help="Process id.")
    remove = actions.add_parser("remove", help="End a process.")
    remove.add_argument("--pid", type=int, required=True, help="Process id.")
    remove.add_argument("--device", type=parse_device, help="Only on this device.")
    util = actions.add_parser("util", help="Set a process's utilization samples.")
    util.add_argument("--pid", type=int, required=True, help="Process id.")
    util.add_argument("--device", type=parse_device, required=True, help="GPU index or UUID.")
    util.add_argument("--sm", type=int, required=True, help="SM utilization percent.")
    util.add_argument("--mem-util", type=int, default=0, help="Memory utilization percent.")
    actions.add_parser("list", help="List every process on the node.")

    commands.add_parser("limits", help="List the memory-partitioning limits set per cgroup.")
    commands.add_parser("state", help="Print the node's whole shared state.")
    commands.add_parser("reset", help="Start the node over from its config.")
    return parser


def run(args: argparse.Namespace, control: FakeNvmlControl) -> Any:
    """Execute one parsed command; returns what to print."""
    if args.command == "xid":
        return control.inject_xid(
            args.gpu, args.code, gpu_instance_id=args.gi, compute_instance_id=args.ci
        )
    if args.command == "lost":
        return control.mark_gpu_lost(args.gpu) or {"gpu": args.gpu, "lost": True}
    if args.command == "recover":
        control.mark_gpu_recovered(args.gpu)
        return {"gpu": args.gpu, "lost": False}
    if args.command == "limits":
        return {"limits": [lim.model_dump(by_alias=True) for lim in control.memory_limit_records()]}
    if args.command == "state":
        return control.state().model_dump(by_alias=True)
    if args.command == "reset":
        control.reset_state()
        return {"reset": True, "statePath": str(control.store.path)}
    if args.action == "add":
        return control.add_process(
            args.pid,
            args.device,
            used_memory_bytes=args.memory,
            sm_percent=args.sm,
            memory_percent=args.mem_util,
            real=args.real,
            accounting=args.accounting,
        )
    if args.action == "alloc":
        return control.allocate_memory(args.pid, args.device, args.bytes)
    if args.action == "accounting":
        return control.sm_accounting(args.pid)
    if args.action == "remove":
        return {"removed": control.remove_process(args.pid, args.device)}
    if args.action == "util":
        control.set_process_utilization(
            args.pid, args.device, sm_percent=args.sm, memory_percent=args.mem_util
        )
        return {"pid": args.pid, "sm": args.sm, "memUtil": args.mem_util}
    return {"processes": control.processes()}


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args, FakeNvmlControl.from_config_file(args.config))
    except GpusliceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(_jsonable(result), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
