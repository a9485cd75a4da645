"""The plugin's node state on disk: prepared claims, and which plugin instance is working on one.

The checkpoint (``<state-dir>/kubelet-plugin.json`` and its journal ``kubelet-plugin.json.journal``,
``gpuslice_core.journal``: atomic, checksummed, boot-id aware; a commit appends the claims it
changed instead of rewriting every claim) is the source of truth for what is prepared.
Schema version 2 (the data of version 1; the version says "read the journal too", so that a
version-1 build, which would not, refuses the files instead of losing claims):

- ``claims[uid]``: a ``ClaimRecord`` in state ``PrepareStarted`` (intent written before any side
  effect), ``PrepareCompleted`` (CDI spec written, share and MIG instance set up) or
  ``UnprepareStarted`` (intent to tear down), with the devices, limits and enforcement it has.

Compatibility (the checkpoint is a versioned API): builds of version 2 read each other's files
and version-1 files (migrated on the next commit); new fields get defaults; any other change is
version 3 with a migration from 2.

Instances: every running plugin process holds an flock on ``<state-dir>/instances/<id>.lock``
for its lifetime, and records its id as the ``owner`` of the claims it is working on. A record
whose owner's lock can be taken belongs to a dead process (kill -9, OOM, node reboot) and is
recovered; one whose owner is alive (the other pod during a rolling update) is left alone. flock
works across PID namespaces, so the two pods of a rolling update see each other.
"""

from __future__ import annotations

import fcntl
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from gpuslice_core.journal import JournaledStore, Txn
from gpuslice_core.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")

KIND = "kubelet-plugin"
SCHEMA_VERSION = 2
FILE_NAME = "kubelet-plugin.json"

State = Literal["PrepareStarted", "PrepareCompleted", "UnprepareStarted"]


class DeviceRecord(BaseModel):
    """One prepared device (or share of one) of a claim."""

    request: str
    pool: str
    device: str
    kind: str = "gpu"  # gpu | mig
    share_id: str | None = None  # the allocation's shareID
    gpu_uuid: str = ""
    uuid: str = ""  # what CUDA sees: GPU-… or MIG-… (set after a dynamic MIG instance exists)
    cores: int | None = None  # percent of the GPU's SMs granted; None for MIG devices
    memory_bytes: int = 0  # memory granted
    total_memory_bytes: int = 0
    admin_access: bool = False
    gpu_instance_id: int | None = None  # dynamic MIG: the instance created for the claim
    cdi_device_ids: list[str] = []
    shared: bool = False  # covered by the claim's enforcer share (gets the enforcer's edits)
    time_slice: str | None = None  # the GPU time slice the claim set (NVIDIA's interval)


class ClaimRecord(BaseModel):
    uid: str
    namespace: str
    name: str
    state: State
    owner: str
    devices: list[DeviceRecord] = []
    enforcement: str = "none"  # hard | soft | none: what the claim can rely on
    enforcement_reason: str = ""
    enforcer_share_id: str = ""
    enforcer_edits: dict[str, Any] = {}  # CDI containerEdits (JSON) the enforcer returned
    memory_mechanism: str = ""  # what enforces the share's memory limit (the enforcer's word)
    cores_mechanism: str = ""  # ... and its SM limit
    updated: float = 0.0

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


class PluginState(BaseModel):
    """Schema version 1 (compatible changes add defaulted fields)."""

    claims: dict[str, ClaimRecord] = {}


def _from_v1(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 is version 2 without a journal: the data is the same."""
    return data


def open_store(
    state_dir: Path, *, boot_id: str | None = None, compact_lines: int = 1024
) -> JournaledStore[PluginState]:
    return JournaledStore(
        state_dir / FILE_NAME,
        kind=KIND,
        model=PluginState,
        schema_version=SCHEMA_VERSION,
        records="claims",
        migrations={1: _from_v1},
        boot_id=boot_id,
        compact_lines=compact_lines,
    )


class InstanceLock:
    """This process's identity in the state dir, held by an flock until the process dies."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "instances"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.id = uuid.uuid4().hex[:12]
        self.path = self.dir / f"{self.id}.lock"
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def alive(self, owner: str) -> bool:
        """True while the instance ``owner`` still runs (this one always does)."""
        if owner == self.id:
            return True
        path = self.dir / f"{owner}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the lock we may have taken
        return False

    def sweep(self) -> None:
        """Remove the lock files of dead instances."""
        for path in self.dir.glob("*.lock"):
            owner = path.stem
            if owner != self.id and not self.alive(owner):
                path.unlink(missing_ok=True)

    def release(self) -> None:
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


class Committer:
    """Group commit: concurrent changes to the checkpoint share one locked transaction.

    ``run(fn)`` queues ``fn(txn)``; whichever caller finds no write in progress becomes the
    writer, applies every queued ``fn`` in order inside one ``transaction()`` and appends once
    (one journal line, one fdatasync). ``fn`` reads ``txn.state`` and changes claims only with
    ``txn.put``/``txn.delete`` (records are shared with readers' snapshots: put a copy, never
    change one in place). ``fn`` must check before it changes anything: when it raises, its
    caller gets the error and the changes of the others are still written.
    """

    def __init__(self, store: JournaledStore[PluginState]) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._queue: list[tuple[Callable[[Txn[PluginState]], Any], Future[Any]]] = []
        self._writing = False

    def run(self, fn: Callable[[Txn[PluginState]], T]) -> T:
        future: Future[T] = Future()
        with self._lock:
            self._queue.append((fn, future))
            lead = not self._writing
            self._writing = lead or self._writing
        if lead:
            self._write_all()
        return future.result()

    def read(self) -> PluginState:
        """The committed state, READ-ONLY (no lock: every commit publishes a new snapshot).

        Costs two ``stat`` calls unless the files changed — also when another instance wrote
        them, which makes the next read load them again.
        """
        return self.store.read()

    def _write_all(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._writing = False
                    return
            results: list[tuple[Future[Any], Any, BaseException | None]] = []
            try:
                with self.store.transaction() as txn:
                    for fn, future in batch:
                        try:
                            results.append((future, fn(txn), None))
                        except Exception as exc:
                            results.append((future, None, exc))
            except Exception as exc:  # the write itself failed: nobody's change is durable
                for _fn, future in batch:
                    future.set_exception(exc)
                continue
            for future, value, error in results:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(value)
