from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import structlog
from prometheus_client import CollectorRegistry

from gpuslice_core import logging as gs_logging
from gpuslice_core.cli import (
    EnvArgumentParser,
    pop_deprecation_notices,
    positive_seconds,
    seconds_or_off,
)
from gpuslice_core.metrics import OperationMetrics, parse_addr, serve
from gpuslice_testkit.core import preserved_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    with preserved_logging():
        yield


def test_flag_reads_its_gpuslice_variable_and_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUSLICE_STATE_DIR", "/var/lib/x")
    parser = EnvArgumentParser(prog="x")
    parser.add_flag("--state-dir", help="Where state lives.")
    assert parser.parse_args([]).state_dir == "/var/lib/x"
    assert parser.parse_args(["--state-dir", "/other"]).state_dir == "/other"
    assert pop_deprecation_notices() == []


def test_env_value_outside_choices_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUSLICE_NVML", "mock")
    parser = EnvArgumentParser(prog="x")
    with pytest.raises(SystemExit):
        parser.add_flag("--nvml", help="Backend.", choices=["real", "fake"])
    assert "GPUSLICE_NVML='mock' must be one of: real, fake" in capsys.readouterr().err


def _deprecated_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="x")
    parser.add_flag("--state-dir", deprecated=["STATE_DIR"], help="Where state lives.")
    parser.add_bool_flag("--dynamic-mig", deprecated=["DYNAMIC_MIG"], help="MIG on demand.")
    return parser


@pytest.mark.usefixtures("restore_logging")
def test_an_old_variable_is_read_with_a_warning_naming_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pop_deprecation_notices()
    monkeypatch.setenv("STATE_DIR", "/old")
    monkeypatch.setenv("DYNAMIC_MIG", "true")
    args = _deprecated_parser().parse_args([])
    assert (args.state_dir, args.dynamic_mig) == ("/old", True)
    out = io.StringIO()
    gs_logging.configure(component="test", stream=out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["level"], line["deprecated_env"], line["env"]) for line in lines] == [
        ("warning", "STATE_DIR", "GPUSLICE_STATE_DIR"),
        ("warning", "DYNAMIC_MIG", "GPUSLICE_DYNAMIC_MIG"),
    ]
    assert lines[0]["msg"] == (
        "environment variable STATE_DIR is deprecated and will not be read after the next"
        " release; set GPUSLICE_STATE_DIR instead"
    )
    # logged once: a second configure (tests, a reload) does not repeat them
    again = io.StringIO()
    gs_logging.configure(component="test", stream=again)
    assert again.getvalue() == ""


def test_the_new_variable_wins_over_the_old_one_which_is_reported_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pop_deprecation_notices()
    monkeypatch.setenv("STATE_DIR", "/old")
    monkeypatch.setenv("GPUSLICE_STATE_DIR", "/new")
    assert _deprecated_parser().parse_args([]).state_dir == "/new"
    (notice,) = pop_deprecation_notices()
    assert notice.message == (
        "environment variable STATE_DIR is deprecated and ignored because GPUSLICE_STATE_DIR"
        " is set; remove STATE_DIR"
    )


def test_an_alias_of_another_project_is_read_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    pop_deprecation_notices()
    monkeypatch.delenv("GPUSLICE_NODE_NAME", raising=False)
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    parser = EnvArgumentParser(prog="x")
    parser.add_flag("--node-name", aliases=["NODE_NAME"], help="The node this runs on.")
    assert parser.parse_args([]).node_name == "gpu-node-1"
    assert pop_deprecation_notices() == []
    assert "[env GPUSLICE_NODE_NAME or NODE_NAME]" in " ".join(parser.format_help().split())
    monkeypatch.setenv("GPUSLICE_NODE_NAME", "gpu-node-2")
    parser = EnvArgumentParser(prog="x")
    parser.add_flag("--node-name", aliases=["NODE_NAME"], help="The node this runs on.")
    assert parser.parse_args([]).node_name == "gpu-node-2"


def test_a_bad_old_variable_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DYNAMIC_MIG", "maybe")
    with pytest.raises(ValueError, match="DYNAMIC_MIG='maybe' is not a boolean"):
        _deprecated_parser()
    pop_deprecation_notices()


@pytest.mark.parametrize(
    ("parse", "value", "error"),
    [
        (positive_seconds, "0", "'0' must be a positive number of seconds"),
        (positive_seconds, "soon", "'soon' is not a number of seconds"),
        (seconds_or_off, "-1", "'-1' must be 0 (off) or a positive number of seconds"),
        (seconds_or_off, "soon", "'soon' is not a number of seconds"),
    ],
)
def test_seconds_flags_name_the_bad_value(
    parse: Callable[[str], float], value: str, error: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        parse(value)
    assert str(raised.value) == error


def test_seconds_flags_take_their_range() -> None:
    assert positive_seconds("2.5") == 2.5
    assert seconds_or_off("0") == 0.0 and seconds_or_off("15") == 15.0


def test_help_names_every_env_var() -> None:
    parser = EnvArgumentParser(prog="x")
    parser.add_flag("--state-dir", help="Where state lives.", default="/var")
    parser.add_bool_flag("--dynamic-mig", help="Create MIG on demand.")
    parser.add_flag("--kubeconfig", env="KUBECONFIG", help="Kubeconfig file.")
    text = parser.format_help()
    assert "[env GPUSLICE_STATE_DIR]" in text and "[env GPUSLICE_DYNAMIC_MIG]" in text
    assert "[env KUBECONFIG]" in text
    assert set(parser.variables) == {"GPUSLICE_STATE_DIR", "GPUSLICE_DYNAMIC_MIG", "KUBECONFIG"}


@pytest.mark.usefixtures("restore_logging")
def test_logs_are_one_json_shape_for_ours_and_stdlib() -> None:
    out = io.StringIO()
    gs_logging.configure(component="test", stream=out)
    structlog.contextvars.bind_contextvars(claim="uid-1")
    gs_logging.get_logger("gpuslice.x").info("prepared", device="gpu-0")
    logging.getLogger("grpc.foreign").warning("channel closed")
    worker = threading.Thread(target=lambda: gs_logging.get_logger("w").info("from a worker"))
    worker.start()
    worker.join()
    structlog.contextvars.clear_contextvars()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["msg"] == "prepared" and lines[0]["device"] == "gpu-0"
    assert lines[0]["claim"] == "uid-1" and lines[0]["component"] == "test"
    assert lines[1]["msg"] == "channel closed" and lines[1]["level"] == "warning"
    assert list(lines[1])[:5] == ["ts", "level", "msg", "logger", "component"]
    assert "event" not in lines[1] and "timestamp" not in lines[1]
    assert lines[1]["component"] == "test", "foreign lines carry the component too"
    assert lines[2]["component"] == "test", "threads without our context carry it too"


@pytest.mark.usefixtures("restore_logging")
def test_logs_go_to_the_stdout_of_the_moment_not_a_closed_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run under pytest, a service's main configures logging onto a test's captured stdout,
    which pytest closes after that test. Later lines, from any thread, must still be written,
    not end in "--- Logging error --- ValueError: I/O operation on closed file"."""
    errors = io.StringIO()
    monkeypatch.setattr(sys, "stderr", errors)  # where logging reports a failed write
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stdout", captured)
    gs_logging.configure(component="test")
    captured.close()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stdout", later)
    worker = threading.Thread(target=lambda: gs_logging.get_logger("w").info("deregistering"))
    worker.start()
    worker.join()
    assert json.loads(later.getvalue())["msg"] == "deregistering"
    assert errors.getvalue() == ""


def test_bad_log_level_names_the_choices() -> None:
    with pytest.raises(ValueError, match="debug, info, warning, error"):
        gs_logging.configure(component="t", level="verbose")


def test_operation_metrics_label_results_and_are_served() -> None:
    registry = CollectorRegistry()
    prepare = OperationMetrics("kubeletplugin", "prepare", "Claims prepared", registry=registry)
    with prepare.time():
        pass
    with pytest.raises(KeyError), prepare.time():
        raise KeyError("x")
    server = serve("127.0.0.1:0", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        server.shutdown()
    assert 'gpuslice_kubeletplugin_prepare_total{result="success"} 1.0' in body
    assert 'gpuslice_kubeletplugin_prepare_total{result="KeyError"} 1.0' in body
    assert "gpuslice_kubeletplugin_prepare_duration_seconds_bucket" in body


@pytest.mark.parametrize("addr", ["9400", "host:port", ":99999"])
def test_bad_metrics_addr_is_refused(addr: str) -> None:
    with pytest.raises(ValueError, match="--metrics-addr"):
        parse_addr(addr)
