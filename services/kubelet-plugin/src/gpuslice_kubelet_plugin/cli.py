"""``gpuslice-kubelet-plugin``: flags (each with an environment variable) → a frozen
``Settings``, and the entry point. Nothing past this module sees the parsed arguments.

    gpuslice-kubelet-plugin --node-name node-a --nvml=fake --fake-nvml-config node.yaml \\
        --kubeconfig ~/.kube/config --cdi-root /var/run/cdi

``--probe`` checks a running plugin over its sockets (for a liveness probe) and exits 0 or 1.
``--help`` is the configuration reference.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice_api.names import DRIVER, MODE_LABEL
from gpuslice_core import logging as gslog
from gpuslice_core.cli import EnvArgumentParser, add_log_flags, positive_seconds
from gpuslice_core.metrics import parse_addr
from gpuslice_draplugin import Sockets, probe
from gpuslice_kubelet_plugin import __version__
from gpuslice_nvml import add_nvml_arguments
from gpuslice_nvml.health import APP_XIDS, add_health_arguments

PROG = "gpuslice-kubelet-plugin"


@dataclass(frozen=True)
class Settings:
    """Everything the plugin is told at start, checked (``ValueError`` names the flag)."""

    node_name: str
    state_dir: Path
    kubeconfig: str | None = None
    nvml: str = "real"
    fake_nvml_config: str | None = None
    cdi_root: Path = Path("/var/run/cdi")
    registrar_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    metrics_addr: str = ""
    health_addr: str = ""  # /healthz and /readyz (gpuslice_core.health); empty = off
    enforcer_socket: Path | None = None
    mig_manager_socket: Path | None = None
    dynamic_mig: bool = False
    pod_uid: str = ""
    health_streaming: bool = True
    health_recovery: bool = True
    xid_quiet_period: float = 300.0
    health_check_interval: float = 10.0
    ignored_xids: frozenset[int] = field(default=APP_XIDS)
    gc_interval: float = 60.0
    rescan_interval: float = 60.0
    driver_root: Path = Path("/")
    driver_root_host: Path | None = None  # where the host has --driver-root (default: the same)
    proc_root: Path = Path("/proc")  # the kernel's NVIDIA procfs (MIG capabilities, devices)
    nvidia_cdi_kind: str = ""
    shutdown_grace: float = 10.0
    workers: int = 16
    claim_cache: bool = True  # prepare reads claims from a watch-fed cache when it can
    mode_check: bool = True  # refuse a node whose GPUs a device plugin serves
    orphan_grace: float = 30.0  # age before a CDI spec without a record is removed
    log_level: str = "info"
    log_format: str = "json"
    boot_id: str | None = None  # tests only

    def __post_init__(self) -> None:
        if not self.node_name:
            raise ValueError("--node-name (GPUSLICE_NODE_NAME) is required")
        if self.metrics_addr:
            parse_addr(self.metrics_addr)  # ValueError naming the flag
        if self.health_addr:
            parse_addr(self.health_addr, flag="--health-addr")

    @property
    def sockets(self) -> Sockets:
        return sockets(self.registrar_dir, self.plugins_dir, self.pod_uid)


def sockets(registrar_dir: Path, plugins_dir: Path, pod_uid: str) -> Sockets:
    """The registration and DRA sockets of the driver under those directories."""
    return Sockets.for_driver(
        DRIVER, registrar_dir=registrar_dir, plugins_dir=plugins_dir, pod_uid=pod_uid
    )


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog=PROG,
        description=f"The gpuslice DRA kubelet plugin (driver {DRIVER}): publishes this node's "
        "GPUs as ResourceSlices and prepares ResourceClaims for the kubelet.",
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument(
        "--probe",
        action="store_true",
        help="Check a running plugin over its registration and DRA sockets and exit 0 (healthy) "
        "or 1; uses the socket flags below.",
    )
    f = p.add_flag
    f("--node-name", aliases=["NODE_NAME"], help="Name of this node; also the name of its pool.")
    f("--kubeconfig", env="KUBECONFIG", help="Kubeconfig file; in-cluster config without one.")
    add_nvml_arguments(p)
    f(
        "--cdi-root",
        deprecated=["CDI_ROOT"],
        type=Path,
        default=Path("/var/run/cdi"),
        help="Directory where the per-claim CDI specs are written.",
    )
    f(
        "--registrar-dir",
        deprecated=["REGISTRAR_DIR"],
        type=Path,
        default=Path("/var/lib/kubelet/plugins_registry"),
        help="The kubelet's plugin registration directory.",
    )
    f(
        "--plugins-dir",
        deprecated=["PLUGINS_DIR"],
        type=Path,
        default=Path("/var/lib/kubelet/plugins"),
        help=f"The kubelet's plugins directory; the DRA socket is <dir>/{DRIVER}/dra.sock.",
    )
    f(
        "--state-dir",
        deprecated=["STATE_DIR"],
        type=Path,
        default=Path("/var/lib/gpuslice/kubelet-plugin"),
        help=(
            "Directory of the checkpoint (prepared claims); must survive container restarts."
            " The default is the chart's (hostPaths.stateDir)."
        ),
    )
    f(
        "--metrics-addr",
        deprecated=["METRICS_ADDR"],
        default=":9400",
        help="HOST:PORT of the Prometheus /metrics endpoint; empty to disable it.",
    )
    f(
        "--health-addr",
        deprecated=["HEALTH_ADDR"],
        default=":9410",
        help="HOST:PORT of /healthz (the DRA socket answers) and /readyz (what --probe checks) "
        "for the kubelet's httpGet probes; empty to disable it.",
    )
    f(
        "--enforcer-socket",
        deprecated=["ENFORCER_SOCKET"],
        type=Path,
        help="Unix socket of the gpuslice enforcer; without it shares are accounting only and "
        "claims that insist on enforcement (strict) are refused.",
    )
    f(
        "--mig-manager-socket",
        deprecated=["MIG_MANAGER_SOCKET"],
        type=Path,
        help="Unix socket of the gpuslice MIG manager, needed for --dynamic-mig.",
    )
    p.add_bool_flag(
        "--dynamic-mig",
        deprecated=["DYNAMIC_MIG"],
        help="Publish every MIG placement of GPUs in MIG mode (with counters) and "
        "create the instance at prepare, instead of the instances that exist.",
    )
    f(
        "--pod-uid",
        deprecated=["POD_UID"],
        default="",
        help="This pod's UID: sockets get a -<podUID> suffix so two pods can serve during a "
        "rolling update.",
    )
    p.add_bool_flag(
        "--health-streaming",
        deprecated=["HEALTH_STREAMING"],
        default=True,
        help="Serve the kubelet's DRA health stream (v1alpha1.DRAResourceHealth).",
    )
    add_health_arguments(
        p,
        recovery_help="Clear health taints when the GPU is healthy again.",
        quiet_help="Seconds without a repeat after which an XID taint is cleared (recovery on).",
        ignored_help="XIDs caused by applications: their taint has effect None (informational).",
    )
    f(
        "--gc-interval",
        deprecated=["GC_INTERVAL"],
        type=positive_seconds,
        default=60.0,
        help="Seconds between checks for prepared claims that no longer exist in the API.",
    )
    p.add_bool_flag(
        "--mode-check",
        deprecated=["MODE_CHECK"],
        default=True,
        help="Refuse to start (exit 3, a Warning Event KubeletPluginRefused on the Node) on a "
        f"node labelled {MODE_LABEL}=device-plugin or whose capacity shows GPUs served by a "
        "device plugin, where another DRA driver publishes the same GPUs, or where the GPU "
        "Operator's MIG manager manages MIG (label nvidia.com/mig.config without "
        "nvidia.com/gpu.deploy.mig-manager=false): a GPU must not be managed by both.",
    )
    p.add_bool_flag(
        "--claim-cache",
        deprecated=["CLAIM_CACHE"],
        default=True,
        help="Keep the claims allocated to this node in a watch-fed cache, so prepare does not "
        "read each claim from the API (needs list and watch on resourceclaims; falls back to "
        "a read on a miss).",
    )
    f(
        "--rescan-interval",
        deprecated=["RESCAN_INTERVAL"],
        type=positive_seconds,
        default=60.0,
        help="Seconds between device rescans (MIG layout changes, enforcer capabilities).",
    )
    f(
        "--driver-root-host",
        deprecated=["NVIDIA_DRIVER_ROOT_HOST"],
        type=Path,
        default=None,
        help=(
            "The same directory as the host sees it, when this process has it mounted elsewhere"
            " (the chart mounts the host's driver root at /driver-root): CDI specs name host"
            " paths. Default: --driver-root."
        ),
    )
    f(
        "--proc-root",
        type=Path,
        default=Path("/proc"),
        help=(
            "Where the kernel's procfs is read for the driver's MIG capability list"
            " (driver/nvidia/capabilities) and the nvidia-caps major (devices). Tests point it"
            " at the proc/ of a driver root of files; a GPU node keeps /proc."
        ),
    )
    f(
        "--nvidia-cdi-kind",
        deprecated=["NVIDIA_CDI_KIND"],
        default="",
        help="Also hand out the NVIDIA Container Toolkit's CDI device by UUID (e.g. "
        "nvidia.com/gpu) for driver libraries; empty to leave it out.",
    )
    f(
        "--shutdown-grace",
        deprecated=["SHUTDOWN_GRACE"],
        type=positive_seconds,
        default=10.0,
        help="Seconds in-flight calls get to finish on SIGTERM.",
    )
    add_log_flags(p)
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        node_name=args.node_name or "",
        state_dir=args.state_dir,
        kubeconfig=args.kubeconfig or None,
        nvml=args.nvml,
        fake_nvml_config=args.fake_nvml_config or None,
        cdi_root=args.cdi_root,
        registrar_dir=args.registrar_dir,
        plugins_dir=args.plugins_dir,
        metrics_addr=args.metrics_addr,
        health_addr=args.health_addr,
        enforcer_socket=args.enforcer_socket,
        mig_manager_socket=args.mig_manager_socket,
        dynamic_mig=args.dynamic_mig,
        pod_uid=args.pod_uid,
        health_streaming=args.health_streaming,
        health_recovery=args.health_recovery,
        xid_quiet_period=args.xid_quiet_period,
        health_check_interval=args.health_check_interval,
        ignored_xids=args.ignored_xids,
        gc_interval=args.gc_interval,
        claim_cache=args.claim_cache,
        mode_check=args.mode_check,
        rescan_interval=args.rescan_interval,
        driver_root=args.driver_root,
        driver_root_host=args.driver_root_host,
        proc_root=args.proc_root,
        nvidia_cdi_kind=args.nvidia_cdi_kind,
        shutdown_grace=args.shutdown_grace,
        log_level=args.log_level,
        log_format=args.log_format,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.probe:
        gslog.configure(component=PROG, level=args.log_level, log_format=args.log_format)
        problems = probe(sockets(args.registrar_dir, args.plugins_dir, args.pod_uid))
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    try:
        settings = settings_from(args)
    except ValueError as exc:
        parser.error(str(exc))
    from gpuslice_kubelet_plugin.app import run  # the API client is imported only to run

    return run(settings)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
