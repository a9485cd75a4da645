"""The command line: every flag has an environment variable and a help text."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from gpuslice_core import logging as gslog
from gpuslice_core.cli import pop_deprecation_notices
from gpuslice_kubelet_plugin.cli import build_parser, main, settings_from

FLAGS = {
    "--node-name": "GPUSLICE_NODE_NAME or NODE_NAME",
    "--kubeconfig": "KUBECONFIG",
    "--nvml": "GPUSLICE_NVML",
    "--fake-nvml-config": "GPUSLICE_FAKE_NVML_CONFIG",
    "--cdi-root": "GPUSLICE_CDI_ROOT",
    "--registrar-dir": "GPUSLICE_REGISTRAR_DIR",
    "--plugins-dir": "GPUSLICE_PLUGINS_DIR",
    "--state-dir": "GPUSLICE_STATE_DIR",
    "--metrics-addr": "GPUSLICE_METRICS_ADDR",
    "--health-addr": "GPUSLICE_HEALTH_ADDR",
    "--enforcer-socket": "GPUSLICE_ENFORCER_SOCKET",
    "--mig-manager-socket": "GPUSLICE_MIG_MANAGER_SOCKET",
    "--dynamic-mig": "GPUSLICE_DYNAMIC_MIG",
    "--pod-uid": "GPUSLICE_POD_UID",
    "--health-streaming": "GPUSLICE_HEALTH_STREAMING",
    "--health-recovery": "GPUSLICE_HEALTH_RECOVERY",
    "--xid-quiet-period": "GPUSLICE_XID_QUIET_PERIOD",
    "--health-check-interval": "GPUSLICE_HEALTH_CHECK_INTERVAL",
    "--ignored-xids": "GPUSLICE_IGNORED_XIDS",
    "--gc-interval": "GPUSLICE_GC_INTERVAL",
    "--rescan-interval": "GPUSLICE_RESCAN_INTERVAL",
    "--driver-root": "GPUSLICE_DRIVER_ROOT or NVIDIA_DRIVER_ROOT",
    "--proc-root": "GPUSLICE_PROC_ROOT",
    "--nvidia-cdi-kind": "GPUSLICE_NVIDIA_CDI_KIND",
    "--shutdown-grace": "GPUSLICE_SHUTDOWN_GRACE",
    "--log-level": "GPUSLICE_LOG_LEVEL",
    "--log-format": "GPUSLICE_LOG_FORMAT",
}


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``main`` routes all logging to the sys.stdout of the moment (capsys' stream, closed after
    the test); put the previous configuration back so later tests' threads do not log into it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


def test_help_documents_every_flag_with_its_variable() -> None:
    text = " ".join(build_parser().format_help().split())
    for flag, env in FLAGS.items():
        assert flag in text, flag
        assert f"[env {env}]" in text, env


def test_environment_sets_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_NODE_NAME", "n7")
    monkeypatch.setenv("GPUSLICE_DYNAMIC_MIG", "true")
    monkeypatch.setenv("GPUSLICE_IGNORED_XIDS", "13,43")
    monkeypatch.setenv("GPUSLICE_CDI_ROOT", "/tmp/cdi")
    settings = settings_from(build_parser().parse_args([]))
    assert settings.node_name == "n7"
    assert settings.dynamic_mig is True
    assert settings.ignored_xids == frozenset({13, 43})
    assert settings.cdi_root == Path("/tmp/cdi")
    assert settings.health_streaming is True


def test_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--xid-quiet-period", "-1"])
    assert "must be a positive number of seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--metrics-addr", "nope", "--node-name", "n"])
    assert "--metrics-addr 'nope' must be HOST:PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
    assert "--node-name (GPUSLICE_NODE_NAME) is required" in capsys.readouterr().err


def test_fake_nvml_without_config_fails_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--node-name", "n", "--nvml", "fake", "--metrics-addr", ""]) == 2
    assert "--fake-nvml-config" in capsys.readouterr().out


def test_probe_of_nothing_fails(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuslice_kubelet_plugin",
            "--probe",
            "--registrar-dir",
            str(tmp_path),
            "--plugins-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert re.search(r"GetInfo on .*gpu\.gpuslice\.dev-reg\.sock", out.stderr)


def test_an_old_variable_still_works_and_its_warning_names_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A manifest written for an earlier release sets STATE_DIR and ENFORCER_SOCKET: read for one
    release, each with a warning line in the plugin's log naming the variable to set."""
    pop_deprecation_notices()
    monkeypatch.setenv("GPUSLICE_NODE_NAME", "n7")
    monkeypatch.setenv("STATE_DIR", "/old/state")
    monkeypatch.setenv("ENFORCER_SOCKET", "/run/e.sock")
    settings = settings_from(build_parser().parse_args([]))
    assert (settings.state_dir, settings.enforcer_socket) == (
        Path("/old/state"),
        Path("/run/e.sock"),
    )
    out = io.StringIO()
    gslog.configure(component="kubelet-plugin", stream=out)
    warned = {
        line["deprecated_env"]: (line["level"], line["env"], line["msg"])
        for line in map(json.loads, out.getvalue().splitlines())
    }
    assert warned["STATE_DIR"] == (
        "warning",
        "GPUSLICE_STATE_DIR",
        "environment variable STATE_DIR is deprecated and will not be read after the next"
        " release; set GPUSLICE_STATE_DIR instead",
    )
    assert warned["ENFORCER_SOCKET"][1] == "GPUSLICE_ENFORCER_SOCKET"
