"""``python -m e2e.gpustage``: run the GPU stage, print its table, write its JSON report.

Exit status: 0 when every target was met, 1 when one was missed, 2 for a bad command line.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from e2e.gpustage.clients import WORKLOAD_MODULE
from e2e.gpustage.stage import SECTIONS, Options, run
from gpuslice_core.cli import EnvArgumentParser, positive_seconds
from gpuslice_nvml.select import add_nvml_arguments


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog="python -m e2e.gpustage",
        description=(
            "Measure the enforcer's limits on one GPU (real or fake NVML): memory limit, SM "
            "split, overhead, CreateShare latency, the MPS bypass, the CDI spec and the NVML "
            "contract. Needs root for the enforcement rows. See docs/gpu-stage.md."
        ),
    )
    add_nvml_arguments(p)
    p.add_bool_flag(
        "--keep-gpu-settings",
        env="GPU_STAGE_KEEP_GPU_SETTINGS",
        help=(
            "Never change the GPU's compute mode, MIG mode or clocks (the enforcer runs with "
            "--compute-mode=leave); for shared machines. The bypass row then proves the "
            "watchdog's backstop instead of the exclusive compute mode."
        ),
    )
    p.add_flag("--gpu", env="GPU_STAGE_GPU", type=int, default=0, help="Index of the GPU to use.")
    p.add_flag(
        "--json",
        env="GPU_STAGE_JSON",
        default=".gpustage/report.json",
        help="Where to write the JSON report.",
    )
    p.add_flag(
        "--seconds",
        env="GPU_STAGE_SECONDS",
        type=positive_seconds,
        default=None,
        help="Length of each SM measurement in seconds (default 6 on a real GPU, 2 on the fake).",
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        metavar="SECTION",
        help=f"Run only these sections (of {', '.join(SECTIONS)}).",
    )
    p.add_flag(
        "--keep-logs",
        env="GPU_STAGE_KEEP_LOGS",
        default="",
        help="Write the enforcer's and the workloads' logs to this .tar.gz (default: not kept).",
    )
    p.add_flag(
        "--workload",
        env="GPU_STAGE_WORKLOAD",
        default=WORKLOAD_MODULE,
        help="The workload program's module (to try another implementation of its contract).",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seconds = args.seconds or (6.0 if args.nvml == "real" else 2.0)
    opts = Options(
        nvml=args.nvml,
        fake_config=Path(args.fake_nvml_config).resolve() if args.fake_nvml_config else None,
        keep_gpu_settings=args.keep_gpu_settings,
        gpu=args.gpu,
        json_path=Path(args.json),
        seconds=seconds,
        only=tuple(args.only),
        workload_module=args.workload,
        logs_archive=Path(args.keep_logs) if args.keep_logs else None,
    )

    def stop(signum: int, _frame: FrameType | None) -> None:
        signal.signal(signum, signal.SIG_IGN)  # one stop is enough: let the cleanup finish
        raise SystemExit(f"signal {signal.Signals(signum).name}")  # unwinds into the cleanup

    signal.signal(signal.SIGTERM, stop)
    report = run(opts)
    print(report.table())
    report.write_json(opts.json_path)
    print(f"report: {opts.json_path}")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
