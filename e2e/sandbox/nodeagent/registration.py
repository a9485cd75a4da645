"""The kubelet's plugin manager: finds plugins through sockets in ``plugins_registry/``.

Real kubelet watches the directory with fsnotify; this polls it every ``plugin_poll`` seconds,
which gives the same observable behaviour at that granularity:

- every unix socket present at start counts as created; files whose name starts with ``.`` and
  files that are not sockets are ignored; subdirectories are scanned too;
- a socket that vanished is deregistered; a socket that was re-created (new inode or change
  time) is deregistered and registered again; nothing else re-registers a plugin;
- registration: dial (blocking, 10 s) → ``GetInfo`` (1 s) → handler by ``type`` → validate →
  register → ``NotifyRegistrationStatus(true)`` last; any rejection is reported with
  ``NotifyRegistrationStatus(false, <message>)``; a failed attempt is retried with
  exponential backoff.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from e2e.sandbox.nodeagent.config import Timings
from gpuslice_core.logging import get_logger
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2 as reg_pb2
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = get_logger(__name__)

DIAL_TIMEOUT = 10.0
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
STOP_CHECK = 0.2  # how often a dial looks whether the watcher is being stopped


class RegistrationError(Exception):
    """A plugin was rejected; the message goes back in NotifyRegistrationStatus."""


class PluginHandler(Protocol):
    """What a plugin type (DRAPlugin, DevicePlugin) must offer the plugin manager."""

    def validate_plugin(self, name: str, endpoint: str, versions: list[str]) -> None: ...

    def register_plugin(self, name: str, endpoint: str, versions: list[str]) -> None: ...

    def deregister_plugin(self, name: str, endpoint: str) -> None: ...


@dataclass(frozen=True)
class SocketId:
    inode: int
    ctime_ns: int


@dataclass
class Registered:
    identity: SocketId
    plugin_type: str
    name: str
    endpoint: str


@dataclass
class Backoff:
    failures: int = 0
    next_try: float = 0.0
    identity: SocketId | None = None


def scan(directory: Path) -> dict[Path, SocketId]:
    """The plugin sockets under ``directory`` (recursively), skipping dot files."""
    found: dict[Path, SocketId] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fname in filenames:
            if fname.startswith("."):
                continue
            path = Path(dirpath) / fname
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                found[path] = SocketId(st.st_ino, st.st_ctime_ns)
    return found


class PluginWatcher:
    """Polls the registration directory and drives registration/deregistration."""

    def __init__(
        self, directory: Path, handlers: dict[str, PluginHandler], timings: Timings, node: str
    ) -> None:
        self.directory = directory
        self.handlers = handlers
        self.timings = timings
        self.node = node
        self.registered: dict[Path, Registered] = {}
        self._backoff: dict[Path, Backoff] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(
            target=self._loop, name=f"{self.node}-plugin-watcher", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Returns once the watcher thread has ended (a dial in progress is given up), so that
        nothing it does, logging included, happens after the caller moved on."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=GET_INFO_TIMEOUT + NOTIFY_TIMEOUT + 10)
            if self._thread.is_alive():
                log.warning("plugin watcher did not stop", node=self.node)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:
                log.exception("plugin reconcile failed", node=self.node)
            self._stop.wait(self.timings.plugin_poll)

    def reconcile(self) -> None:
        """One pass: deregister vanished or re-created sockets, then register new ones."""
        desired = scan(self.directory)
        with self._lock:
            for path, reg in list(self.registered.items()):
                if desired.get(path) != reg.identity:
                    self._deregister(path, reg)
            for path in set(self._backoff) - set(desired):
                del self._backoff[path]
            for path, identity in sorted(desired.items()):
                if path in self.registered:
                    continue
                backoff = self._backoff.get(path)
                if backoff is not None and backoff.identity == identity:
                    if time.monotonic() < backoff.next_try:
                        continue
                elif backoff is not None:  # re-created since the failure: try at once
                    backoff = None
                if self._register(path, identity):
                    self._backoff.pop(path, None)
                else:
                    backoff = backoff or Backoff(identity=identity)
                    delay = min(
                        self.timings.registration_backoff_initial * 2**backoff.failures,
                        self.timings.registration_backoff_max,
                    )
                    backoff.failures += 1
                    backoff.next_try = time.monotonic() + delay
                    self._backoff[path] = backoff

    def _deregister(self, path: Path, reg: Registered) -> None:
        del self.registered[path]
        handler = self.handlers.get(reg.plugin_type)
        log.info(
            "plugin socket removed or re-created; deregistering",
            socket=str(path),
            plugin=reg.name,
            node=self.node,
        )
        if handler is not None:
            try:
                handler.deregister_plugin(reg.name, reg.endpoint)
            except Exception:
                log.exception("deregistration failed", plugin=reg.name)

    def _register(self, path: Path, identity: SocketId) -> bool:
        """One registration attempt; False when it should be retried with backoff."""
        channel = grpc.insecure_channel(f"unix://{path}")
        try:
            try:
                self._dial(channel)
                stub = reg_grpc.RegistrationStub(channel)
                info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
                log.warning("plugin GetInfo failed", socket=str(path), error=_rpc_text(exc))
                return False
            handler = self.handlers.get(info.type)
            if handler is None:
                return self._notify(
                    stub,
                    path,
                    False,
                    f"no handler registered for plugin type: {info.type} at socket {path}",
                )
            endpoint = info.endpoint or str(path)
            versions = list(info.supported_versions)
            try:
                handler.validate_plugin(info.name, endpoint, versions)
            except RegistrationError as exc:
                return self._notify(
                    stub,
                    path,
                    False,
                    f"RegisterPlugin error -- plugin validation failed with err: {exc}",
                )
            self.registered[path] = Registered(identity, info.type, info.name, endpoint)
            try:
                handler.register_plugin(info.name, endpoint, versions)
            except Exception as exc:
                del self.registered[path]
                return self._notify(
                    stub,
                    path,
                    False,
                    f"RegisterPlugin error -- plugin registration failed with err: {exc}",
                )
            log.info(
                "plugin registered",
                plugin=info.name,
                type=info.type,
                endpoint=endpoint,
                versions=versions,
                node=self.node,
            )
            self._notify(stub, path, True, "")
            return True
        finally:
            channel.close()

    def _dial(self, channel: grpc.Channel) -> None:
        """Wait up to DIAL_TIMEOUT for the connection, but give up as soon as stop() is called:
        a dial to a dead socket must not keep the thread running after stop() returned."""
        ready = grpc.channel_ready_future(channel)
        deadline = time.monotonic() + DIAL_TIMEOUT
        try:
            while True:
                try:
                    ready.result(timeout=max(0.0, min(STOP_CHECK, deadline - time.monotonic())))
                    return
                except grpc.FutureTimeoutError:
                    if self._stop.is_set() or time.monotonic() >= deadline:
                        raise
        finally:
            ready.cancel()

    def _notify(self, stub: reg_grpc.RegistrationStub, path: Path, ok: bool, error: str) -> bool:
        if not ok:
            log.warning("plugin rejected", socket=str(path), error=error, node=self.node)
        try:
            stub.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=ok, error=error),
                timeout=NOTIFY_TIMEOUT,
            )
        except grpc.RpcError as exc:
            # kubelet keeps a registered plugin registered when only the notification fails
            log.warning("NotifyRegistrationStatus failed", socket=str(path), error=_rpc_text(exc))
        return ok


def _rpc_text(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return f"{code}: {details}"
    return f"{type(exc).__name__}: {exc}"
