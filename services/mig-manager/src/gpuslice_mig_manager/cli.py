"""``gpuslice-mig-manager``: flags (each with an environment variable) → a frozen ``Settings``,
and the entry point. Nothing past this module sees the parsed arguments."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuslice_core.cli import EnvArgumentParser, add_log_flags
from gpuslice_core.grpcserver import check_health
from gpuslice_mig_manager import __version__
from gpuslice_nvml import add_nvml_arguments

DEFAULT_SOCKET = "/var/run/gpuslice/mig-manager.sock"
DEFAULT_STATE_DIR = "/var/lib/gpuslice/mig-manager"


@dataclass(frozen=True)
class Settings:
    """Everything the MIG manager is told at start, checked."""

    nvml: str
    fake_nvml_config: str | None
    state_dir: Path
    socket: Path
    node_name: str | None = None
    kubeconfig: str | None = None
    metrics_addr: str = ""
    health_addr: str = ""  # /healthz and /readyz (gpuslice_core.health); empty = off
    #: A mig-parted layout file, or NAMESPACE/NAME[:KEY] of a ConfigMap (at most one).
    config_file: str | None = None
    config_map: str | None = None
    dynamic_mig: bool = False
    reconcile_interval: float = 60.0
    retry_initial: float = 1.0
    retry_max: float = 60.0
    log_level: str = "info"
    log_format: str = "json"
    driver_root: Path = Path("/")  # where libnvidia-ml.so.1 is (--nvml=real)

    def __post_init__(self) -> None:
        if self.config_file and self.config_map:
            raise ValueError("--config-file and --config-map are mutually exclusive; give one")
        if self.config_map and not self.node_name:
            raise ValueError("--config-map needs --node-name (and Kubernetes access)")


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        nvml=args.nvml,
        fake_nvml_config=args.fake_nvml_config,
        driver_root=args.driver_root,
        state_dir=Path(args.state_dir),
        socket=Path(args.socket),
        node_name=args.node_name or None,
        kubeconfig=args.kubeconfig or None,
        metrics_addr=args.metrics_addr,
        health_addr=args.health_addr,
        config_file=args.config_file or None,
        config_map=args.config_map or None,
        dynamic_mig=args.dynamic_mig,
        reconcile_interval=args.reconcile_interval,
        retry_initial=args.retry_initial,
        retry_max=args.retry_max,
        log_level=args.log_level,
        log_format=args.log_format,
    )


def _non_negative(value: str) -> float:
    number = float(value)
    if number < 0:
        raise ValueError(f"{value} is negative")
    return number


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog="gpuslice-mig-manager",
        description=(
            "Owns MIG on one node: applies the mig-parted layout that the node label"
            " gpuslice.dev/mig.config selects, and creates and destroys MIG instances on demand"
            " for the gpuslice kubelet plugin (gRPC API gpuslice.v1.MigManager on a unix socket)."
        ),
    )
    p.add_flag(
        "--node-name",
        aliases=["NODE_NAME"],
        help=(
            "Name of this node's Node object, whose gpuslice.dev/mig.config label selects the"
            " layout and which receives the state label and Events. Without it the manager"
            " serves its gRPC API only and never talks to Kubernetes."
        ),
    )
    p.add_flag(
        "--kubeconfig",
        env="KUBECONFIG",
        help="Path of a kubeconfig; the pod's service account is used when it is not given.",
    )
    add_nvml_arguments(p)
    p.add_flag(
        "--state-dir",
        deprecated=["STATE_DIR"],
        default=DEFAULT_STATE_DIR,
        help=(
            "Directory of the checkpoint (mig-manager.json) that records which instances the"
            " manager made and for whom; it must survive container restarts (a hostPath)."
        ),
    )
    p.add_flag(
        "--socket",
        deprecated=["MIG_MANAGER_SOCKET"],
        default=DEFAULT_SOCKET,
        help="Unix socket of the gRPC API, in a directory the node pod's containers share.",
    )
    p.add_flag(
        "--metrics-addr",
        deprecated=["METRICS_ADDR"],
        default=":9403",
        help="HOST:PORT of the Prometheus /metrics endpoint; an empty value turns it off.",
    )
    p.add_flag(
        "--health-addr",
        deprecated=["HEALTH_ADDR"],
        default=":9413",
        help=(
            "HOST:PORT of /healthz (the gRPC socket answers, the reconciler runs) and /readyz"
            " (the socket's health service is SERVING, as --probe) for httpGet probes; an empty"
            " value turns it off."
        ),
    )
    p.add_flag(
        "--config-file",
        deprecated=["MIG_CONFIG_FILE"],
        help=(
            "Path of a mig-parted v1 layout file (e.g. a mounted ConfigMap); read again for"
            " every application. A malformed file stops start-up with a message naming the key."
        ),
    )
    p.add_flag(
        "--config-map",
        deprecated=["MIG_CONFIG_MAP"],
        help=(
            "NAMESPACE/NAME[:KEY] of a ConfigMap holding the layouts (key config.yaml by"
            " default), watched live; an edit re-applies the selected layout."
        ),
    )
    p.add_bool_flag(
        "--dynamic-mig",
        deprecated=["DYNAMIC_MIG"],
        help=(
            "Create and destroy instances on demand (CreateInstance for new instances) and"
            " destroy instances nobody owns when no process uses them."
        ),
    )
    p.add_flag(
        "--reconcile-interval",
        deprecated=["RECONCILE_INTERVAL"],
        type=_non_negative,
        default=60.0,
        help=(
            "Seconds between comparisons of the checkpoint with the GPUs (drift, orphans);"
            " 0 reconciles only at start."
        ),
    )
    p.add_flag(
        "--retry-initial",
        deprecated=["LAYOUT_RETRY_INITIAL"],
        type=_non_negative,
        default=1.0,
        help="Seconds before the first retry of a layout that waits for instances to be free.",
    )
    p.add_flag(
        "--retry-max",
        deprecated=["LAYOUT_RETRY_MAX"],
        type=_non_negative,
        default=60.0,
        help="Longest wait, in seconds, between retries of a waiting layout.",
    )
    add_log_flags(p)
    p.add_argument(
        "--probe",
        action="store_true",
        help=(
            "Check the health service behind --socket and exit 0 when it is SERVING, 1"
            " otherwise (for the container's liveness and readiness probes)."
        ),
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe:
        return 0 if check_health(Path(args.socket)) else 1
    try:
        settings = settings_from(args)
    except ValueError as exc:
        print(f"gpuslice-mig-manager: {exc}", file=sys.stderr)
        return 2
    from gpuslice_mig_manager.app import run

    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
