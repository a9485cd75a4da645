"""The fake node's mutable state, shared by every process through one JSON file.

Several processes simulate one node together (kubelet plugin, enforcer, MIG manager, a test),
so nothing mutable lives in memory: each change locks ``<state>.lock`` with ``fcntl.flock``
(exclusive), reads the JSON, changes it and replaces the file atomically (temp file, fsync,
rename). Readers take no lock: the rename means they always see a whole file, old or new. That
matters on this node: the workloads that register themselves here are the processes the
enforcer freezes, and one frozen while it held a lock readers wait for would stop the very
watchdog sample that thaws it (a real driver's NVML queries never wait on a client). The file
records the digest of the config it was made from; when the config changes (a different node),
the state starts over from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from gpuslice_core.errors import CorruptStateError, FailedPreconditionError

SCHEMA_VERSION = 1
#: Events kept in the file; a watcher that falls further behind misses the oldest.
MAX_EVENTS = 1000


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, extra="forbid")


class CiState(_Model):
    id: int
    profile_id: int
    start: int
    size: int


class GiState(_Model):
    id: int
    profile_id: int
    start: int
    size: int
    compute_instances: list[CiState] = []


class GpuState(_Model):
    mig_current: bool = False
    mig_pending: bool = False
    lost: bool = False
    #: ``ComputeMode`` by name; the driver's default is DEFAULT.
    compute_mode: str = "DEFAULT"
    #: ``nvidia-smi compute-policy --set-timeslice`` level: 0 default .. 3 long.
    time_slice: int = 0
    gpu_instances: list[GiState] = []


class ProcessState(_Model):
    pid: int
    gpu: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    used_memory: int = 0
    sm_percent: int = 0
    memory_percent: int = 0
    #: An MPS client (its work runs in the MPS server's context; see ``fake.contexts``), as
    #: opposed to a process with a context of its own.
    mps_client: bool = False
    #: Backed by a live OS process (see ``fake.procfs``): it vanishes when that process exits,
    #: its cgroup's memory limits apply, and it uses no SM while frozen.
    real: bool = False
    #: The OS process's start time (clock ticks since boot), to tell a reused pid apart.
    start_time: int | None = None
    #: How SM use accrues: "constant" (``sm_percent`` whenever it is not frozen) or "runnable"
    #: (``sm_percent`` times the fraction of time the spinning process was runnable).
    accounting: str = "constant"
    #: Wall clock (ns since the epoch) and runnable time (ns) when the process was registered.
    started_ns: int | None = None
    runnable_start_ns: int | None = None
    #: Runnable time when ``sm_percent`` last changed, and the SM-weighted runnable time
    #: (fraction x ns) accumulated before that.
    fold_runnable_ns: int | None = None
    busy_before_fold_ns: float = 0.0


class MemoryLimitState(_Model):
    """Driver memory-partitioning limits of one cgroup (``namespace``) on one GPU."""

    gpu: int
    namespace: str
    soft_limit: int
    hard_limit: int


class EventState(_Model):
    seq: int
    gpu: int
    kind: str
    xid: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    time: float


class NodeState(_Model):
    schema_version: int = SCHEMA_VERSION
    config_digest: str
    gpus: list[GpuState]
    processes: list[ProcessState] = []
    memory_limits: list[MemoryLimitState] = []
    events: list[EventState] = []
    next_event_seq: int = 1

    def add_event(self, event: EventState) -> None:
        """Append ``event`` with the next sequence number, dropping the oldest beyond the cap."""
        event.seq = self.next_event_seq
        self.next_event_seq += 1
        self.events.append(event)
        del self.events[:-MAX_EVENTS]


#: A token that changes whenever the state file is replaced.
FileStamp = tuple[int, int, int]


class StateStore:
    """Locked, atomic access to one node's state file."""

    def __init__(self, path: Path, digest: str, initial: Callable[[], NodeState]) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._digest = digest
        self._initial = initial

    def read(self) -> NodeState:
        """The current state (created from the config on first use); takes no lock."""
        state = self._load()
        if state is not None:
            return state
        with self.transaction() as fresh:
            return fresh

    @contextlib.contextmanager
    def transaction(self) -> Iterator[NodeState]:
        """Lock exclusively and yield the state; it is written back if the block succeeds."""
        with self._locked(fcntl.LOCK_EX):
            state = self._load() or self._fresh()
            yield state
            self._write(state)

    def reset(self) -> NodeState:
        """Start over from the config, discarding the file's content."""
        with self._locked(fcntl.LOCK_EX):
            state = self._fresh()
            self._write(state)
            return state

    def stamp(self) -> FileStamp | None:
        """Cheap change detection for pollers: ``None`` until the file exists."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise FailedPreconditionError(
                f"cannot use the fake NVML state at {self.path}: {exc.strerror}; "
                "set statePath in the config to a writable place"
            ) from exc
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _fresh(self) -> NodeState:
        """The initial state; event numbers continue from the old file so watchers keep up."""
        state = self._initial()
        try:
            old = NodeState.model_validate_json(self.path.read_bytes())
        except (OSError, ValidationError):
            return state
        state.next_event_seq = max(state.next_event_seq, old.next_event_seq)
        return state

    def _load(self) -> NodeState | None:
        """The state on disk, or ``None`` when it is missing or from another config/schema."""
        try:
            raw = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None  # the transaction that makes it says what is wrong with the place
        except OSError as exc:
            raise FailedPreconditionError(
                f"cannot read the fake NVML state at {self.path}: {exc.strerror}; "
                "set statePath in the config to a readable place"
            ) from exc
        try:
            state = NodeState.model_validate_json(raw)
        except ValidationError as exc:
            raise CorruptStateError(
                f"fake NVML state file {self.path} is unreadable ({exc.error_count()} problems); "
                "delete it or run `python -m gpuslice_nvml.fake.ctl reset`"
            ) from exc
        if state.schema_version != SCHEMA_VERSION or state.config_digest != self._digest:
            return None
        return state

    def _write(self, state: NodeState) -> None:
        data = state.model_dump_json(by_alias=True, indent=1).encode()
        fd, name = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            tmp.chmod(0o644)  # readable by the node's other processes
            tmp.replace(self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
