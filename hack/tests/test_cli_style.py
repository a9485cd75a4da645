"""One command-line style across the services (issue 32): each answers ``--version`` with its
program name and version, and takes the same ``--log-level`` and ``--log-format``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpuslice_controller import __version__ as controller_version
from gpuslice_controller.cli import build_parser as controller
from gpuslice_core.cli import EnvArgumentParser
from gpuslice_device_plugin import __version__ as device_plugin_version
from gpuslice_device_plugin.cli import build_parser as device_plugin
from gpuslice_enforcer import __version__ as enforcer_version
from gpuslice_enforcer.cli import build_parser as enforcer
from gpuslice_kubelet_plugin import __version__ as kubelet_plugin_version
from gpuslice_kubelet_plugin.cli import build_parser as kubelet_plugin
from gpuslice_mig_manager import __version__ as mig_manager_version
from gpuslice_mig_manager.cli import build_parser as mig_manager

PARSERS: dict[str, tuple[Callable[[], EnvArgumentParser], str]] = {
    "gpuslice-controller": (controller, controller_version),
    "gpuslice-device-plugin": (device_plugin, device_plugin_version),
    "gpuslice-enforcer": (enforcer, enforcer_version),
    "gpuslice-kubelet-plugin": (kubelet_plugin, kubelet_plugin_version),
    "gpuslice-mig-manager": (mig_manager, mig_manager_version),
}


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_version_names_the_program_and_its_version(
    prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    build, version = PARSERS[prog]
    with pytest.raises(SystemExit) as exit_:
        build().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"{prog} {version}"


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_logging_flags_are_the_same_everywhere(prog: str) -> None:
    args = PARSERS[prog][0]().parse_args(["--log-format", "text", "--log-level", "debug"])
    assert (args.log_format, args.log_level) == ("text", "debug")
    with pytest.raises(SystemExit):
        PARSERS[prog][0]().parse_args(["--log-format", "console"])
