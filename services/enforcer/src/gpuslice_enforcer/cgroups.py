"""Cgroups seen from the enforcer: which cgroups a process is in, and freezing them.

The enforcer runs in the host PID namespace with the host's cgroup hierarchies mounted (the chart
mounts ``/sys/fs/cgroup``), so ``/proc/<pid>/cgroup`` of any workload process names directories
it can reach. Both layouts are handled:

* cgroup v2 (unified): one directory per process; freezing writes ``cgroup.freeze``
  (``1``/``0``), and ``cgroup.events`` says ``frozen 1`` once every task stopped. Driver memory
  partitioning needs this directory (NVML's ``nameSpace``).
* cgroup v1: a directory per hierarchy; freezing writes ``freezer.state``
  (``FROZEN``/``THAWED``) in the freezer hierarchy.

A root cgroup, and any cgroup that holds the enforcer itself, is never frozen. Cgroup lines a
client sends (the CDI hook's) are checked before they are used (:meth:`CgroupView.resolve`): a
path is absolute and has no ``.`` or ``..`` component, and its directory exists below its
hierarchy's mount once links are followed — nothing the enforcer freezes or partitions lies
outside the cgroup root.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuslice_core.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

PROC = Path("/proc")


@dataclass(frozen=True)
class Mount:
    """A mounted cgroup hierarchy (``version`` 1 with its controllers, or 2)."""

    path: Path
    root: str
    version: int
    controllers: frozenset[str] = field(default_factory=frozenset)


_V1_CONTROLLERS = {"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids"}


def read_mounts(mountinfo: Path = PROC / "self" / "mountinfo") -> tuple[Mount, ...]:
    """The cgroup and cgroup2 mounts listed in ``mountinfo``."""
    mounts: list[Mount] = []
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return ()
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point = fields[3], Path(fields[4].replace("\\040", " "))
        if tail[0] == "cgroup2":
            mounts.append(Mount(mount_point, root, 2))
        elif tail[0] == "cgroup":
            options = set(tail[2].split(","))
            names = {o for o in options if o in _V1_CONTROLLERS or o.startswith("name=")}
            mounts.append(Mount(mount_point, root, 1, frozenset(names)))
    return tuple(mounts)


@dataclass(frozen=True)
class ProcessCgroups:
    """A process's cgroups: the raw paths from ``/proc/<pid>/cgroup`` and the directories."""

    #: The v2 path (``0::/…``), or None when the process has no v2 line.
    v2_path: str | None = None
    #: The v1 freezer hierarchy path, or None.
    freezer_path: str | None = None
    #: Sysfs directories (None when the hierarchy is not mounted here).
    v2_dir: Path | None = None
    freezer_dir: Path | None = None

    def paths(self) -> list[str]:
        """The cgroup paths (for matching pod UIDs in them)."""
        return [p for p in (self.v2_path, self.freezer_path) if p]


def _join(mount: Mount, path: str) -> Path:
    relative = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root + "/")):
        relative = path[len(mount.root) :]
    return mount.path / relative.lstrip("/")


class CgroupView:
    """The node's cgroup hierarchies, and the cgroups of its processes."""

    def __init__(self, mounts: tuple[Mount, ...] | None = None, proc: Path = PROC) -> None:
        self.mounts = read_mounts() if mounts is None else mounts
        self.proc = proc
        self.v2 = next((m for m in self.mounts if m.version == 2), None)
        self.freezer = next((m for m in self.mounts if "freezer" in m.controllers), None)
        own = self.of_pid(os.getpid()) if proc == PROC else None
        self._own = own or ProcessCgroups()

    @property
    def v2_root(self) -> Path | None:
        """The cgroup v2 mount (where memory partitioning namespaces live)."""
        return self.v2.path if self.v2 else None

    def parse(self, lines: list[str]) -> ProcessCgroups:
        v2_path = freezer_path = None
        for line in lines:
            hierarchy, _, rest = line.strip().partition(":")
            controllers, _, path = rest.partition(":")
            if hierarchy == "0" and controllers == "":
                v2_path = path
            elif "freezer" in controllers.split(","):
                freezer_path = path
        return ProcessCgroups(
            v2_path=v2_path,
            freezer_path=freezer_path,
            v2_dir=_join(self.v2, v2_path) if self.v2 and v2_path is not None else None,
            freezer_dir=(
                _join(self.freezer, freezer_path)
                if self.freezer and freezer_path is not None
                else None
            ),
        )

    def of_pid(self, pid: int) -> ProcessCgroups | None:
        """The cgroups of ``pid``; None if the process does not exist (any more)."""
        try:
            lines = (self.proc / str(pid) / "cgroup").read_text().splitlines()
        except OSError:
            return None
        return self.parse(lines)

    def resolve(self, groups: ProcessCgroups) -> ProcessCgroups:
        """``groups`` with each directory resolved and required to exist below its hierarchy's
        mount: a path with ``.``/``..`` or one that leads elsewhere is INVALID_ARGUMENT (a
        freeze would write where it leads), a missing directory NOT_FOUND (the container is
        gone)."""
        for path in (groups.v2_path, groups.freezer_path):
            if path is not None and (
                not path.startswith("/") or "\0" in path or {".", ".."} & set(path.split("/"))
            ):
                raise InvalidArgumentError(
                    f"cgroup_lines: {path!r} is not a cgroup path (absolute, no . or ..)"
                )
        return replace(
            groups,
            v2_dir=_existing(self.v2, groups.v2_dir),
            freezer_dir=_existing(self.freezer, groups.freezer_dir),
        )

    def require_of_pid(self, pid: int) -> ProcessCgroups:
        groups = self.of_pid(pid)
        if groups is None:
            raise NotFoundError(f"no process {pid}: cannot read /proc/{pid}/cgroup")
        return groups

    # -- freezing -------------------------------------------------------------------------
    def freeze_target(self, groups: ProcessCgroups) -> Path | None:
        """The directory to freeze for a process: its v1 freezer cgroup where the freezer
        hierarchy is mounted, else its v2 cgroup; None when that is a root cgroup or holds the
        enforcer itself (never frozen)."""
        candidates: list[tuple[Path | None, str | None, str | None]] = [
            (groups.freezer_dir, groups.freezer_path, self._own.freezer_path),
            (groups.v2_dir, groups.v2_path, self._own.v2_path),
        ]
        for directory, path, own in candidates:
            if directory is None or path in (None, "", "/"):
                continue
            if own is not None and (own == path or own.startswith(path.rstrip("/") + "/")):
                return None
            return directory
        return None


def _existing(mount: Mount | None, directory: Path | None) -> Path | None:
    if mount is None or directory is None:
        return directory
    real = Path(os.path.realpath(directory))
    if not within(real, os.path.realpath(mount.path)):
        raise InvalidArgumentError(
            f"cgroup_lines: {directory} leads out of the cgroup root {mount.path} (to {real})"
        )
    if not real.is_dir():
        raise NotFoundError(f"cgroup {directory} does not exist (the container is gone?)")
    return real


def is_v1_freezer(directory: Path) -> bool:
    return (directory / "freezer.state").exists()


def set_frozen(directory: Path, frozen: bool) -> None:
    """Freeze or thaw every process in ``directory`` (v1 freezer or v2 cgroup)."""
    try:
        if is_v1_freezer(directory):
            (directory / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        else:
            (directory / "cgroup.freeze").write_text("1" if frozen else "0")
    except FileNotFoundError as exc:
        raise NotFoundError(f"cgroup {directory} is gone") from exc
    except OSError as exc:
        raise FailedPreconditionError(
            f"cannot {'freeze' if frozen else 'thaw'} cgroup {directory}: {exc.strerror}"
        ) from exc


def is_frozen(directory: Path) -> bool:
    """Whether the enforcer asked for ``directory`` to be frozen (its own setting)."""
    with contextlib.suppress(OSError):
        if is_v1_freezer(directory):
            return (directory / "freezer.self_freezing").read_text().strip() == "1"
        return (directory / "cgroup.freeze").read_text().strip() == "1"
    return False


def within(child: str | Path, parent: str | Path) -> bool:
    """Whether cgroup ``child`` is ``parent`` or below it (paths or directories)."""
    c, p = os.path.normpath(str(child)), os.path.normpath(str(parent))
    return c == p or c.startswith(p.rstrip("/") + "/")


def start_time(pid: int, proc: Path = PROC) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid apart); None if the
    process is gone or a zombie."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])
