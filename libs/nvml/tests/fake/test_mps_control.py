"""The stand-in MPS control daemon: protocol 3 servers and namespaces, protocol 2 defaults."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslice_nvml.fake import FakeNvml, mps_control

pytestmark = pytest.mark.timeout(30)

NODE = """
name: mps-node
driverVersion: "{driver}"
gpus:
  - model: L4
"""


@pytest.fixture
def pipe() -> Iterator[Path]:
    """A short pipe directory: unix socket paths are limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="gs-mps-") as directory:
        yield Path(directory)


def _env(config: Path, pipe: Path) -> dict[str, str]:
    return {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(pipe / "log"),
        "GPUSLICE_FAKE_NVML_CONFIG": str(config),
    }


def _mps(
    env: dict[str, str], *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*mps_control.COMMAND, *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


def test_protocol3_refused_before_driver_615(
    write_config: Callable[[str], Path], pipe: Path
) -> None:
    env = _env(write_config(NODE.format(driver="580.65.06")), pipe)
    result = _mps(env, "-f", "-p", "3")
    assert result.returncode == 1
    assert "protocol 3 is not supported by driver 580.65.06" in result.stderr


def _send(monkeypatch: pytest.MonkeyPatch, pipe: Path, line: str) -> tuple[bool, str]:
    """One command over the control socket, in-process (what the CLI client does)."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    return mps_control.send(line)


def test_protocol3_servers_and_namespaces(
    write_config: Callable[[str], Path], pipe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(NODE.format(driver="615.20.01"))
    uuid = FakeNvml.from_config_file(config).gpu(0).uuid
    toml = pipe / "mps.toml"
    toml.write_text(
        textwrap.dedent(f"""
        schema_version = "1.0"
        [servers.gpuslice]
        allowed_devices = "{uuid}"
        active_thread_percentage = "100"
        """)
    )
    env = _env(config, pipe)
    assert _mps(env, "-d", "-p", "3", "-a", str(toml)).returncode == 0
    try:
        assert (pipe / "control").is_socket()
        assert (pipe / "gpuslice" / "control").is_socket()
        created = _mps(
            env, "namespace", "create", "--server=gpuslice", "--name=sh-1",
            "--active-thread-percentage=30", "--pinned-memory-limit=4096M",
        )  # fmt: skip
        assert created.returncode == 0, created.stderr
        assert (pipe / "gpuslice" / "sh-1" / "control").is_socket()
        ok, names = _send(monkeypatch, pipe, "namespace list --server=gpuslice")
        assert ok and names.split() == ["sh-1"]
        ok, got = _send(monkeypatch, pipe, "namespace get --server=gpuslice --name=sh-1")
        assert "active_thread_percentage=30" in got and "pinned_memory_limit=4096M" in got
        ok, dup = _send(monkeypatch, pipe, "namespace create --server=gpuslice --name=sh-1")
        assert not ok and "already exists" in dup
        ok, _ = _send(
            monkeypatch,
            pipe,
            "namespace set --server=gpuslice --name=sh-1 --active-thread-percentage=101",
        )
        assert not ok
        assert _send(monkeypatch, pipe, "namespace delete --server=gpuslice --name=sh-1")[0]
        assert not (pipe / "gpuslice" / "sh-1").exists()
        status = json.loads(_send(monkeypatch, pipe, "status")[1])
        assert status["protocol"] == 3 and list(status["servers"]) == ["gpuslice"]
    finally:
        assert _mps(env, "-q").returncode == 0
    deadline = time.monotonic() + 10
    while (pipe / "control").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (pipe / "control").exists() and not (pipe / "gpuslice").exists()


def test_protocol2_legacy_commands(
    write_config: Callable[[str], Path], pipe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(write_config(NODE.format(driver="570.158.01")), pipe)
    daemon = subprocess.Popen([*mps_control.COMMAND, "-f"], env=env)
    try:
        deadline = time.monotonic() + 10
        while not (pipe / "nvidia-cuda-mps-control.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        result = _mps(env, stdin="set_default_active_thread_percentage 40\nget_server_list\n")
        assert result.returncode == 0, result.stderr
        assert _send(monkeypatch, pipe, "get_default_active_thread_percentage") == (True, "40")
        assert not _send(monkeypatch, pipe, "namespace list --server=x")[0]  # not protocol 2
        assert _send(monkeypatch, pipe, "start_server -uid 1000")[0]
        ok, refused = _send(monkeypatch, pipe, "start_server -uid 1001")
        assert not ok and "must wait" in refused  # one user at a time without -m
        assert _mps(env, stdin="quit\n").returncode == 0
        assert daemon.wait(timeout=10) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
