"""The loopback registry: it starts on a free port or a given one, answers the registry API,
refuses bad input by name, reports a failed start with its log, and stops with its command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpuslice_testkit.registry import RegistryError, start_registry

pytestmark = pytest.mark.skipif(
    shutil.which("docker-registry") is None,
    reason="docker-registry is not installed: hack/node-packages.sh installs it",
)


def refused(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
    except urllib.error.URLError:
        return True
    return False


def test_starts_on_a_free_port_answers_and_stops(tmp_path: Path) -> None:
    with start_registry(tmp_path) as registry:
        assert registry.port > 0
        assert registry.address == f"127.0.0.1:{registry.port}"
        body, _ = registry.get_json("/v2/_catalog")
        assert body == {"repositories": []}
        config = (tmp_path / "config.yml").read_text()
        assert json.loads(config)["storage"]["filesystem"]["rootdirectory"] == str(
            tmp_path.resolve() / "data"
        )
    assert registry.process.returncode is not None
    assert refused(f"{registry.url}/v2/")


def test_a_taken_port_fails_with_the_log(tmp_path: Path) -> None:
    with start_registry(tmp_path / "one") as first:
        with pytest.raises(RegistryError, match="address already in use") as err:
            start_registry(tmp_path / "two", port=first.port)
        assert "exited with status" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"host": "localhost"}, "host: 'localhost' is not an IP address"),
        ({"port": 70000}, "port: 70000"),
    ],
)
def test_bad_input_names_the_field(tmp_path: Path, kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        start_registry(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "config.yml").exists()


def test_the_command_line_serves_until_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuslice_testkit.registry", str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("127.0.0.1:")
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=5) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert refused(f"http://{address}/v2/")


def test_binds_the_address_and_port_it_is_given(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with start_registry(tmp_path, host="127.0.0.1", port=port) as registry:
        assert registry.port == port
        assert f'listening on 127.0.0.1:{port}"' in registry.log.read_text()


def test_an_ipv6_address_is_bracketed_where_references_need_it(tmp_path: Path) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback on this machine: {exc}")
    with start_registry(tmp_path, host="::1") as registry:
        assert registry.address == f"[::1]:{registry.port}"
        body, _ = registry.get_json("/v2/_catalog")
        assert body == {"repositories": []}
