"""Exec credential plugins (``users[].user.exec``), run as kubectl runs them.

The command runs with its ``args``, the kubeconfig's ``env`` on top of the plugin's own, and
``KUBERNETES_EXEC_INFO`` set to an ``ExecCredential`` of the entry's ``apiVersion``
(``client.authentication.k8s.io/v1`` or ``v1beta1``) whose ``spec.interactive`` says whether
stdin is a terminal the command may prompt on (``interactiveMode``: ``Never``, ``IfAvailable``,
``Always``; v1 requires it, v1beta1 defaults to ``IfAvailable``), and, with
``provideClusterInfo``, the cluster. It prints an ``ExecCredential`` whose ``status`` holds a
``token`` or a ``clientCertificateData`` and ``clientKeyData`` pair; an
``expirationTimestamp`` makes the next request after it run the command again. A command that
fails is an error that names the user entry, the command and what it wrote on stderr.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpuslice_core.errors import FailedPreconditionError

API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
MODES = ("Never", "IfAvailable", "Always")
TIMEOUT = 120.0
"""Seconds a command may take (a browser login included) before it counts as failed."""


@dataclass(frozen=True)
class ExecPlugin:
    """A user entry's ``exec``, as given (``where`` names it in messages)."""

    where: str
    api_version: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    interactive_mode: str = "IfAvailable"
    provide_cluster_info: bool = False
    install_hint: str = ""


@dataclass(frozen=True)
class ExecCredential:
    """What a run printed: a token or a client certificate and key (PEM), and until when."""

    token: str | None = None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    expires: float | None = None
    """Seconds since the epoch; None: valid for as long as the plugin runs."""


def _bad(where: str, message: str) -> FailedPreconditionError:
    return FailedPreconditionError(f"kubeconfig {where}: {message}")


def parse_exec(body: Mapping[str, Any], where: str, path: Path) -> ExecPlugin:
    """A user entry's ``exec`` mapping; ``where`` names it (file and entry)."""
    version = body.get("apiVersion")
    if version not in API_VERSIONS:
        raise _bad(
            f"{where}.apiVersion",
            f"unsupported {json.dumps(version)}; allowed: {', '.join(API_VERSIONS)}",
        )
    command = body.get("command")
    if not isinstance(command, str) or not command:
        raise _bad(f"{where}.command", "is missing")
    if "/" in command and not Path(command).is_absolute():
        command = str(path.parent / command)  # relative to the kubeconfig, as kubectl does
    args = body.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise _bad(f"{where}.args", "is not a list of strings")
    env = []
    for i, item in enumerate(body.get("env") or []):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _bad(f"{where}.env[{i}]", "has no name")
        env.append((item["name"], str(item.get("value") or "")))
    default = "IfAvailable" if version.endswith("v1beta1") else None
    mode = body.get("interactiveMode") or default
    if mode not in MODES:
        said = "is required for v1" if mode is None else f"is {json.dumps(mode)}"
        raise _bad(f"{where}.interactiveMode", f"{said}; allowed: {', '.join(MODES)}")
    provide = body.get("provideClusterInfo", False)
    if not isinstance(provide, bool):
        raise _bad(f"{where}.provideClusterInfo", f"is {provide!r}, not true or false")
    return ExecPlugin(
        where=where,
        api_version=version,
        command=command,
        args=tuple(args),
        env=tuple(env),
        interactive_mode=mode,
        provide_cluster_info=provide,
        install_hint=str(body.get("installHint") or ""),
    )


def _stdin_is_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (OSError, ValueError, AttributeError):  # closed or replaced stdin
        return False


def _timestamp(value: str, where: str) -> float:
    """RFC 3339 (``2026-01-02T03:04:05Z``, fractions and offsets too) in epoch seconds."""
    text = re.sub(r"(\.\d{6})\d+", r"\1", value.strip()).replace("Z", "+00:00")
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError as exc:
        raise _bad(where, f"{value!r} is not an RFC 3339 time") from exc
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)  # noqa: UP017 - datetime.UTC is 3.11+
    return stamp.timestamp()


class ExecRunner:
    """Runs a plugin when there is no credential yet or the last one has expired."""

    def __init__(
        self,
        plugin: ExecPlugin,
        cluster_info: Mapping[str, Any],
        *,
        clock: Callable[[], float] = time.time,
        terminal: Callable[[], bool] = _stdin_is_terminal,
    ) -> None:
        self.plugin = plugin
        self.cluster_info = dict(cluster_info)
        self.clock = clock
        self.terminal = terminal
        self._held: ExecCredential | None = None

    def credential(self) -> ExecCredential:
        held = self._held
        if held is None or (held.expires is not None and held.expires <= self.clock()):
            held = self._held = self._run()
        return held

    def _run(self) -> ExecCredential:
        plugin = self.plugin
        terminal = self.terminal()
        if plugin.interactive_mode == "Always" and not terminal:
            raise _bad(
                f"{plugin.where}.interactiveMode",
                f"is Always, and stdin is not a terminal to run {plugin.command} on",
            )
        interactive = terminal and plugin.interactive_mode != "Never"
        spec: dict[str, Any] = {"interactive": interactive}
        if plugin.provide_cluster_info:
            spec["cluster"] = self.cluster_info
        info = {"apiVersion": plugin.api_version, "kind": "ExecCredential", "spec": spec}
        env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": json.dumps(info)}
        shown = " ".join([plugin.command, *plugin.args])
        try:
            done = subprocess.run(  # the command the kubeconfig names, as kubectl runs it
                [plugin.command, *plugin.args],
                env=env,
                stdin=None if interactive else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=None if interactive else subprocess.PIPE,
                timeout=TIMEOUT,
                check=False,
            )
        except FileNotFoundError as exc:
            hint = f"; {plugin.install_hint.strip()}" if plugin.install_hint else ""
            raise _bad(
                plugin.where, f"the exec plugin {plugin.command!r} is not found{hint}"
            ) from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _bad(plugin.where, f"the exec plugin {shown!r} did not run: {exc}") from exc
        stderr = (done.stderr or b"").decode(errors="replace").strip()
        if done.returncode != 0:
            said = f": {stderr[-2000:]}" if stderr else " (nothing on stderr)"
            if interactive:
                said = " (its messages went to the terminal)"
            raise _bad(
                plugin.where,
                f"the exec plugin {shown!r} failed with exit status {done.returncode}{said}",
            )
        if stderr:  # warnings and notes of the plugin, as kubectl passes them on
            print(stderr, file=sys.stderr)
        return self._parse(done.stdout, shown)

    def _parse(self, out: bytes, shown: str) -> ExecCredential:
        where = f"{self.plugin.where} (the output of {shown!r})"
        try:
            data = json.loads(out)
        except ValueError as exc:
            raise _bad(where, f"is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise _bad(where, "is not an ExecCredential object")
        if (
            data.get("apiVersion") != self.plugin.api_version
            or data.get("kind") != "ExecCredential"
        ):
            raise _bad(
                where,
                f"is {data.get('apiVersion')}/{data.get('kind')}, not "
                f"{self.plugin.api_version}/ExecCredential",
            )
        status = data.get("status")
        if not isinstance(status, dict):
            raise _bad(f"{where}.status", "is missing")
        token = status.get("token") or None
        cert = status.get("clientCertificateData") or None
        key = status.get("clientKeyData") or None
        if bool(cert) != bool(key):
            raise _bad(f"{where}.status", "has one of clientCertificateData and clientKeyData")
        if not token and not cert:
            raise _bad(f"{where}.status", "has neither a token nor clientCertificateData")
        expiry = status.get("expirationTimestamp")
        return ExecCredential(
            token=str(token) if token else None,
            cert_pem=str(cert).encode() if cert else None,
            key_pem=str(key).encode() if key else None,
            expires=_timestamp(str(expiry), f"{where}.status.expirationTimestamp")
            if expiry
            else None,
        )
