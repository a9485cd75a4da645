"""A cgroup per container, as runc makes one: the node agent's containers are processes on this
machine, and tools that act on a container's cgroup (the enforcer's CDI hook and watchdog: memory
partitioning on the cgroup v2 directory, throttling through the v1 freezer) need each container
in cgroups of its own rather than in the agent's.

For every container the runtime makes ``gpuslice-pod<pod uid>-<container id[:12]>`` in each
hierarchy it can write — the v1 ``freezer`` and ``memory`` hierarchies and cgroup v2 (the
unified mount of a hybrid layout, or ``/sys/fs/cgroup``) — below the cgroup the agent itself is
in there (so limits the agent runs under still apply), and moves the container's shim into
them before any hook runs; the command inherits them. When the container ends the shim kills
whatever is left in them (as the kernel does when a container's init exits), moves itself out
and removes them; the runtime removes them too when it finds the shim dead.

Standard library only: the shim imports it. Nothing happens without root or cgroup mounts: the
container then runs in the agent's cgroups, as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

PROC_SELF = Path("/proc/self")
V1_HIERARCHIES = ("freezer", "memory")


def _mounts() -> list[tuple[str, Path, str]]:
    """(hierarchy key, mount point, mount root) of the cgroup hierarchies used: the v1
    hierarchies of ``V1_HIERARCHIES`` and cgroup v2 (key ``""``)."""
    found: list[tuple[str, Path, str]] = []
    try:
        lines = (PROC_SELF / "mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount, root = Path(fields[4].replace("\\040", " ")), fields[3]
        if tail[0] == "cgroup2":
            if all(k != "" for k, _, _ in found):
                found.append(("", mount, root))
        elif tail[0] == "cgroup":
            options = set(tail[2].split(","))
            for name in V1_HIERARCHIES:
                if name in options and all(k != name for k, _, _ in found):
                    found.append((name, mount, root))
    return found


def _own_paths() -> dict[str, str]:
    """This process' cgroup path per hierarchy key (``""`` = v2)."""
    paths: dict[str, str] = {}
    try:
        lines = (PROC_SELF / "cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            paths[""] = path
        for name in controllers.split(","):
            if name in V1_HIERARCHIES:
                paths[name] = path
    return paths


def _join(mount: Path, root: str, path: str) -> Path:
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return mount / path.lstrip("/")


def parents() -> list[Path]:
    """The directories under which container cgroups are made: per hierarchy, the agent's own
    cgroup there. Empty when not root."""
    if os.geteuid() != 0:
        return []
    own = _own_paths()
    found = []
    for key, mount, root in _mounts():
        directory = _join(mount, root, own.get(key, "/"))
        if (directory / "cgroup.procs").exists() and os.access(directory, os.W_OK):
            found.append(directory)
    return found


def create(pod_uid: str, container_id: str) -> tuple[list[Path], list[str]]:
    """Make the container's cgroups; (directories made, one line per hierarchy skipped)."""
    made: list[Path] = []
    skipped: list[str] = []
    for parent in parents():
        directory = parent / f"gpuslice-pod{pod_uid}-{container_id[:12]}"
        try:
            directory.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            skipped.append(f"{directory}: {exc.strerror}")
            continue
        made.append(directory)
    return made, skipped


def enter(directories: list[Path], pid: int) -> None:
    """Move ``pid`` into every directory (before it forks what the container runs)."""
    for directory in directories:
        (directory / "cgroup.procs").write_text(str(pid))


def _pids(directory: Path) -> list[int]:
    try:
        return [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _thaw(directory: Path) -> None:
    with contextlib.suppress(OSError):
        if (directory / "freezer.state").exists():
            (directory / "freezer.state").write_text("THAWED")
        elif (directory / "cgroup.freeze").exists():
            (directory / "cgroup.freeze").write_text("0")


def remove(directories: list[Path], *, timeout: float = 5.0) -> list[Path]:
    """Kill every process left in the directories (thawed first, or SIGKILL would wait for a
    thaw) except the caller, move the caller out, and remove them. Returns those that could
    not be removed (normally none)."""
    me = os.getpid()
    left: list[Path] = []
    for directory in directories:
        if not directory.exists():
            continue
        _thaw(directory)
        deadline = time.monotonic() + timeout
        while True:
            pids = _pids(directory)
            if me in pids:
                with contextlib.suppress(OSError):
                    (directory.parent / "cgroup.procs").write_text(str(me))
            for pid in pids:
                if pid != me:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    left.append(directory)
                    break
                time.sleep(0.02)
    return left
