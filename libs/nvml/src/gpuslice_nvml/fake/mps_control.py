"""A stand-in for ``nvidia-cuda-mps-control`` on fake NVML nodes (no CUDA, no GPU).

The enforcer starts and drives MPS control daemons; on a node without GPUs it runs this program
instead, with the same command line, environment and control-socket layout:

    python -m gpuslice_nvml.fake.mps_control -f [-p 3] [-m] [-a config.toml]   # daemon, foreground
    python -m gpuslice_nvml.fake.mps_control -d [-p 3] ...                     # daemon, background
    python -m gpuslice_nvml.fake.mps_control namespace create --server=s --name=n ...  # protocol 3
    echo get_server_list | python -m gpuslice_nvml.fake.mps_control            # protocol 2
    python -m gpuslice_nvml.fake.mps_control -q                                # quit

The enforcer runs it by file path (``python -P …/mps_control.py``, see :data:`COMMAND`), which
skips importing the whole ``gpuslice_nvml`` package for each control command.

Environment: ``CUDA_MPS_PIPE_DIRECTORY`` (default /tmp/nvidia-mps), ``CUDA_MPS_LOG_DIRECTORY``
(default /var/log/nvidia-mps), ``CUDA_MPS_PROTOCOL_VERSION`` (wins over ``-p``), and
``GPUSLICE_FAKE_NVML_CONFIG``: the fake node whose driver version decides whether protocol 3 exists
(615+) and whose GPU UUIDs ``allowed_devices`` must name.

What it models (see docs/enforcer.md): the control socket ``$PIPE/control`` and pid file
``$PIPE/nvidia-cuda-mps-control.pid``; protocol 3's named servers and namespaces with their
limits, each namespace with its socket ``$PIPE/<server>/<namespace>/control`` (and
``$PIPE/<server>/control`` routing to the default namespace), created and removed at run time
or from a TOML file (``-a``, keys checked as the real daemon documents them); protocol 2's
default active thread percentage and pinned memory limits and per-uid servers. It keeps no CUDA
clients: nothing connects to the namespace sockets. ``status`` (stand-in only) prints the whole
state as JSON, which is also written to ``$PIPE/.gpuslice-fake-mps.json`` on every change.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The command line that runs this program like ``nvidia-cuda-mps-control``.
COMMAND = (sys.executable, "-P", __file__)
PID_FILE = "nvidia-cuda-mps-control.pid"
STATE_FILE = ".gpuslice-fake-mps.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_MEMORY = re.compile(r"\d+[KMGT]?")
_SERVER_KEYS = {
    "allowed_devices",
    "pinned_memory_limit",
    "active_thread_percentage",
    "client_priority",
    "uid",
    "locality_domains",
}
_NAMESPACE_KEYS = {"pinned_memory_limit", "active_thread_percentage", "client_priority"}


class MpsError(Exception):
    """A command the daemon refuses; the message is what it answers."""


def pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")


def log_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")


@dataclass
class Namespace:
    active_thread_percentage: int | None = None
    pinned_memory_limit: str | None = None
    client_priority: int | None = None


@dataclass
class Server:
    uid: int = 0
    allowed_devices: list[str] = field(default_factory=list)
    active_thread_percentage: int | None = None
    pinned_memory_limit: str | None = None
    client_priority: int | None = None
    namespaces: dict[str, Namespace] = field(default_factory=dict)


def _percent(value: Any, key: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError) as exc:
        raise MpsError(f"{key}: {value!r} is not a percentage") from exc
    if not 1 <= number <= 100:
        raise MpsError(f"{key}: {number} is outside 1..100")
    return number


def _memory(value: Any, key: str) -> str:
    text = str(value).strip().upper()
    if not _MEMORY.fullmatch(text):
        raise MpsError(f"{key}: {value!r} is not a size like 4096M or 10G")
    return text


def _name(value: str, what: str) -> str:
    if not _NAME.fullmatch(value):
        raise MpsError(f"{what} {value!r}: use letters, digits, '-', '_' and '.' (max 63)")
    return value


class Daemon:
    """The control daemon's state and its sockets."""

    def __init__(self, protocol: int, multiuser: bool, gpus: set[str]) -> None:
        self.protocol = protocol
        self.multiuser = multiuser
        self.gpus = gpus
        self.pipe = pipe_dir()
        self.servers: dict[str, Server] = {}
        self.default_atp = 100
        self.default_pinned: dict[str, str] = {}
        self.legacy_servers: dict[int, int] = {}
        self._sockets: dict[Path, socket.socket] = {}
        self._lock = threading.Lock()
        self.quit = threading.Event()

    # -- namespace sockets ----------------------------------------------------------------
    def _listen(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise MpsError(f"cannot create the socket {path}: {exc.strerror}") from exc
        sock.listen(1)
        self._sockets[path] = sock

    def _close(self, path: Path) -> None:
        sock = self._sockets.pop(path, None)
        if sock is not None:
            sock.close()
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()

    def _open_server(self, name: str) -> None:
        self._listen(self.pipe / name / "control")
        self._listen(self.pipe / name / "default" / "control")

    def _close_server(self, name: str, server: Server) -> None:
        for ns in server.namespaces:
            self._close(self.pipe / name / ns / "control")
        self._close(self.pipe / name / "default" / "control")
        self._close(self.pipe / name / "control")

    # -- protocol 3 -----------------------------------------------------------------------
    def add_server(self, name: str, opts: dict[str, Any]) -> None:
        _name(name, "server")
        if name in self.servers:
            raise MpsError(f"server {name} already exists")
        unknown = set(opts) - _SERVER_KEYS
        if unknown:
            raise MpsError(f"server {name}: unknown option(s) {', '.join(sorted(unknown))}")
        server = Server(uid=int(opts.get("uid", os.getuid())))
        devices = opts.get("allowed_devices")
        if devices:
            server.allowed_devices = [d.strip() for d in str(devices).split(",") if d.strip()]
            missing = [d for d in server.allowed_devices if self.gpus and d not in self.gpus]
            if missing:
                raise MpsError(f"server {name}: no such device(s) {', '.join(missing)}")
        if "active_thread_percentage" in opts:
            server.active_thread_percentage = _percent(
                opts["active_thread_percentage"], "active_thread_percentage"
            )
        if "pinned_memory_limit" in opts:
            server.pinned_memory_limit = _memory(opts["pinned_memory_limit"], "pinned_memory_limit")
        if "client_priority" in opts:
            server.client_priority = int(opts["client_priority"])
        self.servers[name] = server
        self._open_server(name)

    def set_namespace(
        self, server_name: str, name: str, opts: dict[str, Any], create: bool
    ) -> None:
        server = self.servers.get(server_name)
        if server is None:
            raise MpsError(f"no server {server_name}")
        _name(name, "namespace")
        if name == "default":
            raise MpsError("namespace 'default' is the server's own; set the server instead")
        unknown = set(opts) - _NAMESPACE_KEYS
        if unknown:
            raise MpsError(f"namespace {name}: unknown option(s) {', '.join(sorted(unknown))}")
        if create and name in server.namespaces:
            raise MpsError(f"namespace {name} already exists on server {server_name}")
        if not create and name not in server.namespaces:
            raise MpsError(f"no namespace {name} on server {server_name}")
        ns = server.namespaces.get(name) or Namespace()
        if "active_thread_percentage" in opts:
            atp = _percent(opts["active_thread_percentage"], "active_thread_percentage")
            ceiling = server.active_thread_percentage or 100
            if atp > ceiling:
                raise MpsError(
                    f"namespace {name}: active_thread_percentage {atp} exceeds the server's "
                    f"{ceiling}"
                )
            ns.active_thread_percentage = atp
        if "pinned_memory_limit" in opts:
            ns.pinned_memory_limit = _memory(opts["pinned_memory_limit"], "pinned_memory_limit")
        if "client_priority" in opts:
            ns.client_priority = int(opts["client_priority"])
        if create:
            server.namespaces[name] = ns
            self._listen(self.pipe / server_name / name / "control")

    def apply_toml(self, path: Path) -> None:
        try:
            doc = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise MpsError(f"{path}: {exc}") from exc
        if doc.get("schema_version") != "1.0":
            raise MpsError(f'{path}: schema_version must be "1.0"')
        unknown = set(doc) - {"schema_version", "servers", "features"}
        if unknown:
            raise MpsError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
        for name, table in dict(doc.get("servers", {})).items():
            opts = {k: v for k, v in table.items() if k not in ("namespaces", "devices")}
            self.add_server(name, opts)
            for ns_name, ns_opts in dict(table.get("namespaces", {})).items():
                self.set_namespace(name, ns_name, dict(ns_opts), create=True)

    def protocol3(self, tokens: list[str]) -> str:
        if tokens in (["quit"], ["-q"]):
            self.quit.set()
            return "quitting"
        if len(tokens) < 2:
            raise MpsError(f"expected '<module> <verb> [--option=value ...]', got {tokens!r}")
        module, verb, opts = tokens[0], tokens[1], _options(tokens[2:])
        if module == "server":
            if verb == "create":
                self.add_server(str(opts.pop("name", "")), opts)
                return "ok"
            if verb == "delete":
                name = str(opts.get("name", ""))
                server = self.servers.pop(name, None)
                if server is None:
                    raise MpsError(f"no server {name}")
                self._close_server(name, server)
                return "ok"
            if verb == "list":
                return "\n".join(sorted(self.servers))
            if verb == "get":
                name = str(opts.get("name", ""))
                if name not in self.servers:
                    raise MpsError(f"no server {name}")
                return json.dumps(asdict(self.servers[name]), sort_keys=True)
        if module == "namespace":
            server_name, name = str(opts.pop("server", "")), str(opts.pop("name", ""))
            if verb in ("create", "set"):
                self.set_namespace(server_name, name, opts, create=verb == "create")
                return "ok"
            server = self.servers.get(server_name)
            if server is None:
                raise MpsError(f"no server {server_name}")
            if verb == "list":
                return "\n".join(sorted(server.namespaces))
            if verb == "get":
                if name not in server.namespaces:
                    raise MpsError(f"no namespace {name} on server {server_name}")
                ns = server.namespaces[name]
                return "\n".join(f"{k}={v}" for k, v in asdict(ns).items() if v is not None)
            if verb == "delete":
                if server.namespaces.pop(name, None) is None:
                    raise MpsError(f"no namespace {name} on server {server_name}")
                self._close(self.pipe / server_name / name / "control")
                return "ok"
        if module == "client" and verb == "list":
            return ""
        raise MpsError(f"unknown command {module} {verb}")

    # -- protocol 2 (legacy) --------------------------------------------------------------
    def protocol2(self, tokens: list[str]) -> str:
        command, args = tokens[0], tokens[1:]
        if command == "quit":
            self.quit.set()
            return "quitting"
        if command == "get_server_list":
            return "\n".join(str(pid) for pid in self.legacy_servers.values())
        if command == "start_server" and len(args) >= 2 and args[0] == "-uid":
            uid = int(args[1])
            if self.legacy_servers and uid not in self.legacy_servers and not self.multiuser:
                raise MpsError(f"a server for another user is running; uid {uid} must wait")
            self.legacy_servers.setdefault(uid, 100000 + len(self.legacy_servers))
            return "ok"
        if command == "set_default_active_thread_percentage" and len(args) == 1:
            self.default_atp = _percent(args[0], command)
            return str(self.default_atp)
        if command == "get_default_active_thread_percentage":
            return str(self.default_atp)
        if command == "set_default_device_pinned_mem_limit" and len(args) == 2:
            self.default_pinned[args[0]] = _memory(args[1], command)
            return "ok"
        if command == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.default_pinned.get(args[0], "0")
        raise MpsError(f"unknown command {' '.join(tokens)}")

    # -- dispatch -------------------------------------------------------------------------
    def execute(self, line: str) -> tuple[bool, str]:
        tokens = shlex.split(line)
        if not tokens:
            return True, ""
        with self._lock:
            if tokens == ["status"]:
                return True, json.dumps(self.snapshot(), sort_keys=True)
            try:
                reply = self.protocol3(tokens) if self.protocol == 3 else self.protocol2(tokens)
            except MpsError as exc:
                _log(f"refused {line.strip()!r}: {exc}")
                return False, f"Error: {exc}"
            _log(f"{line.strip()} -> {reply.splitlines()[0] if reply else ''}")
            self._save()
            return True, reply

    def snapshot(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "visibleDevices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "protocol": self.protocol,
            "multiuser": self.multiuser,
            "servers": {name: asdict(s) for name, s in self.servers.items()},
            "defaultActiveThreadPercentage": self.default_atp,
            "defaultPinnedMemLimits": self.default_pinned,
            "legacyServers": {str(k): v for k, v in self.legacy_servers.items()},
        }

    def _save(self) -> None:
        tmp = self.pipe / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(self.snapshot(), sort_keys=True, indent=1))
        tmp.replace(self.pipe / STATE_FILE)

    def shutdown(self) -> None:
        for name, server in list(self.servers.items()):
            self._close_server(name, server)
        self.servers.clear()
        for path in list(self._sockets):
            self._close(path)
        for leftover in (STATE_FILE, PID_FILE):
            (self.pipe / leftover).unlink(missing_ok=True)


def _options(tokens: list[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise MpsError(f"unexpected argument {token!r}")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens):
                raise MpsError(f"--{key} needs a value")
            i += 1
            value = tokens[i]
        opts[key.replace("-", "_")] = value
        i += 1
    return opts


def _log(message: str) -> None:
    with contextlib.suppress(OSError):
        directory = log_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / "control.log").open("a") as out:
            out.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n")


def _fake_gpus(protocol: int) -> set[str]:
    """The fake node's GPU UUIDs; refuses protocol 3 on a driver that lacks it."""
    # Imported here: the client side of this program stays light (it runs once per command).
    from gpuslice_core.errors import GpusliceError
    from gpuslice_nvml.fake.node import load_node
    from gpuslice_nvml.types import MEMORY_PARTITIONING_MIN_DRIVER, driver_major

    # gpuslice_nvml.types.FAKE_NVML_CONFIG_ENV, not imported: this file runs by path (-P).
    config = os.environ.get("GPUSLICE_FAKE_NVML_CONFIG")
    if not config:
        if protocol == 3:
            raise MpsError(
                "protocol 3 needs driver 615+: set GPUSLICE_FAKE_NVML_CONFIG to tell the driver"
            )
        return set()
    try:
        node = load_node(config)
    except GpusliceError as exc:
        raise MpsError(str(exc)) from exc
    if protocol == 3 and driver_major(node.driver_version) < MEMORY_PARTITIONING_MIN_DRIVER:
        raise MpsError(
            f"protocol 3 is not supported by driver {node.driver_version} "
            f"(needs {MEMORY_PARTITIONING_MIN_DRIVER}+)"
        )
    return {gpu.uuid for gpu in node.gpus}


def serve(daemon: Daemon) -> int:
    """Run the daemon in the foreground until ``quit`` or SIGTERM."""
    pipe = daemon.pipe
    pipe.mkdir(parents=True, exist_ok=True)
    control = pipe / "control"
    control.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(control))
    listener.listen(16)
    listener.settimeout(0.1)

    # The handler only records: an Event.set there can wait for a lock the main thread holds
    # (gpuslice_core.grpcserver.StopSignals; this file imports nothing of gpuslice).
    stopped: list[int] = []

    def on_term(signum: int, _frame: object) -> None:
        stopped.append(signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    daemon._save()
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    _log(f"daemon started (protocol {daemon.protocol}, multiuser {daemon.multiuser})")
    try:
        while not daemon.quit.is_set() and not stopped:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                with contextlib.suppress(TimeoutError, OSError):
                    while not data.endswith(b"\n"):
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                ok, reply = daemon.execute(data.decode(errors="replace"))
                with contextlib.suppress(OSError):
                    conn.sendall(("0" if ok else "1").encode() + reply.encode() + b"\n")
    finally:
        listener.close()
        control.unlink(missing_ok=True)
        daemon.shutdown()
        _log("daemon stopped")
    return 0


def send(line: str, timeout: float = 10.0) -> tuple[bool, str]:
    """Send one command to the daemon of ``$CUDA_MPS_PIPE_DIRECTORY``; (ok, reply)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(pipe_dir() / "control"))
        except OSError as exc:
            raise MpsError(f"Cannot find MPS control daemon process ({exc.strerror})") from exc
        sock.sendall(line.strip().encode() + b"\n")
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    text = data.decode(errors="replace")
    return text[:1] == "0", text[1:].rstrip("\n")


def _daemonize(argv: list[str]) -> int:
    """``-d``: start the foreground daemon detached and return once it answers."""
    args = [a for a in argv if a not in ("-d", "--daemon")]
    proc = subprocess.Popen(
        [*COMMAND, "-f", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print("An instance of this daemon could not start", file=sys.stderr)
            return 1
        if (pipe_dir() / PID_FILE).exists():
            return 0
        time.sleep(0.02)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    protocol, multiuser, apply, mode = 2, False, None, "client"
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-d", "--daemon"):
            mode = "daemon"
        elif arg in ("-f", "--foreground"):
            mode = "foreground"
        elif arg in ("-m", "--multiuser"):
            multiuser = True
        elif arg in ("-q", "--quit"):
            rest = ["quit"]
        elif arg in ("-p", "--protocol") and i + 1 < len(args):
            protocol, i = int(args[i + 1]), i + 1
        elif arg in ("-a", "--apply") and i + 1 < len(args):
            apply, i = Path(args[i + 1]), i + 1
        else:
            rest.append(arg)
        i += 1
    if os.environ.get("CUDA_MPS_PROTOCOL_VERSION"):
        protocol = int(os.environ["CUDA_MPS_PROTOCOL_VERSION"])
    if mode == "daemon":
        return _daemonize(args)
    if mode == "foreground":
        try:
            daemon = Daemon(protocol, multiuser, _fake_gpus(protocol))
            if apply is not None:
                if protocol != 3:
                    raise MpsError("-a/--apply needs protocol 3")
                daemon.apply_toml(apply)
        except MpsError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            return 1
        return serve(daemon)
    lines = [shlex.join(rest)] if rest else [line for line in sys.stdin if line.strip()]
    status = 0
    for line in lines:
        try:
            ok, reply = send(line)
        except MpsError as exc:
            print(str(exc), file=sys.stderr)
            return 1
        if reply:
            print(reply, file=sys.stdout if ok else sys.stderr)
        status = status or (0 if ok else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
