"""``gpuslice-node-setup``: flags (each with the environment variable the chart sets) -> a frozen
``Settings`` or ``HookSocketSettings``, then the steps in order. Nothing past this module sees the
parsed arguments."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuslice_core.cli import EnvArgumentParser, parse_bool, pop_deprecation_notices
from gpuslice_core.nodesetup.fakenvml import write_fake_config
from gpuslice_core.nodesetup.hook import HOOK_BINARY, install_hook
from gpuslice_core.nodesetup.report import SetupError, log
from gpuslice_core.nodesetup.sockets import claim_hook_socket, release_hook_socket, sweep_sockets

PROG = "gpuslice-node-setup"


@dataclass(frozen=True)
class FakeNvmlConfig:
    """Step 2: the chart's fake node ``src`` becomes this node's ``dst``."""

    src: Path
    dst: Path
    node_name: str
    set_name: bool

    def __post_init__(self) -> None:
        if self.set_name and not self.node_name:
            raise SetupError("GPUSLICE_FAKE_NVML_SET_NAME needs GPUSLICE_NODE_NAME")


@dataclass(frozen=True)
class HookInstall:
    """Step 3: ``binary`` becomes ``<install_dir>/bin/gpuslice-enforcer-hook``; ``host_dir`` is
    ``install_dir`` as the host (and the messages) name it."""

    install_dir: Path
    host_dir: str
    binary: Path = HOOK_BINARY


@dataclass(frozen=True)
class Settings:
    """The steps asked for; a step that is None is left out."""

    socket_dir: Path | None = None
    fake_nvml: FakeNvmlConfig | None = None
    hook: HookInstall | None = None


@dataclass(frozen=True)
class HookSocketSettings:
    """``hook-socket claim|release``: this pod's enforcer socket ``own`` and the stable ``link``."""

    action: Literal["claim", "release"]
    own: Path
    link: Path


def _bool(value: str) -> bool:
    return parse_bool(value, name="the value")


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog=PROG,
        description=(
            "Prepares a node for the gpuslice node pods (the chart's init container): sweeps"
            " dead per-pod sockets, writes this node's fake NVML config, installs the"
            " enforcer's CDI hook on the host. Each step runs when its flag is given."
        ),
    )
    p.add_flag(
        "--socket-dir",
        deprecated=["SOCKET_DIR"],
        help="Directory of the per-pod sockets; those nothing listens on are removed.",
    )
    p.add_flag(
        "--node-name",
        aliases=["NODE_NAME"],
        default="",
        help="This node's name, written into the fake NVML config.",
    )
    p.add_flag(
        "--fake-nvml-config-src",
        deprecated=["FAKE_NVML_CONFIG_SRC"],
        help="The chart's fake NVML node config (the ConfigMap's file) to copy.",
    )
    p.add_flag(
        "--fake-nvml-config",
        deprecated=["FAKE_NVML_CONFIG"],
        help="Where this node's fake NVML config is written (needs --fake-nvml-config-src).",
    )
    p.add_flag(
        "--fake-nvml-set-name",
        deprecated=["FAKE_NVML_SET_NAME"],
        type=_bool,
        default=False,
        help="true: add 'name: <node name>' to the fake config (own GPU UUIDs per node).",
    )
    p.add_flag(
        "--hook-install-dir",
        deprecated=["HOOK_INSTALL_DIR"],
        help="The host directory of the CDI hook, as mounted here; installs the hook.",
    )
    p.add_flag(
        "--hook-host-dir",
        deprecated=["HOOK_HOST_DIR"],
        help="The same directory as the host sees it (needs --hook-install-dir).",
    )
    p.add_flag(
        "--hook-binary",
        deprecated=["HOOK_BINARY"],
        default=str(HOOK_BINARY),
        help="The static hook binary to install (the enforcer image's).",
    )
    commands = p.add_subparsers(dest="command", metavar="hook-socket")
    hs = commands.add_parser(
        "hook-socket",
        help="Claim or release the enforcer's stable hook socket link.",
        description=(
            "claim (postStart) points the link at this pod's enforcer socket; release (preStop)"
            " hands it to another enforcer socket with a listener if it is still this pod's."
        ),
    )
    hs.add_argument("action", choices=["claim", "release"])
    # Named as the enforcer's own flags: this runs in the enforcer's container (its postStart
    # and preStop) and reads that container's GPUSLICE_SOCKET and GPUSLICE_HOOK_SOCKET.
    hs.add_flag("--socket", deprecated=["ENFORCER_SOCKET"], help="This pod's enforcer socket.")
    hs.add_flag(
        "--hook-socket",
        deprecated=["ENFORCER_HOOK_SOCKET"],
        help="The stable link the CDI hook calls (enforcer.sock).",
    )
    return p


def settings_from(args: argparse.Namespace) -> Settings | HookSocketSettings:
    """The parsed flags, checked; raises ``SetupError`` naming what is missing."""
    if args.command == "hook-socket":
        if not args.socket or not args.hook_socket:
            raise SetupError(
                f"hook-socket {args.action} needs GPUSLICE_SOCKET and GPUSLICE_HOOK_SOCKET"
            )
        return HookSocketSettings(args.action, Path(args.socket), Path(args.hook_socket))
    fake = hook = None
    if args.fake_nvml_config_src:
        if not args.fake_nvml_config:
            raise SetupError("GPUSLICE_FAKE_NVML_CONFIG_SRC needs GPUSLICE_FAKE_NVML_CONFIG")
        fake = FakeNvmlConfig(
            Path(args.fake_nvml_config_src),
            Path(args.fake_nvml_config),
            args.node_name,
            args.fake_nvml_set_name,
        )
    if args.hook_install_dir:
        if not args.hook_host_dir:
            raise SetupError("GPUSLICE_HOOK_INSTALL_DIR needs GPUSLICE_HOOK_HOST_DIR")
        hook = HookInstall(Path(args.hook_install_dir), args.hook_host_dir, Path(args.hook_binary))
    socket_dir = Path(args.socket_dir) if args.socket_dir else None
    return Settings(socket_dir=socket_dir, fake_nvml=fake, hook=hook)


def run(settings: Settings) -> None:
    """The asked-for steps, in order."""
    if settings.socket_dir is not None:
        sweep_sockets(settings.socket_dir)
    if settings.fake_nvml is not None:
        f = settings.fake_nvml
        write_fake_config(f.src, f.dst, f.node_name, f.set_name)
    if settings.hook is not None:
        install_hook(settings.hook.install_dir, settings.hook.host_dir, settings.hook.binary)


def hook_socket(settings: HookSocketSettings) -> None:
    if settings.action == "claim":
        claim_hook_socket(settings.own, settings.link)
    else:
        release_hook_socket(settings.own, settings.link)


def main(argv: Sequence[str] | None = None) -> int:
    """0: every asked-for step done; 1: one failed (the reason on stderr); 2: a usage error."""
    args = build_parser().parse_args(argv)
    for notice in pop_deprecation_notices():
        log(f"warning: {notice.message}")
    try:
        settings = settings_from(args)
    except SetupError as exc:
        log(str(exc))
        return 1
    if isinstance(settings, HookSocketSettings):
        try:
            hook_socket(settings)
        except OSError as exc:
            log(f"hook-socket {settings.action} failed: {exc!r}")
            return 1
        return 0
    try:
        run(settings)
    except SetupError as exc:
        log(str(exc))
        return 1
    except OSError as exc:
        log(f"failed: {exc}")
        return 1
    return 0
