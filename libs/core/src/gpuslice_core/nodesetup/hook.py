"""The enforcer's CDI createContainer hook on the host (docs/enforcer.md, "The CDI hook").

The runtime runs the hook on the host, outside any container; it is one static binary (Go, no
libc), copied from the enforcer image, so nothing of the image's Python reaches the host and the
host's libc does not matter. It is replaced atomically (a hook that is running finishes with the
file it started from) and then run once (``--help``) from where it lies, so a directory the
runtime cannot execute from fails here, not at every container start. The copy of the image's
Python that earlier charts installed under ``releases/`` is removed (the one the replaced wrapper
named after a grace of ten minutes).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from gpuslice_core.files import atomic_write_bytes
from gpuslice_core.nodesetup.report import SetupError, log

HOOK_NAME = "gpuslice-enforcer-hook"
#: Where the enforcer image holds the static hook (services/enforcer/Dockerfile).
HOOK_BINARY = Path("/usr/local/bin/gpuslice-enforcer-hook")
#: How long the Python release of an earlier chart outlives the switch to the static hook.
PYTHON_RELEASE_GRACE_S = 600


def install_hook(install_dir: Path, host_dir: str, source: Path) -> None:
    """``<install_dir>/bin/gpuslice-enforcer-hook`` becomes the image's static hook ``source``,
    replaced atomically (rename): a hook that is running keeps the file it started from (the
    kernel keeps the old inode while it runs), the next one starts the new file. The same bytes
    are left alone. Then the releases of earlier charts go and the hook is run once."""
    data = source.read_bytes()
    if data[:4] != b"\x7fELF":
        raise SetupError(
            f"{source} is not the static hook binary; the hook is installed from the enforcer image"
        )
    digest = hashlib.sha256(data).hexdigest()[:16]
    installed = install_dir / "bin" / HOOK_NAME
    host_path = f"{host_dir.rstrip('/')}/bin/{HOOK_NAME}"
    replaced = None
    try:
        current: bytes | None = installed.read_bytes()
    except OSError:
        current = None
    if current == data and os.access(installed, os.X_OK):
        log(f"{host_path} is the static hook {digest} already")
    else:
        replaced = python_release(installed)
        installed.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(installed, data, mode=0o755)
        log(f"{host_path} is now the static hook {digest} ({len(data)} bytes, from {source})")
    prune_python_releases(install_dir, replaced)
    check_runs(installed, host_path)


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
        atomic_write_bytes(marker, f"{replaced}\n".encode(), mode=0o644)
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
        raise SetupError(
            f"{host_path} cannot be run ({exc.strerror}): is its file system mounted noexec? "
            "Set enforcer.hook.hostDir to a directory that the container runtime may execute "
            "programs from"
        ) from None
    if ran.returncode != 0 or not ran.stdout.startswith(f"usage: {HOOK_NAME} "):
        raise SetupError(
            f"{host_path} --help exited {ran.returncode}: {(ran.stdout + ran.stderr).strip()[:500]}"
        )
