"""gpuslice node setup: the init container of the gpuslice node DaemonSet (Helm chart).

Runs with the Python of one of the gpuslice images (stdlib only) before the services start, and
does what the environment asks for, each step idempotent:

1. SOCKET_DIR: removes the per-pod sockets (``enforcer-<podUID>.sock``,
   ``mig-manager-<podUID>.sock``) that no process listens on any more -- left behind by pods
   that were killed without a graceful stop. A socket with a listener is never touched.
2. FAKE_NVML_CONFIG_SRC -> FAKE_NVML_CONFIG: writes the fake NVML node config for this node
   (the ConfigMap's YAML, plus ``name: <NODE_NAME>`` when FAKE_NVML_SET_NAME is true, so every
   fake node gets its own GPU UUIDs), atomically.
3. HOOK_INSTALL_DIR (the host directory as mounted here) and HOOK_HOST_DIR (the same directory
   as the host sees it): installs ``bin/gpuslice-enforcer-hook`` for the CDI createContainer
   hook (docs/enforcer.md). The runtime runs the hook on the host, outside any container; it is
   one static binary (Go, no libc), copied from the enforcer image (HOOK_BINARY, default
   ``/usr/local/bin/gpuslice-enforcer-hook``), so nothing of the image's Python reaches the
   host and the host's libc does not matter. It is replaced atomically (a hook that is running
   finishes with the file it started from) and then run once (``--help``) from where it lies,
   so a directory the runtime cannot execute from fails here, not at every container start.
   The copy of the image's Python that earlier charts installed under ``releases/`` is removed
   (the one the replaced wrapper named after a grace of ten minutes).

With the arguments ``hook-socket claim`` (the enforcer container's postStart) it points the
stable link ENFORCER_HOOK_SOCKET (``enforcer.sock``, the path the CDI hook calls) at this pod's
enforcer socket ENFORCER_SOCKET (``enforcer-<podUID>.sock``), atomically: in a rolling update
the newest enforcer takes over the hook. ``hook-socket release`` (its preStop) hands the link to
another enforcer socket that has a listener, if the link still points at this pod's.

Exit status 0 when every asked-for step succeeded; 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

# per-pod sockets, and the enforcer's attach socket beside its gRPC one (``….sock.attach``)
SOCKET_PATTERN = re.compile(r"^(enforcer|mig-manager)-[0-9a-f-]{36}\.sock(\.attach)?$")
HOOK_NAME = "gpuslice-enforcer-hook"
#: Where the enforcer image holds the static hook (services/enforcer/Dockerfile).
HOOK_BINARY = "/usr/local/bin/gpuslice-enforcer-hook"
#: How long the Python release of an earlier chart outlives the switch to the static hook.
PYTHON_RELEASE_GRACE_S = 600


def log(message: str) -> None:
    print(f"node-setup: {message}", file=sys.stderr, flush=True)


def write_atomic(path: Path, content: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = content.encode() if isinstance(content, str) else content
    with tmp.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    tmp.chmod(mode)
    tmp.replace(path)


# ---- 1. dead per-pod sockets -------------------------------------------------------------------
def listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    return True


def sweep_sockets(directory: Path) -> None:
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        if SOCKET_PATTERN.match(path.name) and path.is_socket() and not listening(path):
            path.unlink(missing_ok=True)
            log(f"removed {path}: nothing listens on it")


# ---- 2. the fake NVML config -------------------------------------------------------------------
def write_fake_config(src: Path, dst: Path, node_name: str, set_name: bool) -> None:
    text = src.read_text()
    if set_name:
        if not node_name:
            raise SystemExit("node-setup: FAKE_NVML_SET_NAME needs NODE_NAME")
        text = text.rstrip("\n") + f"\nname: {json.dumps(node_name)}\n"
    write_atomic(dst, text)
    log(f"fake NVML config for node {node_name or '?'} written to {dst}")


# ---- 3. the enforcer's CDI hook ----------------------------------------------------------------
def python_release(installed: Path) -> str | None:
    """The Python release an earlier chart's wrapper at ``installed`` runs, if it is one."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        match = re.search(r"^R='.*/releases/([0-9a-f]+)'$", installed.read_text(), re.MULTILINE)
        if match:
            return match.group(1)
    return None


def prune_python_releases(install_dir: Path, replaced: str | None) -> None:
    """Earlier charts installed a copy of the image's Python under ``releases/``. The release
    whose wrapper was just replaced is kept for ``PYTHON_RELEASE_GRACE_S`` (a hook started
    before the switch finishes with its files); every other one goes, and that one at the
    first install after the grace."""
    releases, marker = install_dir / "releases", install_dir / "bin" / ".previous-release"
    if replaced is not None:
        write_atomic(marker, replaced + "\n")
    keep = None
    if marker.is_file():
        if time.time() - marker.stat().st_mtime < PYTHON_RELEASE_GRACE_S:
            keep = marker.read_text().strip()
        else:
            marker.unlink()
    if not releases.is_dir():
        return
    for old in sorted(releases.iterdir()):
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)
            log(f"removed the Python hook release {old.name} of an earlier chart")
    if keep is None:
        with contextlib.suppress(OSError):
            releases.rmdir()


def check_runs(installed: Path, host_path: str) -> None:
    """Run the installed hook (``--help``) from where it lies: a directory the runtime cannot
    execute from (a ``noexec`` file system) would fail every container with a share."""
    try:
        ran = subprocess.run(
            [str(installed), "--help"], env={}, capture_output=True, text=True, timeout=30
        )
    except OSError as exc:
        raise SystemExit(
            f"node-setup: {host_path} cannot be run ({exc.strerror}): is its file system "
            "mounted noexec? Set enforcer.hook.hostDir to a directory that the container "
            "runtime may execute programs from"
        ) from None
    if ran.returncode != 0 or not ran.stdout.startswith(f"usage: {HOOK_NAME} "):
        raise SystemExit(
            f"node-setup: {host_path} --help exited {ran.returncode}: "
            f"{(ran.stdout + ran.stderr).strip()[:500]}"
        )


def install_hook(install_dir: Path, host_dir: str, source: Path) -> None:
    """``<install_dir>/bin/gpuslice-enforcer-hook`` becomes the image's static hook, replaced
    atomically (rename): a hook that is running keeps the file it started from (the kernel
    keeps the old inode while it runs), the next one starts the new file."""
    data = source.read_bytes()
    if data[:4] != b"\x7fELF":
        raise SystemExit(
            f"node-setup: {source} is not the static hook binary; the hook is installed from "
            "the enforcer image"
        )
    digest = hashlib.sha256(data).hexdigest()[:16]
    installed = install_dir / "bin" / HOOK_NAME
    host_path = f"{host_dir.rstrip('/')}/bin/{HOOK_NAME}"
    replaced = None
    try:
        current = installed.read_bytes()
    except OSError:
        current = None
    if current == data and os.access(installed, os.X_OK):
        log(f"{host_path} is the static hook {digest} already")
    else:
        replaced = python_release(installed)
        write_atomic(installed, data, mode=0o755)
        log(f"{host_path} is now the static hook {digest} ({len(data)} bytes, from {source})")
    prune_python_releases(install_dir, replaced)
    check_runs(installed, host_path)


# ---- the enforcer's stable hook socket --------------------------------------------------------
def point_link(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name if target.parent == link.parent else target)
    tmp.replace(link)


def hook_socket(action: str, own: Path, link: Path) -> None:
    if action == "claim":
        point_link(link, own)
        log(f"{link} -> {own.name}")
        return
    current = link.readlink() if link.is_symlink() else None
    if current is None or (link.parent / current) != own:
        return
    for other in sorted(own.parent.glob("enforcer-*.sock")):
        if other != own and SOCKET_PATTERN.match(other.name) and listening(other):
            point_link(link, other)
            log(f"{link} handed over to {other.name}")
            return


def main(argv: list[str]) -> int:
    env = os.environ
    if argv[:1] == ["hook-socket"]:
        if len(argv) != 2 or argv[1] not in ("claim", "release"):
            log("usage: node-setup.py hook-socket claim|release")
            return 2
        try:
            hook_socket(argv[1], Path(env["ENFORCER_SOCKET"]), Path(env["ENFORCER_HOOK_SOCKET"]))
        except (OSError, KeyError) as exc:
            log(f"hook-socket {argv[1]} failed: {exc!r}")
            return 1
        return 0
    try:
        if env.get("SOCKET_DIR"):
            sweep_sockets(Path(env["SOCKET_DIR"]))
        if env.get("FAKE_NVML_CONFIG_SRC"):
            write_fake_config(
                Path(env["FAKE_NVML_CONFIG_SRC"]),
                Path(env["FAKE_NVML_CONFIG"]),
                env.get("NODE_NAME", ""),
                env.get("FAKE_NVML_SET_NAME", "").lower() == "true",
            )
        if env.get("HOOK_INSTALL_DIR"):
            source = Path(env.get("HOOK_BINARY") or HOOK_BINARY)
            install_hook(Path(env["HOOK_INSTALL_DIR"]), env["HOOK_HOST_DIR"], source)
    except OSError as exc:
        log(f"failed: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
