"""An OCI registry on loopback (or on any local address): Debian's ``docker-registry``
(distribution 2.8) with a config of our own, for pushing gpuslice's images and chart the way a
release does and pulling them the way a user's cluster does (docs/release.md).

    with start_registry(tmp_path / "registry") as registry:      # port 0: a free port
        push("oci-archive:...", f"{registry.address}/gpuslice/gpuslice-enforcer:0.1.0")

Plain HTTP (clients need ``--plain-http``/``--dest-tls-verify=false``, containerd a hosts.toml
with an ``http://`` server), no authentication, filesystem storage in the work directory, delete
enabled, the log in ``<workdir>/registry.log``. The bind address is a parameter: nodes that live
in network namespaces reach the registry on a bridge address rather than 127.0.0.1.

Command line (``make release-local`` uses the functions directly):

    python -m gpuslice_testkit.registry WORKDIR [--host 127.0.0.1] [--port 0]

prints ``HOST:PORT`` once the registry answers and serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

REGISTRY_BINARY = "/usr/bin/docker-registry"
START_TIMEOUT = 20.0
"""Seconds a start may take before it is an error (it takes about 0.1 s)."""
STOP_TIMEOUT = 10.0
_LISTENING = re.compile(r'msg="listening on (\S+)"')


class RegistryError(RuntimeError):
    """The registry could not start (the message carries the tail of its log)."""


@dataclass
class Registry:
    """A running registry; ``stop()`` (or leaving the ``with`` block) ends it."""

    host: str
    port: int
    workdir: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def address(self) -> str:
        """``HOST:PORT`` as image references and ``oci://`` URLs spell it (IPv6 in brackets)."""
        return f"{_url_host(self.host)}:{self.port}"

    @property
    def url(self) -> str:
        """The base URL of the registry API, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{self.address}"

    @property
    def log(self) -> Path:
        return self.workdir / "registry.log"

    def get_json(self, path: str, accept: str | None = None) -> tuple[dict[str, object], str]:
        """GET ``/v2/...`` as JSON; the body and the ``Docker-Content-Digest`` header."""
        request = urllib.request.Request(self.url + path)  # noqa: S310 (our http URL)
        if accept:
            request.add_header("Accept", accept)
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 (our http URL)
            body = json.loads(response.read())
            return body, response.headers.get("Docker-Content-Digest", "")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT seconds; idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Registry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _url_host(host: str) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    return host


def config_text(workdir: Path, host: str, port: int) -> str:
    """The registry's config.yml (JSON is YAML): storage and log under ``workdir``."""
    config = {
        "version": 0.1,
        "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": False}},
        "storage": {
            "filesystem": {"rootdirectory": str(workdir / "data")},
            "delete": {"enabled": True},
            # nothing else writes here; the purge would only add log lines
            "maintenance": {"uploadpurging": {"enabled": False}},
        },
        "http": {
            "addr": f"{_url_host(host)}:{port}",
            # one instance: a secret of its own, instead of a warning about a generated one
            "secret": secrets.token_hex(16),
        },
    }
    return json.dumps(config, indent=2) + "\n"


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def start_registry(
    workdir: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    binary: str = REGISTRY_BINARY,
    timeout: float = START_TIMEOUT,
) -> Registry:
    """Start ``docker-registry serve`` on ``host:port`` (port 0: a free one, read back from its
    log) and return once ``GET /v2/`` answers 200; RegistryError with the log's tail otherwise."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port: {port} is not a TCP port (0 = a free one, else 1..65535)")
    try:
        ipaddress.ip_address(host)
    except ValueError as exc:
        raise ValueError(
            f"host: {host!r} is not an IP address (the registry binds one address, e.g. "
            "127.0.0.1 or a bridge's address)"
        ) from exc
    if shutil.which(binary) is None:
        raise RegistryError(
            f"{binary} is not installed: apt-get install docker-registry (hack/node-packages.sh)"
        )
    workdir = workdir.resolve()
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    config = workdir / "config.yml"
    config.write_text(config_text(workdir, host, port))
    log = workdir / "registry.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [binary, "serve", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            # its own process group: a ^C at the terminal reaches us, and we stop it
            start_new_session=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")},
        )
    registry = Registry(host, port, workdir, process)
    try:
        registry.port = _wait_ready(registry, log.stat().st_size, timeout)
    except BaseException:
        registry.stop()
        raise
    return registry


def _wait_ready(registry: Registry, log_start: int, timeout: float) -> int:
    """The port it listens on, once its log says so and ``GET /v2/`` answers 200. The log line
    comes first even for a given port: another server on that port would answer too."""
    deadline = time.monotonic() + timeout
    port = 0
    last = "no 'listening on' line in its log yet"
    while time.monotonic() < deadline:
        if registry.process.poll() is not None:
            raise RegistryError(
                f"docker-registry exited with status {registry.process.returncode} before it "
                f"answered; the end of {registry.log}:\n{log_tail(registry.log)}"
            )
        if port == 0:
            with registry.log.open("rb") as f:
                f.seek(log_start)
                found = _LISTENING.search(f.read().decode(errors="replace"))
            if found:
                port = int(found.group(1).rsplit(":", 1)[1])
                registry.port = port
        if port:
            try:
                with urllib.request.urlopen(registry.url + "/v2/", timeout=2) as response:  # noqa: S310
                    if response.status == 200:
                        return port
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
        time.sleep(0.05)
    raise RegistryError(
        f"docker-registry did not answer GET /v2/ on {registry.address} within {timeout:g} s "
        f"({last}); the end of {registry.log}:\n{log_tail(registry.log)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuslice_testkit.registry",
        description="Serve an OCI registry (Debian's docker-registry) over plain HTTP until "
        "SIGINT or SIGTERM; prints HOST:PORT once it answers.",
    )
    parser.add_argument("workdir", type=Path, help="Directory for its config, storage and log.")
    parser.add_argument("--host", default="127.0.0.1", help="The IP address to bind.")
    parser.add_argument("--port", type=int, default=0, help="The port to bind; 0 picks a free one.")
    args = parser.parse_args(argv)
    try:
        registry = start_registry(args.workdir, args.host, args.port)
    except (ValueError, RegistryError) as exc:
        print(f"registry: {exc}", file=sys.stderr)
        return 1
    stop = False

    def handle(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    print(registry.address, flush=True)
    with registry:
        while not stop:
            try:
                registry.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                continue
            print(
                f"registry: docker-registry exited with status {registry.process.returncode}; "
                f"the end of {registry.log}:\n{log_tail(registry.log)}",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
