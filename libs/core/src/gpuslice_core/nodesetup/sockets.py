"""The node pod's unix sockets: dead per-pod sockets swept at start, and the enforcer's stable
hook socket link handed from pod to pod in a rolling update."""

from __future__ import annotations

import errno
import os
import re
import socket
from pathlib import Path

from gpuslice_core.nodesetup.report import log

#: Per-pod sockets, and the enforcer's attach socket beside its gRPC one (``….sock.attach``).
SOCKET_PATTERN = re.compile(r"^(enforcer|mig-manager)-[0-9a-f-]{36}\.sock(\.attach)?$")


def listening(path: Path) -> bool:
    """Whether a process accepts connections on the socket ``path`` (a refused or missing
    socket is dead; any other error is taken as alive, so a socket is never removed on doubt)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    return True


def sweep_sockets(directory: Path) -> None:
    """Remove the per-pod sockets in ``directory`` that nothing listens on."""
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        if SOCKET_PATTERN.match(path.name) and path.is_socket() and not listening(path):
            path.unlink(missing_ok=True)
            log(f"removed {path}: nothing listens on it")


def claim_hook_socket(own: Path, link: Path) -> None:
    """Point ``link`` at this pod's enforcer socket ``own``: the newest enforcer takes over."""
    point_link(link, own)
    log(f"{link} -> {own.name}")


def release_hook_socket(own: Path, link: Path) -> None:
    """If ``link`` points at ``own``, hand it to another enforcer socket with a listener."""
    current = link.readlink() if link.is_symlink() else None
    if current is None or (link.parent / current) != own:
        return
    for other in sorted(own.parent.glob("enforcer-*.sock")):
        if other != own and SOCKET_PATTERN.match(other.name) and listening(other):
            point_link(link, other)
            log(f"{link} handed over to {other.name}")
            return


def point_link(link: Path, target: Path) -> None:
    """Replace ``link`` by a symlink to ``target`` atomically (relative within one directory)."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name if target.parent == link.parent else target)
    tmp.replace(link)
