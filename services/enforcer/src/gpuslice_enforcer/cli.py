"""``gpuslice-enforcer``: flags (each with an environment variable) → a frozen ``Settings``, and
the entry point. Nothing past this module sees the parsed arguments.

``Settings`` holds what the process is told (node name, metrics address, log level, NVML
backend) and the ``EnforcerConfig`` the domain modules read (``gpuslice_enforcer.config``: the
shares, the watchdog, MPS and the container edits take it, and they may not import this
module). ``--help`` is the configuration reference.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuslice_core import logging as gslog
from gpuslice_core.cli import EnvArgumentParser, add_log_flags
from gpuslice_enforcer import __version__
from gpuslice_enforcer.config import (
    COMPUTE_MODE_POLICIES,
    MEMORY_ACTIONS,
    SM_ACTIONS,
    EnforcerConfig,
)
from gpuslice_nvml import add_nvml_arguments
from gpuslice_nvml.types import FAKE_NVML_CONFIG_ENV

COMPONENT = "enforcer"


@dataclass(frozen=True)
class Settings:
    """Everything the enforcer is told at start, checked (``ValueError`` names the flag)."""

    #: What the enforcement mechanisms are told: sockets, checkpoint, watchdog, MPS, hook.
    enforcement: EnforcerConfig
    node_name: str = ""
    #: HOST:PORT of the Prometheus endpoint; empty: none.
    metrics_addr: str = ""
    health_addr: str = ""  # /healthz and /readyz (gpuslice_core.health); empty = off
    log_level: str = "info"
    log_format: str = "json"
    nvml: str = "real"
    fake_nvml_config: str | None = None
    driver_root: Path = Path("/")  # where libnvidia-ml.so.1 is (--nvml=real)

    def __post_init__(self) -> None:
        if self.enforcement.sample_interval_s <= 0:
            raise ValueError("--sample-interval must be > 0")


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog="gpuslice-enforcer",
        description=(
            "Enforce per-claim GPU cores and memory limits on this node with the strongest "
            "mechanism each GPU offers (driver memory partitioning, MPS, an NVML watchdog)."
        ),
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_flag(
        "--node-name", aliases=["NODE_NAME"], default="", help="Name of this node, for logs."
    )
    p.add_flag(
        "--socket",
        deprecated=["ENFORCER_SOCKET"],
        default="/var/run/gpuslice/enforcer.sock",
        help="Unix socket to serve the Enforcer API on (shared with the kubelet plugin).",
    )
    p.add_flag(
        "--hook-socket",
        deprecated=["ENFORCER_HOOK_SOCKET"],
        default="",
        help="The same socket's path as the host sees it, for the CDI hook (default: --socket).",
    )
    p.add_flag(
        "--hook-path",
        deprecated=["ENFORCER_HOOK_PATH"],
        default="/var/lib/gpuslice/hook/bin/gpuslice-enforcer-hook",
        help="Host path of gpuslice-enforcer-hook, put into container edits; empty disables hooks.",
    )
    p.add_flag(
        "--hook-timeout",
        deprecated=["ENFORCER_HOOK_TIMEOUT"],
        type=int,
        default=10,
        help="Seconds the CDI hook may wait for the limits to be in force.",
    )
    p.add_flag(
        "--state-dir",
        deprecated=["STATE_DIR"],
        default="/var/lib/gpuslice/enforcer",
        help="Directory of the enforcer's checkpoint.",
    )
    p.add_flag(
        "--metrics-addr",
        deprecated=["METRICS_ADDR"],
        default=":9402",
        help="HOST:PORT to serve Prometheus metrics on; empty disables them.",
    )
    p.add_flag(
        "--health-addr",
        deprecated=["HEALTH_ADDR"],
        default=":9412",
        help="HOST:PORT of /healthz (the gRPC socket answers, the watchdog runs) and /readyz "
        "(the socket's health service is SERVING) for httpGet probes; empty disables them.",
    )
    add_log_flags(p)
    p.add_flag(
        "--sample-interval",
        deprecated=["ENFORCER_SAMPLE_INTERVAL"],
        type=float,
        default=0.1,
        help="Seconds between two watchdog samples of per-process memory and SM use.",
    )
    p.add_flag(
        "--memory-action",
        deprecated=["ENFORCER_MEMORY_ACTION"],
        default="kill",
        choices=MEMORY_ACTIONS,
        help="What the watchdog does to a process of a share over its memory limit.",
    )
    p.add_flag(
        "--sm-action",
        deprecated=["ENFORCER_SM_ACTION"],
        default="throttle",
        choices=SM_ACTIONS,
        help="What the watchdog does to a share over its SM limit (throttle freezes its cgroups).",
    )
    p.add_flag(
        "--burst-seconds",
        deprecated=["ENFORCER_BURST_SECONDS"],
        type=float,
        default=0.5,
        help="How long a share may run above its SM limit after having been under it.",
    )
    p.add_flag(
        "--memory-partitioning",
        deprecated=["ENFORCER_MEMORY_PARTITIONING"],
        default="auto",
        choices=("auto", "off"),
        help="Use driver memory partitioning by cgroup where the driver offers it (615+).",
    )
    p.add_flag(
        "--mps",
        deprecated=["ENFORCER_MPS"],
        default="auto",
        choices=("auto", "off"),
        help="Use MPS (protocol 3 namespaces, else legacy MPS) for hard SM limits where possible.",
    )
    p.add_flag(
        "--mps-control",
        deprecated=["ENFORCER_MPS_CONTROL"],
        default="",
        help=(
            "The MPS control command; default nvidia-cuda-mps-control, or with --nvml=fake the "
            "stand-in gpuslice_nvml/fake/mps_control.py."
        ),
    )
    p.add_flag(
        "--mps-root",
        deprecated=["ENFORCER_MPS_ROOT"],
        default="/var/run/gpuslice/mps",
        help="Host directory holding each GPU's MPS pipe directory (short: socket paths).",
    )
    p.add_flag(
        "--mps-container-dir",
        deprecated=["ENFORCER_MPS_CONTAINER_DIR"],
        default="/var/run/gpuslice/mps",
        help="Where containers see their MPS pipe directory (CUDA_MPS_PIPE_DIRECTORY).",
    )
    p.add_bool_flag(
        "--mps-multiuser",
        deprecated=["ENFORCER_MPS_MULTIUSER"],
        help="Start legacy MPS daemons in multi-user mode (-m).",
    )
    p.add_flag(
        "--compute-mode",
        deprecated=["ENFORCER_COMPUTE_MODE"],
        default="exclusive",
        choices=COMPUTE_MODE_POLICIES,
        help=(
            "exclusive: while a GPU serves MPS shares, set its compute mode to EXCLUSIVE_PROCESS "
            "so that no process can run beside the MPS server, and restore the mode it had "
            "when the last MPS share leaves; leave: never change compute modes (MPS shares "
            "are then SOFT unless the GPU already is EXCLUSIVE_PROCESS)."
        ),
    )
    p.add_bool_flag(
        "--stop-mps-on-exit",
        deprecated=["ENFORCER_STOP_MPS_ON_EXIT"],
        help="Stop the MPS daemons when the enforcer exits (this interrupts MPS clients).",
    )
    add_nvml_arguments(p)
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    control = tuple(shlex.split(args.mps_control)) if args.mps_control else None
    mps_env: dict[str, str] = {}
    if args.nvml == "fake":
        from gpuslice_nvml.fake.mps_control import COMMAND as FAKE_MPS_CONTROL

        control = control or FAKE_MPS_CONTROL
        if args.fake_nvml_config:
            mps_env[FAKE_NVML_CONFIG_ENV] = str(Path(args.fake_nvml_config).resolve())
    enforcement = EnforcerConfig(
        socket=Path(args.socket),
        state_dir=Path(args.state_dir),
        hook_socket=Path(args.hook_socket) if args.hook_socket else None,
        hook_path=args.hook_path,
        hook_timeout_s=args.hook_timeout,
        sample_interval_s=args.sample_interval,
        memory_action=args.memory_action,
        sm_action=args.sm_action,
        burst_s=args.burst_seconds,
        memory_partitioning=args.memory_partitioning == "auto",
        mps=args.mps == "auto",
        mps_control=control or ("nvidia-cuda-mps-control",),
        mps_root=Path(args.mps_root),
        mps_container_dir=args.mps_container_dir,
        mps_multiuser=args.mps_multiuser,
        mps_env=mps_env,
        keep_mps_on_exit=not args.stop_mps_on_exit,
        manage_compute_mode=args.compute_mode == "exclusive",
    )
    return Settings(
        enforcement=enforcement,
        node_name=args.node_name,
        metrics_addr=args.metrics_addr,
        health_addr=args.health_addr,
        log_level=args.log_level,
        log_format=args.log_format,
        nvml=args.nvml,
        fake_nvml_config=args.fake_nvml_config,
        driver_root=args.driver_root,
    )


def configure_logs(level: str, node_name: str, log_format: str = "json") -> None:
    """Log lines on stdout, each with the node's name when it is known."""
    gslog.configure(component=COMPONENT, level=level, log_format=log_format)
    if node_name:
        import structlog

        structlog.contextvars.bind_contextvars(node=node_name)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        configure_logs(args.log_level, args.node_name, args.log_format)
        # by name: under `python -m gpuslice_enforcer.cli`, __name__ is __main__
        gslog.get_logger("gpuslice_enforcer.cli").error("start-up failed", error=str(exc))
        return 2
    from gpuslice_enforcer.app import run

    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
