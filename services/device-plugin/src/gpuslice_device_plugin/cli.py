"""``gpuslice-device-plugin``: flags (each with an environment variable) and the entry point.

Flags that NVIDIA's plugin also has keep its names, and its variables are read as aliases of
ours (``--mig-strategy`` / ``GPUSLICE_MIG_STRATEGY`` or ``MIG_STRATEGY``, ``--device-list-strategy``
/ ``GPUSLICE_DEVICE_LIST_STRATEGY`` or ``DEVICE_LIST_STRATEGY``, ...), so a manifest written for
NVIDIA's plugin keeps working. Those have no default of their own: unset, the config file's value
applies, else the built-in default that the help text names.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from gpuslice_api.nodemode import EXIT_REFUSED
from gpuslice_core.cli import EnvArgumentParser, add_log_flags, parse_bool, seconds_or_off
from gpuslice_core.errors import GpusliceError
from gpuslice_core.grpcserver import check_health
from gpuslice_core.logging import configure, get_logger
from gpuslice_device_plugin import __version__
from gpuslice_device_plugin.cdispec import SPEC_MODES
from gpuslice_device_plugin.config import ID_STRATEGIES, MIG_STRATEGIES, CommandLine, ConfigError
from gpuslice_device_plugin.node import REFUSED_REASON, KubeNode, refusal
from gpuslice_device_plugin.podresources import DEFAULT_SOCKET as DEFAULT_POD_RESOURCES_SOCKET
from gpuslice_device_plugin.reload import Control, load_settings
from gpuslice_nvml import add_nvml_arguments
from gpuslice_nvml.health import add_health_arguments

PROG = "gpuslice-device-plugin"
DEFAULT_DIR = "/var/lib/kubelet/device-plugins"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
log = get_logger(__name__)


def _bool(value: str) -> bool:
    try:
        return parse_bool(value, name="value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog=PROG,
        description=(
            "The gpuslice device plugin for nodes in device-plugin mode: advertises this"
            " node's GPUs (and MIG devices) as nvidia.com/gpu and nvidia.com/mig-<profile>"
            " through the kubelet device plugin API v1beta1, drop-in for NVIDIA's"
            " k8s-device-plugin (same config file format), with health that recovers."
        ),
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument(
        "--probe",
        action="store_true",
        help=(
            "Check the health service behind each gpuslice-*.sock in --device-plugins-dir and"
            " exit 0 when there is one and all answer SERVING, 1 otherwise (liveness probe)."
        ),
    )
    add_nvml_arguments(p)
    p.add_flag(
        "--node-name",
        aliases=["NODE_NAME"],
        help=(
            "Name of this node: the mode check, the config label and the sharing labels are"
            " read from and written to this Node (needed unless --mode-check is false and no"
            " --config-dir is given)."
        ),
    )
    p.add_flag(
        "--kubeconfig",
        env="KUBECONFIG",
        help="Path of a kubeconfig; the pod's service account is used when it is not given.",
    )
    p.add_flag(
        "--mode-check",
        deprecated=["MODE_CHECK"],
        type=_bool,
        default=True,
        help=(
            "Refuse to start (exit 3, with an Event on the Node) unless the node is labelled"
            " gpuslice.dev/mode=device-plugin and the DRA driver publishes no ResourceSlices"
            " for it, so that no GPU is served by both; false skips the check."
        ),
    )
    p.add_flag(
        "--device-plugins-dir",
        deprecated=["DEVICE_PLUGINS_DIR"],
        default=DEFAULT_DIR,
        help=(
            "The kubelet's device-plugins directory, an absolute path: kubelet.sock is there,"
            " and this plugin puts its sockets there."
        ),
    )
    p.add_flag(
        "--config-file",
        aliases=["CONFIG_FILE"],
        help=(
            "Path of a config file in NVIDIA's version v1 format (flags, sharing.timeSlicing);"
            " a key this plugin does not support stops start-up with a message naming it."
        ),
    )
    p.add_flag(
        "--config-dir",
        deprecated=["CONFIG_DIR"],
        help=(
            "Directory of named config files (a ConfigMap mounted as a volume, one key per"
            " config); the node label --config-label picks one, else --default-config, else the"
            " only one. Not together with --config-file."
        ),
    )
    p.add_flag(
        "--config-label",
        deprecated=["CONFIG_NODE_LABEL"],
        default=CONFIG_LABEL,
        help="Node label whose value names this node's config in --config-dir.",
    )
    p.add_flag(
        "--default-config",
        deprecated=["DEFAULT_CONFIG"],
        help=(
            "Name of the config in --config-dir for nodes without the --config-label label;"
            " empty: the only config when there is one, else an error."
        ),
    )
    p.add_flag(
        "--config-poll-interval",
        deprecated=["CONFIG_POLL_INTERVAL"],
        type=seconds_or_off,
        default=2.0,
        help=(
            "Seconds between checks of the config file or directory for a changed content,"
            " which is then reloaded live (the node label is watched, and SIGHUP reloads at"
            " once); 0 turns the polling off."
        ),
    )
    p.add_flag(
        "--enforcer-socket",
        deprecated=["ENFORCER_SOCKET"],
        help=(
            "Unix socket of the gpuslice enforcer (gpuslice.v1.Enforcer); needed by"
            " sharing.mps, whose replicas it enforces as equal shares of cores and memory."
        ),
    )
    p.add_flag(
        "--cdi-root",
        deprecated=["CDI_ROOT"],
        default="/var/run/cdi",
        help=(
            "Directory where the plugin writes its CDI specs: the GPUs and MIG devices for the"
            " cdi-annotations and cdi-cri strategies, and the MPS replicas (the runtime's CDI"
            " spec directory)."
        ),
    )
    p.add_flag(
        "--cdi-spec",
        deprecated=["CDI_SPEC"],
        default="gpuslice",
        choices=SPEC_MODES,
        help=(
            "Whose CDI devices the cdi-* strategies name: gpuslice (the plugin's own spec,"
            " k8s.gpu.gpuslice.dev/device-plugin-gpu=node-<UUID>), toolkit (the NVIDIA Container"
            " Toolkit's nvidia.com/gpu=<ID>, whose spec must be on the node) or both (ours plus"
            " the toolkit's by UUID, for its driver libraries)."
        ),
    )
    p.add_flag(
        "--mig-strategy",
        aliases=["MIG_STRATEGY"],
        choices=MIG_STRATEGIES,
        help="How MIG devices are advertised: none, single or mixed (default: none).",
    )
    p.add_flag(
        "--fail-on-init-error",
        aliases=["FAIL_ON_INIT_ERROR"],
        type=_bool,
        help=(
            "Exit when NVML or device discovery fails (default: true); false waits without"
            " advertising anything, for nodes without GPUs."
        ),
    )
    p.add_flag(
        "--device-list-strategy",
        aliases=["DEVICE_LIST_STRATEGY"],
        help=(
            "How Allocate hands devices to containers: envvar, volume-mounts, cdi-annotations"
            " or cdi-cri, several separated by commas (default: envvar)."
        ),
    )
    p.add_flag(
        "--device-id-strategy",
        aliases=["DEVICE_ID_STRATEGY"],
        choices=ID_STRATEGIES,
        help="Device IDs are GPU/MIG UUIDs (uuid) or indexes (index) (default: uuid).",
    )
    p.add_flag(
        "--pass-device-specs",
        aliases=["PASS_DEVICE_SPECS"],
        type=_bool,
        help="Return the /dev/nvidia* device nodes in Allocate (default: false).",
    )
    p.add_flag(
        "--shared-allocation-policy",
        deprecated=["SHARED_ALLOCATION_POLICY"],
        default="distributed",
        choices=("distributed", "packed"),
        help=(
            "Preferred allocation of time-slicing replicas and MIG devices: spread over the"
            " least used GPUs (distributed) or fill the most used first (packed)."
        ),
    )
    add_health_arguments(
        p,
        recovery_help="Mark devices Healthy again once their GPU has recovered.",
        quiet_help="Seconds without a repeated XID after which its devices are Healthy again.",
        ignored_help="XIDs caused by applications, which leave the devices Healthy.",
    )
    p.add_flag(
        "--metrics-addr",
        deprecated=["METRICS_ADDR"],
        default=":9404",
        help="HOST:PORT of the Prometheus /metrics endpoint; an empty value turns it off.",
    )
    p.add_flag(
        "--health-addr",
        deprecated=["HEALTH_ADDR"],
        default=":9414",
        help=(
            "HOST:PORT of /healthz (the plugin's kubelet watch runs) and /readyz (every resource's"
            " socket answers SERVING, as --probe) for httpGet probes; an empty value turns it off."
        ),
    )
    p.add_flag(
        "--pod-resources-socket",
        deprecated=["POD_RESOURCES_SOCKET"],
        default=DEFAULT_POD_RESOURCES_SOCKET,
        help=(
            "The kubelet's pod resources socket (<kubelet root>/pod-resources/kubelet.sock):"
            " which container holds which device, for the per-container gpuslice_container_gpu_*"
            " metrics; an empty value turns those metrics off."
        ),
    )
    add_log_flags(p)
    return p


def probe(directory: Path) -> int:
    sockets = sorted(directory.glob("gpuslice-*.sock"))
    return 0 if sockets and all(check_health(s) for s in sockets) else 1


def _node(args: CommandLine) -> KubeNode | None:
    if not args.node_name:
        if args.mode_check or args.config_dir:
            why = "the mode check (--mode-check)" if args.mode_check else "--config-dir"
            raise ConfigError(f"--node-name (GPUSLICE_NODE_NAME) is needed for {why}")
        return None
    from gpuslice_kube.client import new_api_client
    from gpuslice_kube.raw import RawApi

    api = new_api_client(args.kubeconfig, user_agent=f"{PROG}/{__version__}")
    return KubeNode(RawApi(api, deadline=30), args.node_name)


#: Flags that name unix sockets or their directory: gRPC takes ``unix://`` + an absolute path
#: only (a relative one fails to bind or connect deep inside the plugin).
SOCKET_FLAGS = ("device_plugins_dir", "enforcer_socket", "pod_resources_socket")


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for dest in SOCKET_FLAGS:
        value = getattr(args, dest)
        if value and not Path(value).is_absolute():
            flag = "--" + dest.replace("_", "-")
            parser.error(
                f"{flag}: {value!r} is a relative path; give an absolute one (default of "
                f"--device-plugins-dir: {DEFAULT_DIR})"
            )


def command_line(args: argparse.Namespace) -> CommandLine:
    """The parsed flags, frozen: nothing past this module sees the ``argparse.Namespace``."""
    return CommandLine(**{f.name: getattr(args, f.name) for f in fields(CommandLine)})


def parse(argv: Sequence[str] | None = None) -> tuple[CommandLine, bool]:
    """The command line and whether ``--probe`` was asked for (exits 2 on a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_paths(parser, args)
    return command_line(args), args.probe


def main(argv: Sequence[str] | None = None) -> int:
    args, probing = parse(argv)
    if probing:
        return probe(Path(args.device_plugins_dir))
    configure(component="device-plugin", level=args.log_level, log_format=args.log_format)
    try:
        node = _node(args)
        info = node.info() if node is not None else None
        if node is not None and info is not None and args.mode_check:
            reason = refusal(info, node.dra_slices())
            if reason is not None:
                log.error(
                    "refusing to start: this node is not in device-plugin mode", reason=reason
                )
                node.event("Warning", REFUSED_REASON, reason)
                print(f"{PROG}: refusing to start: {reason}", file=sys.stderr)
                return EXIT_REFUSED
        labels = info.labels if info is not None else None
        settings = load_settings(args, labels)
    except ConfigError as exc:
        log.error("invalid configuration", error=str(exc))
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except GpusliceError as exc:  # the API server cannot be reached or refuses
        log.error("cannot read this node from the API server", error=str(exc))
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    from gpuslice_device_plugin.run import run

    control = Control()
    control.install_signals()
    return run(args, settings, node, control, labels)


if __name__ == "__main__":
    sys.exit(main())
