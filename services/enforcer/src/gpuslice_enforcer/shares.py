"""Shares: create, release, attach containers — idempotent, checkpointed, restart-safe.

Every change runs inside one checkpoint transaction: the existing record is looked at before
any side effect (so a repeated call changes nothing), side effects (MPS namespace, memory limits)
happen inside the transaction, and the record is committed only when they succeeded. Share IDs
are derived from the claim UID, so a call repeated after a crash re-creates the same MPS
namespace name instead of leaking one.

The watchdog reads shares through :meth:`ShareManager.snapshot`, an immutable tuple replaced on
every change (no lock shared with the watchdog, so neither can block the other).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice_core.cdi import ContainerEdits
from gpuslice_core.checkpoint import CheckpointStore
from gpuslice_core.errors import (
    FailedPreconditionError,
    GpusliceError,
    InvalidArgumentError,
    NotFoundError,
)
from gpuslice_core.logging import get_logger
from gpuslice_enforcer.capabilities import Choice, GpuCapabilities, choose, probe, probe_gpu
from gpuslice_enforcer.cgroups import CgroupView, start_time
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.edits import container_edits
from gpuslice_enforcer.mps import MpsManager
from gpuslice_enforcer.state import (
    ContainerRecord,
    DaemonRecord,
    EnforcerState,
    Mechanism,
    Mode,
    PodRef,
    ShareRecord,
)
from gpuslice_nvml import MEMORY_LIMIT_MAX, ComputeMode, Nvml, NvmlError

log = get_logger(__name__)

MIB = 1 << 20
#: Longest claim UID, share ID and container ID an attach may name; most cgroup lines, and the
#: longest (so that no error message grows with what a client sent).
MAX_ID, MAX_CGROUP_LINES, MAX_CGROUP_LINE = 256, 64, 4096


@dataclass(frozen=True)
class ShareRequest:
    claim_uid: str
    claim_namespace: str
    claim_name: str
    device_uuids: list[str]
    cores_percent: int
    memory_bytes: int
    mode: Mode = Mode.AUTO
    strict: bool = False
    work_conserving: bool = False
    pods: list[PodRef] = field(default_factory=list)


@dataclass(frozen=True)
class ShareResult:
    share: ShareRecord
    created: bool
    edits: ContainerEdits


@dataclass(frozen=True)
class AttachRequest:
    claim_uid: str
    container_id: str
    pid: int
    share_id: str = ""
    cgroup_lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AttachResult:
    share: ShareRecord
    attached: bool
    cgroup_paths: list[str]


def share_id_for(claim_uid: str) -> str:
    return "sh-" + hashlib.sha256(claim_uid.encode()).hexdigest()[:12]


class ShareManager:
    def __init__(
        self,
        nvml: Nvml,
        config: EnforcerConfig,
        store: CheckpointStore[EnforcerState],
        cgroups: CgroupView,
        mps: MpsManager,
        *,
        on_release: Callable[[ShareRecord], None] = lambda _share: None,
        on_mps_restart: Callable[[DaemonRecord], None] = lambda _daemon: None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.nvml = nvml
        self.config = config
        self.store = store
        self.cgroups = cgroups
        self.mps = mps
        self._on_release = on_release
        self._on_mps_restart = on_mps_restart
        self._wall = wall_clock
        self._lock = threading.RLock()
        self._snapshot: tuple[int, list[ShareRecord]] = (0, [])
        self._uuids: dict[str, int] = {}

    # -- start-up -------------------------------------------------------------------------
    def start(self) -> EnforcerState:
        """Load the checkpoint (a CorruptStateError stops start-up) and adopt MPS daemons."""
        loaded = self.store.load()
        if loaded.stale_path is not None:
            log.warning("checkpoint from an earlier boot set aside", path=str(loaded.stale_path))
        self._refresh_uuids()
        with self._lock, self.store.transaction() as state:
            for daemon in list(state.daemons.values()):
                self._supervise(state, daemon)
            self._stop_unknown_daemons(state)
            self._reconcile_compute_modes(state)
            self._publish(state)
        log.info("shares restored", shares=len(state.shares), daemons=len(state.daemons))
        return state

    def _stop_unknown_daemons(self, state: EnforcerState) -> None:
        """Quit MPS daemons under our MPS root that the checkpoint does not know (a lost or
        set-aside checkpoint): no share uses them, and they would hold their GPUs."""
        known = {d.pipe_dir for d in state.daemons.values()}
        for found in self.mps.running_daemons():
            if found.pipe_dir not in known:
                log.warning(
                    "stopping an MPS daemon no share uses", pid=found.pid, pipe=found.pipe_dir
                )
                self.mps.stop(found)

    def _refresh_uuids(self) -> None:
        uuids = {}
        for index in range(self.nvml.device_count()):
            with contextlib.suppress(NvmlError):
                uuids[self.nvml.gpu(index).uuid] = index
        self._uuids = uuids

    def _publish(self, state: EnforcerState) -> None:
        shares = [s.model_copy(deep=True) for s in state.shares.values()]
        self._snapshot = (self._snapshot[0] + 1, shares)

    def snapshot(self) -> tuple[int, list[ShareRecord]]:
        """(generation, shares): a consistent, immutable view; the generation changes with it."""
        return self._snapshot

    def get(self, claim_uid: str) -> ShareRecord | None:
        return next((s for s in self._snapshot[1] if s.claim_uid == claim_uid), None)

    def capabilities(self) -> list[GpuCapabilities]:
        return probe(self.nvml, self.config, self.cgroups)

    # -- create ---------------------------------------------------------------------------
    def create(self, req: ShareRequest) -> ShareResult:
        _validate(req)
        wanted = ShareRecord(
            claim_uid=req.claim_uid,
            claim_namespace=req.claim_namespace,
            claim_name=req.claim_name,
            share_id=share_id_for(req.claim_uid),
            pods=list(req.pods),
            device_uuids=list(req.device_uuids),
            cores_percent=req.cores_percent,
            memory_bytes=req.memory_bytes,
            mode=req.mode,
            strict=req.strict,
            work_conserving=req.work_conserving,
        )
        with self._lock, self.store.transaction() as state:
            existing = state.shares.get(req.claim_uid)
            if existing is not None:
                if not existing.same_request(wanted):
                    raise FailedPreconditionError(
                        f"claim {req.claim_uid} already has share {existing.share_id} with other "
                        f"parameters (devices {existing.device_uuids}, cores "
                        f"{existing.cores_percent}, memory {existing.memory_bytes}, mode "
                        f"{existing.mode.value}); release it first"
                    )
                return ShareResult(existing, False, container_edits(self.config, existing))
            gpus = self._capabilities_of(req)
            for gpu in gpus:
                if req.memory_bytes > gpu.memory_total_bytes:
                    raise InvalidArgumentError(
                        f"memory_bytes: {req.memory_bytes} is more than GPU {gpu.uuid} has "
                        f"({gpu.memory_total_bytes}); allowed 1Mi..{gpu.memory_total_bytes}"
                    )
            choice = choose(
                gpus,
                mode=req.mode,
                strict=req.strict,
                cores_percent=req.cores_percent,
                memory_bytes=req.memory_bytes,
            )
            share = wanted.model_copy(
                update={
                    "gpu_indices": [g.index for g in gpus],
                    "memory_mechanism": choice.memory,
                    "memory_reason": choice.memory_reason,
                    "cores_mechanism": choice.cores,
                    "cores_reason": choice.cores_reason,
                    "created_at": self._wall(),
                }
            )
            if choice.cores.mps:
                share.mps_exclusive = self._exclusive_for(state, share, gpus[0], choice)
                share.mps_pipe_dir = self._setup_mps(state, share, gpus[0])
            state.shares[share.claim_uid] = share
            self._publish(state)
        log.info(
            "share created",
            claim_uid=share.claim_uid,
            share_id=share.share_id,
            devices=share.device_uuids,
            cores=share.cores_percent,
            memory=share.memory_bytes,
            memory_mechanism=share.memory_mechanism.value,
            cores_mechanism=share.cores_mechanism.value,
            level=share.level.value,
        )
        return ShareResult(share, True, container_edits(self.config, share))

    def _capabilities_of(self, req: ShareRequest) -> list[GpuCapabilities]:
        if any(uuid not in self._uuids for uuid in req.device_uuids):
            self._refresh_uuids()
        gpus = []
        for uuid in req.device_uuids:
            index = self._uuids.get(uuid)
            if index is None:
                raise NotFoundError(
                    f"device_uuids: no GPU {uuid} on this node; it has {sorted(self._uuids)}"
                )
            gpus.append(probe_gpu(self.nvml, self.nvml.gpu(index), self.config, self.cgroups))
        return gpus

    def _exclusive_for(
        self, state: EnforcerState, share: ShareRecord, gpu: GpuCapabilities, choice: Choice
    ) -> bool:
        """Hold the GPU in EXCLUSIVE_PROCESS for an MPS share where the enforcer manages the
        compute mode; whether the share's MPS limits then hold every process (HARD)."""
        if not choice.mps_exclusive or not self.config.manage_compute_mode:
            return choice.mps_exclusive
        try:
            self._hold_exclusive(state, gpu.uuid)
        except NvmlError as exc:
            why = f"; SOFT: compute mode EXCLUSIVE_PROCESS could not be set: {exc}"
            if share.mode is Mode.HARD and share.strict:
                raise FailedPreconditionError(
                    f"strict hard enforcement is not available on {gpu.uuid}{why}"
                ) from exc
            share.cores_reason += why
            if share.memory_mechanism.mps:
                share.memory_reason += why
            return False
        return True

    def _setup_mps(self, state: EnforcerState, share: ShareRecord, gpu: GpuCapabilities) -> str:
        protocol = 3 if share.cores_mechanism is Mechanism.MPS_PROTOCOL3 else 2
        daemon = state.daemons.get(gpu.uuid)
        if daemon is not None and daemon.protocol != protocol:
            raise FailedPreconditionError(
                f"GPU {gpu.uuid} runs an MPS protocol {daemon.protocol} daemon; a protocol "
                f"{protocol} share cannot join it"
            )
        if daemon is None or not self.mps.alive(daemon):
            daemon = self.mps.start(gpu.index, gpu.uuid, protocol)
            state.daemons[gpu.uuid] = daemon
        if protocol == 2:
            return daemon.pipe_dir
        path = self.mps.create_namespace(
            daemon, share.share_id, share.cores_percent, share.memory_bytes
        )
        return str(path)

    # -- release --------------------------------------------------------------------------
    def release(self, claim_uid: str) -> ShareRecord | None:
        if not claim_uid:
            raise InvalidArgumentError("claim_uid: required, got an empty string")
        with self._lock, self.store.transaction() as state:
            share = state.shares.pop(claim_uid, None)
            if share is None:
                return None
            self._clear_limits(share)
            if share.cores_mechanism.mps:
                self._teardown_mps(state, share)
            self._publish(state)
        self._on_release(share)
        log.info("share released", claim_uid=claim_uid, share_id=share.share_id)
        return share

    def _clear_limits(self, share: ShareRecord) -> None:
        for container in share.containers.values():
            self._clear_container_limits(container)

    def _clear_container_limits(self, container: ContainerRecord) -> None:
        for gpu in container.partitioned_gpus:
            if container.v2_dir is None:
                continue
            try:
                self.nvml.set_memory_limits(gpu, container.v2_dir, 0, MEMORY_LIMIT_MAX)
            except NvmlError as exc:  # gone with its cgroup, most likely
                log.debug("memory limit not cleared", cgroup=container.v2_dir, error=str(exc))

    def _teardown_mps(self, state: EnforcerState, share: ShareRecord) -> None:
        uuid = share.device_uuids[0]
        daemon = state.daemons.get(uuid)
        if daemon is None:
            return
        if daemon.protocol == 3 and self.mps.alive(daemon):
            try:
                self.mps.delete_namespace(daemon, share.share_id)
            except GpusliceError as exc:
                log.warning("mps namespace not deleted", share_id=share.share_id, error=str(exc))
        still_used = any(
            s.cores_mechanism.mps and s.device_uuids[0] == uuid for s in state.shares.values()
        )
        if not still_used:
            self.mps.stop(daemon)
            del state.daemons[uuid]
            self._restore_compute_mode(state, uuid)

    # -- compute mode ---------------------------------------------------------------------
    def _hold_exclusive(self, state: EnforcerState, uuid: str) -> None:
        """Put the GPU in EXCLUSIVE_PROCESS, recording (and committing) the mode it had first."""
        index = self._index(uuid)
        mode = self.nvml.compute_mode(index)
        if mode is ComputeMode.EXCLUSIVE_PROCESS:
            return  # ours already, or the operator's (then it is not restored)
        if uuid not in state.compute_modes:
            state.compute_modes[uuid] = mode.value
            self.store.save(state)  # the record first: a crash now leaves it to be restored
        self.nvml.set_compute_mode(index, ComputeMode.EXCLUSIVE_PROCESS)
        log.info("compute mode set", gpu=uuid, mode="EXCLUSIVE_PROCESS", was=mode.value)

    def _restore_compute_mode(self, state: EnforcerState, uuid: str) -> None:
        """Give the GPU back the compute mode it had before its MPS shares; a failure keeps the
        record, and the supervisor tries again."""
        original = state.compute_modes.get(uuid)
        if original is None:
            return
        index = self._uuids.get(uuid)
        try:
            if index is not None:
                current = self.nvml.compute_mode(index)
                if current is ComputeMode.EXCLUSIVE_PROCESS and original != current.value:
                    self.nvml.set_compute_mode(index, ComputeMode(original))
                    log.info("compute mode restored", gpu=uuid, mode=original)
        except NvmlError as exc:
            log.warning("compute mode not restored yet", gpu=uuid, mode=original, error=str(exc))
            return
        del state.compute_modes[uuid]

    def _reconcile_compute_modes(self, state: EnforcerState) -> None:
        """Exclusive while a GPU serves MPS shares (after a driver reload, too), the recorded
        mode once it serves none — or whenever the enforcer no longer manages compute modes,
        which turns the MPS shares of a GPU that is not exclusive SOFT."""
        held = self._held_exclusive(state)
        for uuid in list(state.compute_modes):
            if uuid not in held:
                self._restore_compute_mode(state, uuid)
        for uuid in held:
            try:
                self._hold_exclusive(state, uuid)
            except (NvmlError, NotFoundError) as exc:
                log.warning("compute mode not held", gpu=uuid, error=str(exc))
        if self.config.manage_compute_mode:
            return
        for share in state.shares.values():
            if (
                share.cores_mechanism.mps
                and share.mps_exclusive
                and not self._exclusive_now(share.device_uuids[0])
            ):
                share.mps_exclusive = False
                share.cores_reason += "; SOFT: the GPU is no longer in EXCLUSIVE_PROCESS mode"

    def _held_exclusive(self, state: EnforcerState) -> set[str]:
        """GPUs the enforcer holds in EXCLUSIVE_PROCESS: those serving MPS shares made HARD."""
        if not self.config.manage_compute_mode:
            return set()
        return {
            s.device_uuids[0]
            for s in state.shares.values()
            if s.cores_mechanism.mps and s.mps_exclusive
        }

    def _exclusive_now(self, uuid: str) -> bool:
        index = self._uuids.get(uuid)
        try:
            return index is not None and (
                self.nvml.compute_mode(index) is ComputeMode.EXCLUSIVE_PROCESS
            )
        except NvmlError:
            return False

    def _index(self, uuid: str) -> int:
        if uuid not in self._uuids:
            self._refresh_uuids()
        index = self._uuids.get(uuid)
        if index is None:
            raise NotFoundError(f"no GPU {uuid} on this node")
        return index

    # -- containers -----------------------------------------------------------------------
    def attach(self, req: AttachRequest) -> AttachResult:
        _validate_attach(req)
        with self._lock, self.store.transaction() as state:
            share = state.shares.get(req.claim_uid)
            if share is None:
                raise NotFoundError(f"claim {req.claim_uid} has no share; CreateShare first")
            if req.share_id and req.share_id != share.share_id:
                raise FailedPreconditionError(
                    f"share_id: {req.share_id} is not claim {req.claim_uid}'s share "
                    f"{share.share_id} (a stale CDI spec?)"
                )
            if start_time(req.pid) is None and not req.cgroup_lines:
                raise NotFoundError(f"pid: no process {req.pid} (the container is gone)")
            groups = self.cgroups.resolve(
                self.cgroups.parse(req.cgroup_lines)
                if req.cgroup_lines
                else self.cgroups.require_of_pid(req.pid)
            )
            pruned = self._prune(share, keep=req.container_id)
            existing = share.containers.get(req.container_id)
            record = ContainerRecord(
                container_id=req.container_id,
                pid=req.pid,
                v2_path=groups.v2_path,
                v2_dir=str(groups.v2_dir) if groups.v2_dir else None,
                freezer_path=groups.freezer_path,
                freezer_dir=str(groups.freezer_dir) if groups.freezer_dir else None,
                attached_at=existing.attached_at if existing else self._wall(),
            )
            if share.memory_mechanism is Mechanism.MEMORY_PARTITION:
                record.partitioned_gpus = self._partition(share, record)
            share.containers[req.container_id] = record
            self._publish(state)
        paths = [p for p in (record.v2_dir, record.freezer_dir) if p]
        _log_pruned(share.claim_uid, pruned)
        log.info(
            "container attached",
            claim_uid=share.claim_uid,
            container=req.container_id,
            pid=req.pid,
            cgroups=paths,
            memory_mechanism=share.memory_mechanism.value,
        )
        return AttachResult(share, existing is None, paths)

    def _partition(self, share: ShareRecord, record: ContainerRecord) -> list[int]:
        """Set the share's memory limit on the container's cgroup v2 directory, on each of its
        GPUs, and read it back: the limits are in force when this returns."""
        if record.v2_dir is None or record.v2_path in (None, "", "/"):
            raise FailedPreconditionError(
                f"container {record.container_id} has no cgroup v2 directory of its own "
                f"(cgroup v2 path {record.v2_path!r}); memory partitioning needs one"
            )
        done = []
        for gpu in share.gpu_indices:
            self.nvml.set_memory_limits(gpu, record.v2_dir, share.memory_bytes, share.memory_bytes)
            got = self.nvml.memory_limits(gpu, record.v2_dir)
            if got.hard_limit != share.memory_bytes:
                raise FailedPreconditionError(
                    f"GPU {gpu}: the driver reports a hard limit of {got.hard_limit} for "
                    f"{record.v2_dir}, not the {share.memory_bytes} just set"
                )
            done.append(gpu)
        return done

    def prune(self) -> int:
        """Forget every container that is gone without a poststop hook to detach it (called
        periodically; attach does it for its share); how many were forgotten."""
        _, shares = self.snapshot()
        if not any(_gone(c) for s in shares for c in s.containers.values()):
            return 0
        with self._lock, self.store.transaction() as state:
            pruned = {s.claim_uid: self._prune(s) for s in state.shares.values()}
            self._publish(state)
        for claim_uid, ids in pruned.items():
            _log_pruned(claim_uid, ids)
        return sum(len(ids) for ids in pruned.values())

    def _prune(self, share: ShareRecord, keep: str = "") -> list[str]:
        gone = [c for c in share.containers.values() if c.container_id != keep and _gone(c)]
        for container in gone:
            self._clear_container_limits(container)
            del share.containers[container.container_id]
        return [c.container_id for c in gone]

    def detach(self, claim_uid: str, container_id: str) -> bool:
        with self._lock, self.store.transaction() as state:
            share = state.shares.get(claim_uid)
            if share is None or container_id not in share.containers:
                return False
            del share.containers[container_id]
            self._publish(state)
        log.info("container detached", claim_uid=claim_uid, container=container_id)
        return True

    # -- MPS supervision ------------------------------------------------------------------
    def supervise(self) -> None:
        """Restart dead MPS daemons and re-create their namespaces, and keep compute modes
        as they must be (called periodically)."""
        with self._lock:
            loaded = self.store.load().state
            if all(self.mps.alive(d) for d in loaded.daemons.values()) and self._modes_ok(loaded):
                return
            with self.store.transaction() as state:
                for daemon in list(state.daemons.values()):
                    self._supervise(state, daemon)
                self._reconcile_compute_modes(state)
                self._publish(state)

    def _modes_ok(self, state: EnforcerState) -> bool:
        """Nothing for :meth:`_reconcile_compute_modes` to do: no record waits to be restored,
        and every GPU held exclusive still is."""
        held = self._held_exclusive(state)
        if set(state.compute_modes) - held:
            return False
        if not self.config.manage_compute_mode:
            return all(
                not (s.cores_mechanism.mps and s.mps_exclusive)
                or self._exclusive_now(s.device_uuids[0])
                for s in state.shares.values()
            )
        return all(self._exclusive_now(uuid) for uuid in held)

    def _supervise(self, state: EnforcerState, daemon: DaemonRecord) -> None:
        users = [
            s
            for s in state.shares.values()
            if s.cores_mechanism.mps and s.device_uuids[0] == daemon.gpu_uuid
        ]
        if not users:
            self.mps.stop(daemon)
            del state.daemons[daemon.gpu_uuid]
            return
        if self.mps.alive(daemon):
            if daemon.protocol == 3:
                present = set(self.mps.namespaces(daemon))
                for share in users:
                    if share.share_id not in present:
                        self.mps.create_namespace(
                            daemon, share.share_id, share.cores_percent, share.memory_bytes
                        )
            return
        log.warning("mps daemon died; restarting", gpu=daemon.gpu_uuid, pid=daemon.pid)
        fresh = self.mps.start(daemon.gpu_index, daemon.gpu_uuid, daemon.protocol)
        fresh.restarts = daemon.restarts + 1
        state.daemons[daemon.gpu_uuid] = fresh
        if fresh.protocol == 3:
            for share in users:
                self.mps.create_namespace(
                    fresh, share.share_id, share.cores_percent, share.memory_bytes
                )
        self._on_mps_restart(fresh)

    def stop_daemons(self) -> None:
        with self._lock, self.store.transaction() as state:
            for daemon in list(state.daemons.values()):
                self.mps.stop(daemon)
            state.daemons.clear()


def _gone(container: ContainerRecord) -> bool:
    """Whether a container's cgroups are all removed (with none recorded: its process is)."""
    dirs = [d for d in (container.v2_dir, container.freezer_dir) if d]
    if dirs:
        return not any(Path(d).is_dir() for d in dirs)
    return start_time(container.pid) is None


def _log_pruned(claim_uid: str, container_ids: list[str]) -> None:
    if container_ids:
        log.info(
            "gone containers forgotten",
            claim_uid=claim_uid,
            count=len(container_ids),
            containers=container_ids[:10],
        )


def _validate_attach(req: AttachRequest) -> None:
    for name in ("claim_uid", "share_id", "container_id"):
        value: str = getattr(req, name)
        if len(value) > MAX_ID:
            raise InvalidArgumentError(f"{name}: {len(value)} characters; at most {MAX_ID}")
    longest = max((len(line) for line in req.cgroup_lines), default=0)
    if len(req.cgroup_lines) > MAX_CGROUP_LINES or longest > MAX_CGROUP_LINE:
        raise InvalidArgumentError(
            f"cgroup_lines: {len(req.cgroup_lines)} lines of up to {longest} characters; at "
            f"most {MAX_CGROUP_LINES} lines of {MAX_CGROUP_LINE}"
        )
    if not req.claim_uid or not req.container_id or req.pid <= 0:
        raise InvalidArgumentError(
            f"claim_uid, container_id and pid are required (got {req.claim_uid!r}, "
            f"{req.container_id!r}, {req.pid})"
        )


def _validate(req: ShareRequest) -> None:
    if not req.claim_uid:
        raise InvalidArgumentError("claim_uid: required, got an empty string")
    if not req.claim_namespace or not req.claim_name:
        raise InvalidArgumentError(
            f"claim_namespace and claim_name: required, got {req.claim_namespace!r} and "
            f"{req.claim_name!r}"
        )
    if not req.device_uuids:
        raise InvalidArgumentError("device_uuids: at least one GPU UUID is required, got none")
    if len(set(req.device_uuids)) != len(req.device_uuids):
        raise InvalidArgumentError(f"device_uuids: {req.device_uuids} lists a GPU twice")
    bad = [u for u in req.device_uuids if not u.startswith("GPU-")]
    if bad:
        raise InvalidArgumentError(f"device_uuids: {bad} are not GPU UUIDs (GPU-...)")
    if not 1 <= req.cores_percent <= 100:
        raise InvalidArgumentError(
            f"cores_percent: {req.cores_percent} is out of range; allowed 1..100"
        )
    if req.memory_bytes < MIB:
        raise InvalidArgumentError(
            f"memory_bytes: {req.memory_bytes} is out of range; allowed 1Mi (1048576) .. the "
            "GPU's memory"
        )
