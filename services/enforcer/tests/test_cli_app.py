"""cli.py's flags → Settings, and the app built, started and stopped with the fake NVML."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gpuslice_enforcer.app import EnforcerApp
from gpuslice_enforcer.cgroups import CgroupView
from gpuslice_enforcer.cli import Settings, build_parser, main, settings_from
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.server import attach_socket_for
from gpuslice_nvml.fake import FakeNvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc
from gpuslice_testkit.core import ServiceProcess, http_probe, wait_for

NODE = 'name: n\ndriverVersion: "570.1"\nstatePath: s.json\ngpus:\n  - model: L4\n'


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a path short enough for unix sockets (tmp_path may not be)."""
    path = Path(tempfile.mkdtemp(prefix="enf-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_defaults_are_the_config_defaults() -> None:
    settings = settings_from(build_parser().parse_args([]))
    defaults = EnforcerConfig(
        socket=Path("/var/run/gpuslice/enforcer.sock"),
        state_dir=Path("/var/lib/gpuslice/enforcer"),
    )
    assert settings.enforcement == defaults
    assert (settings.metrics_addr, settings.log_level, settings.nvml) == (":9402", "info", "real")


def test_flags_reach_the_settings(tmp_path: Path) -> None:
    node = tmp_path / "node.yaml"
    node.write_text(NODE)
    args = build_parser().parse_args(
        [
            "--nvml=fake",
            f"--fake-nvml-config={node}",
            "--mps=off",
            "--compute-mode=leave",
            "--stop-mps-on-exit",
            "--hook-socket=/host/e.sock",
        ]
    )
    s = settings_from(args).enforcement
    assert not s.mps and not s.manage_compute_mode and not s.keep_mps_on_exit
    assert s.effective_hook_socket == Path("/host/e.sock")
    assert s.mps_env == {"GPUSLICE_FAKE_NVML_CONFIG": str(node.resolve())}
    assert s.mps_control != ("nvidia-cuda-mps-control",)  # the fake's stand-in


def test_settings_check_themselves() -> None:
    with pytest.raises(ValueError, match="--sample-interval"):
        Settings(EnforcerConfig(socket=Path("s"), state_dir=Path("d"), sample_interval_s=0))
    assert main(["--sample-interval=0"]) == 2


def test_app_starts_serves_and_stops(short_dir: Path) -> None:
    node = short_dir / "node.yaml"
    node.write_text(NODE)
    socket = short_dir / "e.sock"
    settings = Settings(EnforcerConfig(socket=socket, state_dir=short_dir / "state", mps=False))
    app = EnforcerApp(
        settings,
        FakeNvml.from_config_file(node),
        registry=CollectorRegistry(),
        cgroups=CgroupView(mounts=()),
        boot_id="boot-1",
    )
    app.start()
    try:
        assert socket.is_socket() and attach_socket_for(socket).is_socket()
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            reply = pb_grpc.EnforcerStub(channel).GetCapabilities(
                pb.GetCapabilitiesRequest(), timeout=5
            )
        assert len(reply.gpus) == 1
    finally:
        app.stop(grace=1.0)
    assert not socket.exists() and not attach_socket_for(socket).exists()


def test_health_answers_while_serving_and_503_otherwise(short_dir: Path) -> None:
    """/readyz: 503 while starting, 200 once the socket serves, 503 when it stops answering or
    the enforcer stops; /healthz is 200 while it serves; the port closes with the app."""
    node = short_dir / "node.yaml"
    node.write_text(NODE)
    settings = Settings(
        EnforcerConfig(socket=short_dir / "e.sock", state_dir=short_dir / "state", mps=False),
        health_addr="127.0.0.1:0",
    )
    app = EnforcerApp(
        settings,
        FakeNvml.from_config_file(node),
        registry=CollectorRegistry(),
        cgroups=CgroupView(mounts=()),
        boot_id="boot-1",
    )
    assert app.ready() == ["starting"] and app.live() == []
    app.start()
    port = app.health_port
    assert port is not None
    try:
        assert http_probe(port, "/readyz") == 200
        assert http_probe(port, "/healthz") == 200
        app.server.health.enter_graceful_shutdown()  # the socket says NOT_SERVING
        assert http_probe(port, "/readyz") == 503
        assert http_probe(port, "/healthz") == 503
    finally:
        app.stop(grace=1.0)
    assert app.ready() == ["stopping"]
    assert http_probe(port, "/readyz") is None


def test_the_process_answers_readyz_until_it_stops(short_dir: Path) -> None:
    """The real process (python -m gpuslice_enforcer): /readyz 200 once it serves, 503 or
    closed once SIGTERM arrives (it stops the socket first, the health server last)."""
    node = short_dir / "node.yaml"
    node.write_text(NODE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = ServiceProcess(
        "enforcer",
        [
            sys.executable,
            "-m",
            "gpuslice_enforcer",
            "--nvml=fake",
            f"--fake-nvml-config={node}",
            f"--socket={short_dir / 'e.sock'}",
            f"--state-dir={short_dir / 'state'}",
            f"--mps-root={short_dir / 'mps'}",
            "--hook-path=",
            "--mps=off",
            "--metrics-addr=",
            f"--health-addr=127.0.0.1:{port}",
        ],
        log=short_dir / "enforcer.log",
        ready=lambda: http_probe(port, "/readyz") == 200,
    ).start()
    try:
        assert http_probe(port, "/healthz") == 200
        os.kill(proc.pid, signal.SIGTERM)
        wait_for(lambda: http_probe(port, "/readyz") in (503, None), 10, "not ready")
        assert proc.wait(10) == 0
        assert http_probe(port, "/readyz") is None
    finally:
        proc.stop()
