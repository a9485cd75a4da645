"""Where the configuration comes from, and the live reload when it changes.

NVIDIA's plugin restarts its servers on SIGHUP, which its config-manager sidecar sends after
the node label ``nvidia.com/device-plugin.config`` or the ConfigMap changed. This plugin
watches both itself, and SIGHUP still works as a manual reload:

- the own Node through a watch (``gpuslice_kube.reflector``, field selector
  ``metadata.name=<node>``; only with ``--config-dir``, where the label picks the config): a
  change of the ``--config-label`` value asks for a reload at once;
- the config file or directory (a ConfigMap volume, which the kubelet updates by swapping a
  symlink) polled every ``--config-poll-interval``: a digest of the names and contents, so a
  touched but equal file is no change;
- ``SIGHUP``.

The main loop (:class:`Control`) runs the reloads one at a time. A reload re-reads and
validates everything before it touches anything; a config that does not decode or does not
fit the node is refused (log line, Warning Event ``DevicePluginConfigRefused`` naming the key)
and the running config keeps serving. The same inputs are not tried again until they change.
"""

from __future__ import annotations

import hashlib
import queue
import signal
import threading
from pathlib import Path
from types import FrameType

from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.config import (
    CommandLine,
    ConfigError,
    ConfigFile,
    Settings,
    load_config_file,
    resolve,
    select_config,
)
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kube.reflector import Reflector

log = get_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


def _config(args: CommandLine, labels: dict[str, str] | None) -> tuple[ConfigFile | None, str]:
    """The config file this node uses and its name ("" for --config-file or none)."""
    if args.config_file and args.config_dir:
        raise ConfigError("--config-file and --config-dir: give one of them, not both")
    if not args.config_dir:
        return (load_config_file(args.config_file) if args.config_file else None), ""
    assert labels is not None  # the Node is read whenever --config-dir is given
    selected = select_config(
        args.config_dir,
        label=args.config_label,
        label_value=labels.get(args.config_label),
        default=args.default_config,
    )
    for problem in selected.broken:
        log.warning("a config of another node does not decode", error=problem)
    log.info("config selected", config=selected.name, why=selected.why)
    return selected.config, selected.name


def load_settings(args: CommandLine, labels: dict[str, str] | None) -> Settings:
    """Read, select and decode the config and merge it with the flags; ``ConfigError`` names
    the key or the file that is wrong."""
    file, name = _config(args, labels)
    settings = resolve(args, file, config_name=name)
    if settings.mps.resources and not args.enforcer_socket:
        raise ConfigError(
            "sharing.mps needs the gpuslice enforcer, which holds the replicas' limits:"
            " set --enforcer-socket (GPUSLICE_ENFORCER_SOCKET)"
        )
    return settings


def fingerprint(args: CommandLine, label_value: str | None) -> str:
    """A digest of everything the config is made of: the label value and the files' names and
    contents (an unreadable file counts by its error)."""
    h = hashlib.sha256(repr(label_value).encode())
    paths: list[Path] = []
    if args.config_file:
        paths = [Path(args.config_file)]
    elif args.config_dir:
        directory = Path(args.config_dir)
        try:
            paths = sorted(p for p in directory.iterdir() if not p.name.startswith("."))
        except OSError as exc:
            h.update(f"\0{exc}".encode())
    for path in paths:
        h.update(f"\0{path.name}\0".encode())
        try:
            h.update(path.read_bytes())
        except OSError as exc:  # a directory, a vanished file: part of the state
            h.update(f"\0{type(exc).__name__}".encode())
    return h.hexdigest()


class Control:
    """What the main thread waits for: a stop signal or reload requests. Signal handlers only
    put into a ``SimpleQueue`` (reentrant, safe in a handler); watchers do the same."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, str | int]] = queue.SimpleQueue()

    def install_signals(self) -> None:
        def stop(signum: int, _frame: FrameType | None) -> None:
            self._queue.put(("stop", signum))

        def hup(_signum: int, _frame: FrameType | None) -> None:
            self._queue.put(("reload", "SIGHUP"))

        for s in STOP_SIGNALS:
            signal.signal(s, stop)
        signal.signal(signal.SIGHUP, hup)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        self._queue.put(("stop", signum))

    def reload(self, reason: str) -> None:
        self._queue.put(("reload", reason))

    def next(self, poll: float = 0.5) -> tuple[int | None, list[str]]:
        """Block until a stop (its signal number) or reloads (their reasons, coalesced).
        The short ``poll`` lets the main thread run signal handlers."""
        while True:
            try:
                kind, value = self._queue.get(timeout=poll)
            except queue.Empty:
                continue
            reasons: list[str] = []
            while True:
                if kind == "stop":
                    assert isinstance(value, int)
                    return value, reasons
                reasons.append(str(value))
                try:
                    kind, value = self._queue.get_nowait()
                except queue.Empty:
                    return None, reasons

    def wait_for_stop(self) -> int:
        while True:
            signum, _ = self.next()
            if signum is not None:
                return signum


class Watchers:
    """The label watch and the file poll; both ask ``control`` for a reload on a change."""

    def __init__(
        self,
        args: CommandLine,
        control: Control,
        raw_api: RawApi | None,
        labels: dict[str, str] | None,
        *,
        poll_interval: float,
    ) -> None:
        self.args = args
        self.control = control
        self.poll_interval = poll_interval
        self._lock = threading.Lock()
        self.labels = dict(labels or {})
        self.seen = fingerprint(args, self.label_value)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reflector: Reflector | None = None
        if args.config_dir and raw_api is not None:
            self.reflector = Reflector(
                raw_api,
                resource_path("v1", "nodes"),
                self._on_node,
                field_selector=f"metadata.name={args.node_name}",
            )

    @property
    def label_value(self) -> str | None:
        return self.labels.get(self.args.config_label)

    def start(self) -> None:
        if self.reflector is not None:
            self.reflector.start()
        if self.poll_interval > 0 and (self.args.config_file or self.args.config_dir):
            t = threading.Thread(target=self._poll, name="config-poll", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        if self.reflector is not None:
            self.reflector.stop()
        for t in self._threads:
            t.join(timeout=5)

    def _on_node(self, event_type: str, obj: Obj) -> None:
        if event_type == "DELETED":
            return
        labels = dict((obj.get("metadata") or {}).get("labels") or {})
        with self._lock:
            before, self.labels = self.label_value, labels
            after = self.label_value
        if after != before:
            log.info("config label changed", label=self.args.config_label, was=before, now=after)
            self.control.reload(f"node label {self.args.config_label}={after}")

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_interval):
            with self._lock:
                label = self.label_value
            if fingerprint(self.args, label) != self.seen:
                self.control.reload("config file content changed")

    def snapshot(self) -> tuple[dict[str, str], str]:
        """The labels to select by now and the digest of the inputs as of now."""
        with self._lock:
            labels = dict(self.labels)
        return labels, fingerprint(self.args, labels.get(self.args.config_label))

    def handled(self, digest: str) -> None:
        """The inputs of ``digest`` were tried (applied or refused): poll for the next change."""
        self.seen = digest
