"""The enforcer's domain values and its checkpoint (version 1).

The checkpoint holds every share (what CreateShare was asked, the mechanisms chosen, the
containers attached by the CDI hook) and the MPS daemons the enforcer started, so that a
restarted enforcer knows all of them and interrupts nothing. Compatibility rule: see
docs/checkpoint.md; models never forbid unknown fields, every field has a default.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

from pydantic import BaseModel, Field

from gpuslice_core.checkpoint import CheckpointStore
from gpuslice_core.files import make_dirs

CHECKPOINT_KIND = "enforcer"
SCHEMA_VERSION = 1


class Mechanism(enum.StrEnum):
    """What enforces one limit, strongest first (names follow the proto's Mechanism)."""

    MEMORY_PARTITION = "memory-partition"
    MPS_PROTOCOL3 = "mps-protocol3"
    MPS_LEGACY = "mps-legacy"
    WATCHDOG = "watchdog"
    NONE = "none"

    @property
    def hard(self) -> bool:
        return self in (Mechanism.MEMORY_PARTITION, Mechanism.MPS_PROTOCOL3, Mechanism.MPS_LEGACY)

    @property
    def mps(self) -> bool:
        return self in (Mechanism.MPS_PROTOCOL3, Mechanism.MPS_LEGACY)


class Mode(enum.StrEnum):
    AUTO = "auto"
    HARD = "hard"
    SOFT = "soft"
    OFF = "off"


class Level(enum.StrEnum):
    HARD = "hard"
    SOFT = "soft"
    NONE = "none"


def level_of(*mechanisms: Mechanism, mps_exclusive: bool = True) -> Level:
    """The weakest level among the mechanisms: what a claim can rely on.

    MPS holds only the processes that go through the MPS server; unless the GPU is in
    EXCLUSIVE_PROCESS compute mode (``mps_exclusive``), a process can bypass it with a context
    of its own, so an MPS mechanism is then SOFT (the watchdog is what holds such a process).
    """
    if all(m is Mechanism.NONE for m in mechanisms):
        return Level.NONE
    if all(hard(m, mps_exclusive=mps_exclusive) or m is Mechanism.NONE for m in mechanisms):
        return Level.HARD
    return Level.SOFT


def hard(mechanism: Mechanism, *, mps_exclusive: bool) -> bool:
    """Whether ``mechanism`` holds every process of a share (see :func:`level_of`)."""
    return mechanism.hard and (mps_exclusive or not mechanism.mps)


class PodRef(BaseModel):
    uid: str = ""
    namespace: str = ""
    name: str = ""


class ContainerRecord(BaseModel):
    """A container attached to a share by its createContainer hook."""

    container_id: str
    pid: int = 0
    #: The container's cgroup v2 path and directory (memory partitioning namespace).
    v2_path: str | None = None
    v2_dir: str | None = None
    #: The container's v1 freezer path and directory.
    freezer_path: str | None = None
    freezer_dir: str | None = None
    #: GPU indices on which memory limits were set for the v2 directory.
    partitioned_gpus: list[int] = Field(default_factory=list)
    attached_at: float = 0.0


class ShareRecord(BaseModel):
    """One claim's share, as created and as enforced."""

    claim_uid: str
    claim_namespace: str = ""
    claim_name: str = ""
    share_id: str
    pods: list[PodRef] = Field(default_factory=list)
    device_uuids: list[str] = Field(default_factory=list)
    gpu_indices: list[int] = Field(default_factory=list)
    cores_percent: int = 100
    memory_bytes: int = 0
    mode: Mode = Mode.AUTO
    strict: bool = False
    work_conserving: bool = False
    memory_mechanism: Mechanism = Mechanism.WATCHDOG
    cores_mechanism: Mechanism = Mechanism.WATCHDOG
    memory_reason: str = ""
    cores_reason: str = ""
    #: Host directory given to the containers as CUDA_MPS_PIPE_DIRECTORY (MPS mechanisms).
    mps_pipe_dir: str | None = None
    #: For MPS mechanisms: whether the GPU is held in EXCLUSIVE_PROCESS compute mode, so that
    #: no process of the share can bypass the MPS server (the share is HARD only then).
    mps_exclusive: bool = True
    containers: dict[str, ContainerRecord] = Field(default_factory=dict)
    created_at: float = 0.0

    @property
    def level(self) -> Level:
        return level_of(
            self.memory_mechanism, self.cores_mechanism, mps_exclusive=self.mps_exclusive
        )

    def same_request(self, other: ShareRecord) -> bool:
        """Whether ``other`` asks for the same share (pods may differ)."""
        keys = (
            "claim_namespace",
            "claim_name",
            "device_uuids",
            "cores_percent",
            "memory_bytes",
            "mode",
            "strict",
            "work_conserving",
        )
        return all(getattr(self, k) == getattr(other, k) for k in keys)


class DaemonRecord(BaseModel):
    """An MPS control daemon the enforcer started for one GPU."""

    gpu_uuid: str
    gpu_index: int
    protocol: int
    pipe_dir: str
    log_dir: str
    pid: int = 0
    start_time: int | None = None
    restarts: int = 0


class EnforcerState(BaseModel):
    """The checkpoint's data."""

    shares: dict[str, ShareRecord] = Field(default_factory=dict)
    daemons: dict[str, DaemonRecord] = Field(default_factory=dict)
    #: GPU UUID -> the compute mode (``ComputeMode`` name) the GPU had before the enforcer set
    #: EXCLUSIVE_PROCESS for its MPS shares; restored after the last one. Written before the
    #: mode is changed, so a crash in between leaves a record, never a mode nobody restores.
    compute_modes: dict[str, str] = Field(default_factory=dict)


def open_store(state_dir: Path, boot_id: str | None = None) -> CheckpointStore[EnforcerState]:
    """The checkpoint in ``state_dir``: the directory 0700 and its lock file 0600, whatever the
    umask (the checkpoint itself is written 0600)."""
    make_dirs(state_dir, 0o700)
    state_dir.chmod(0o700)  # the enforcer's own, also when an earlier start made it looser
    path = state_dir / "enforcer.json"
    lock = os.open(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.fchmod(lock, 0o600)
    finally:
        os.close(lock)
    return CheckpointStore(
        path,
        kind=CHECKPOINT_KIND,
        model=EnforcerState,
        schema_version=SCHEMA_VERSION,
        boot_id=boot_id,
    )
