"""What the fake reads about real OS processes: liveness, cgroups, freezing and runnable time.

A fake GPU process registered as *real* is backed by a live process of the machine, the way a
CUDA context is backed by its process. The fake then behaves like the driver towards it:

* it vanishes from NVML's view when the process exits (or the pid is reused);
* its memory counts against the driver memory-partitioning limits of its cgroup v2 directory;
* its SM use accrues only while it can run: a process frozen by the cgroup freezer (v1
  ``freezer.state`` or v2 ``cgroup.freeze``) submits no work.

Runnable time comes from the kernel's own accounting, ``/proc/<pid>/schedstat`` (time on a CPU +
time waiting for one): for a process that never sleeps it is exactly the wall time it was not
frozen, whatever the CPU contention. Everything here returns ``None`` / ``False`` for a pid that
is gone, so callers treat "unknown" as "not there".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

PROC = Path("/proc")


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22);
    ``None`` if it does not exist or is a zombie."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(pid: int, started: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` (and not a zombie)."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def runnable_ns(pid: int) -> int | None:
    """Nanoseconds the process ran or waited to run (``/proc/<pid>/schedstat`` fields 1 + 2)."""
    try:
        run, wait, *_ = (PROC / str(pid) / "schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(run) + int(wait)


@dataclass(frozen=True)
class Mount:
    """A cgroup hierarchy mount: where it is and which v1 controllers (empty for v2) it has."""

    path: Path
    root: str
    version: int
    controllers: frozenset[str] = field(default_factory=frozenset)


@lru_cache(maxsize=1)
def cgroup_mounts() -> tuple[Mount, ...]:
    """Every cgroup and cgroup2 mount of this mount namespace (``/proc/self/mountinfo``)."""
    mounts: list[Mount] = []
    try:
        lines = (PROC / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return ()
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], set(tail[2].split(","))
        root, mount_point = fields[3], Path(fields[4].replace("\\040", " "))
        if fstype == "cgroup2":
            mounts.append(Mount(mount_point, root, 2))
        elif fstype == "cgroup":
            known = {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids"}
            names = {o for o in options if o in known or o.startswith("name=")}
            mounts.append(Mount(mount_point, root, 1, frozenset(names)))
    return tuple(mounts)


def _join(mount: Mount, path: str) -> Path:
    relative = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root + "/")):
        relative = path[len(mount.root) :]
    return mount.path / relative.lstrip("/")


@dataclass(frozen=True)
class ProcessCgroups:
    """The cgroup directories of a process: its v2 directory and its v1 freezer directory."""

    v2: Path | None = None
    freezer: Path | None = None


def cgroups_of(pid: int) -> ProcessCgroups | None:
    """The sysfs directories of the cgroups ``pid`` is in; ``None`` if it does not exist."""
    try:
        lines = (PROC / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    v2: Path | None = None
    freezer: Path | None = None
    mounts = cgroup_mounts()
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            mount = next((m for m in mounts if m.version == 2), None)
            if mount is not None:
                v2 = _join(mount, path)
        elif "freezer" in controllers.split(","):
            mount = next((m for m in mounts if "freezer" in m.controllers), None)
            if mount is not None:
                freezer = _join(mount, path)
    return ProcessCgroups(v2=v2, freezer=freezer)


def is_cgroup2_dir(path: Path) -> bool:
    """Whether ``path`` is a directory of a mounted cgroup v2 hierarchy."""
    if not (path / "cgroup.procs").is_file():
        return False
    resolved = path.resolve()
    return any(
        m.version == 2 and (resolved == m.path or m.path in resolved.parents)
        for m in cgroup_mounts()
    )


def frozen(pid: int) -> bool:
    """Whether the process is frozen by the cgroup freezer now (v1 or v2, itself or a parent)."""
    groups = cgroups_of(pid)
    if groups is None:
        return False
    if groups.freezer is not None:
        try:
            state = (groups.freezer / "freezer.state").read_text().strip()
        except OSError:
            state = "THAWED"
        if state in ("FROZEN", "FREEZING"):
            return True
    if groups.v2 is not None:
        try:
            events = (groups.v2 / "cgroup.events").read_text().split("\n")
        except OSError:
            return False
        return "frozen 1" in events
    return False


def within(child: Path, parent: Path) -> bool:
    """Whether cgroup directory ``child`` is ``parent`` or below it."""
    child, parent = Path(os.path.normpath(child)), Path(os.path.normpath(parent))
    return child == parent or parent in child.parents
