"""Prepare and unprepare, idempotent and safe against kill -9 at any point.

Prepare of one claim (docs/kubelet-plugin.md, "State machine"):

1. read the claim from the API and plan it (devices, limits, share) — no side effect yet;
2. under the claim's lock, in one checkpoint transaction: a ``PrepareCompleted`` record means
   the work is done (return it); a record left half-done by a dead instance (or by an earlier
   failed attempt) is torn down first; a live other instance working on it is an error; the
   overlap check runs; the intent is written as ``PrepareStarted``;
3. side effects: MIG instance (dynamic MIG), the GPU's time slice (NVIDIA's interval,
   ``timeslice``), enforcer share, CDI spec;
4. a second transaction marks it ``PrepareCompleted`` with the CDI ids.

Unprepare writes ``UnprepareStarted``, tears down (share, MIG instance, time slice, CDI spec) and
drops the
record; an unknown claim is success. Teardown is idempotent and needs nothing the checkpoint
does not hold: the enforcer and the MIG manager key their objects by claim UID. ``recover()``
tears down what dead instances left half-done and rewrites lost specs of completed claims.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import structlog

from gpuslice_core.errors import GpusliceError
from gpuslice_core.journal import Txn
from gpuslice_core.logging import get_logger
from gpuslice_core.untrusted import MAX_DEPTH
from gpuslice_draplugin import ClaimRef, PreparedDevice
from gpuslice_kube.errors import KubeNotFoundError, UndecodableObjectError
from gpuslice_kube.raw import Obj
from gpuslice_kubelet_plugin.cdispecs import CdiWriter, MigIds
from gpuslice_kubelet_plugin.checkpoint import (
    ClaimRecord,
    Committer,
    InstanceLock,
    PluginState,
)
from gpuslice_kubelet_plugin.claims import ClaimError, claim_error, parse_claim
from gpuslice_kubelet_plugin.discovery import Device, Inventory
from gpuslice_kubelet_plugin.enforcer import Enforcer, ShareGrant
from gpuslice_kubelet_plugin.metrics import DeviceRow, PluginMetrics
from gpuslice_kubelet_plugin.migclient import MigInstance, MigManager, owner_for
from gpuslice_kubelet_plugin.plan import Plan, check_overlap, make_plan
from gpuslice_kubelet_plugin.timeslice import TimeSlicer, check_time_slices

log = get_logger(__name__)
T = TypeVar("T")


Outcome = list[PreparedDevice] | ClaimError


def answer(record: ClaimRecord) -> list[PreparedDevice]:
    return [
        PreparedDevice(
            request_names=(d.request,),
            pool=d.pool,
            device=d.device,
            cdi_device_ids=tuple(d.cdi_device_ids),
            share_id=d.share_id,
        )
        for d in record.devices
    ]


class DeviceState:
    def __init__(
        self,
        *,
        driver: str,
        pool: str,
        committer: Committer,
        instance: InstanceLock,
        inventory: Callable[[], Inventory],
        read_claim: Callable[[ClaimRef], Obj],
        cdi: CdiWriter,
        cached_claim: Callable[[ClaimRef], Obj | None] = lambda _ref: None,
        unprepared: Callable[[ClaimRef], None] = lambda _ref: None,
        enforcer: Enforcer,
        mig: MigManager,
        time_slicer: TimeSlicer,
        metrics: PluginMetrics,
        dynamic_mig: bool = False,
        workers: int = 16,
        orphan_grace: float = 30.0,
    ) -> None:
        self.driver = driver
        self.pool = pool
        self.committer = committer
        self.instance = instance
        self.inventory = inventory
        self.read_claim = read_claim
        self.cached_claim = cached_claim
        self.unprepared = unprepared
        self.cdi = cdi
        self.enforcer = enforcer
        self.mig = mig
        self.time_slicer = time_slicer
        self.metrics = metrics
        self.dynamic_mig = dynamic_mig
        self.orphan_grace = orphan_grace
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="claim")
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ---- helpers ---------------------------------------------------------------------------
    def _lock(self, uid: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(uid, threading.Lock())

    def _map(self, fn: Callable[[ClaimRef], T], refs: list[ClaimRef]) -> list[T]:
        if len(refs) <= 1:
            return [fn(r) for r in refs]
        return list(self._pool.map(fn, refs))

    def _minors(self) -> dict[str, int]:
        return {g.uuid: g.minor for g in self.inventory().gpus}

    def _migs(self) -> MigIds:
        """The GPU and compute instance of each static MIG device (dynamic ones are in their
        records)."""
        return {
            d.uuid: (d.mig.gpu_instance_id, d.mig.compute_instance_id)
            for d in self.inventory().devices
            if d.mig is not None and d.mig.gpu_instance_id is not None and d.uuid
        }

    def _leftover(self, record: ClaimRecord) -> bool:
        """Half-done work nobody is doing any more (ours from a failed try, or a dead owner's)."""
        return record.state != "PrepareCompleted" and (
            record.owner == self.instance.id or not self.instance.alive(record.owner)
        )

    def _refresh_gauges(self, state: PluginState) -> None:
        self.metrics.observe_state(state.claims.values())

    def device_rows(self) -> list[DeviceRow]:
        """``device_info``'s rows, read at each scrape (``device_rows``)."""
        return device_rows(self.inventory(), self.committer.read())

    # ---- prepare ---------------------------------------------------------------------------
    def prepare(self, refs: list[ClaimRef]) -> dict[str, Outcome]:
        outcomes = self._map(self._prepare_one, refs)
        return {ref.uid: out for ref, out in zip(refs, outcomes, strict=True)}

    def _prepare_one(self, ref: ClaimRef) -> Outcome:
        with structlog.contextvars.bound_contextvars(claim=str(ref), claim_uid=ref.uid):
            start = time.perf_counter()
            try:
                devices = self._prepare(ref)
            except Exception as exc:
                err = claim_error(exc)
                self.metrics.claim_failed("prepare", err.reason, time.perf_counter() - start)
                log.warning("prepare failed", reason=err.reason, error=str(err))
                return err
            self.metrics.claim_done("prepare", time.perf_counter() - start)
            return devices

    def _prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        committed = self.committer.read().claims.get(ref.uid)
        if committed is not None and committed.state == "PrepareCompleted":
            log.debug("already prepared")
            return answer(committed)  # idempotent: no API read, no side effect
        start = time.perf_counter()
        plan, source = self._plan(ref)
        read = time.perf_counter()
        with self._lock(ref.uid):
            external = (
                plan.dynamic_mig
                or plan.sets_time_slice
                or (plan.share is not None and self.enforcer.present)
            )
            if external or ref.uid in self.committer.read().claims:
                finished = self._prepare_with_intent(plan)
            else:
                finished = self._prepare_in_one_commit(plan)
        done = time.perf_counter()
        log.info(
            "prepared",
            devices=[d.device for d in finished.devices],
            enforcement=finished.enforcement,
            claim_source=source,
            api_read_ms=round((read - start) * 1000, 3),
            local_ms=round((done - read) * 1000, 3),
        )
        return answer(finished)

    def _plan(self, ref: ClaimRef) -> tuple[Plan, str]:
        """Plan from the claim cache when it holds the claim the kubelet names; any problem
        with the cached copy (it may lag behind the API) is settled by reading the API."""
        cached = self.cached_claim(ref)
        if cached is not None:
            try:
                claim = parse_claim(cached, ref, driver=self.driver, pool=self.pool)
                return make_plan(claim, self.inventory(), self.pool), "cache"
            except ClaimError as exc:
                log.debug("cached claim not usable; reading the API", reason=exc.reason)
        claim = parse_claim(self._read(ref), ref, driver=self.driver, pool=self.pool)
        return make_plan(claim, self.inventory(), self.pool), "api"

    def _prepare_with_intent(self, plan: Plan) -> ClaimRecord:
        """Side effects outside this node's files (enforcer share, MIG instance): the intent is
        durable before any of them, so a crash leaves a record that recovery can act on."""
        step, record = self.committer.run(lambda s: self._begin(s, plan))
        if step == "done":
            return record
        if step == "leftover":
            log.info("tearing down a half-done earlier attempt", state=record.state)
            self._teardown(record)
            step, record = self.committer.run(lambda s: self._begin(s, plan, drop=True))
        try:
            self._apply(record, plan)
        except Exception:
            self._abort(record)
            raise
        return self.committer.run(lambda s: self._finish(s, record))

    def _prepare_in_one_commit(self, plan: Plan) -> ClaimRecord:
        """The CDI spec is the only side effect: write it, then commit the completed record
        (overlap check included) in one transaction. A crash in between leaves a spec without
        a record, which recovery removes as an orphan; a refused commit removes it at once."""
        record = self._record(plan)
        self._apply(record, plan)
        try:
            _step, finished = self.committer.run(lambda s: self._begin(s, plan, done=record))
        except ClaimError as exc:
            if exc.reason != "InProgress":  # the spec is ours alone: nobody else recorded it
                self.cdi.delete(plan.uid)
            raise
        return finished

    def _read(self, ref: ClaimRef) -> Obj:
        try:
            return self.read_claim(ref)
        except KubeNotFoundError as exc:
            raise ClaimError("NotFound", f"ResourceClaim {ref} does not exist") from exc
        except UndecodableObjectError as exc:
            raise ClaimError(
                "Undecodable",
                f"ResourceClaim {ref} cannot be decoded: {exc.problem}; gpuslice reads no claim "
                f"nested deeper than {MAX_DEPTH} levels or holding numbers out of range",
            ) from exc
        except GpusliceError as exc:
            raise ClaimError("ApiError", f"reading ResourceClaim {ref}: {exc}") from exc

    def _record(self, plan: Plan) -> ClaimRecord:
        return ClaimRecord(
            uid=plan.uid,
            namespace=plan.claim.ref.namespace,
            name=plan.claim.ref.name,
            state="PrepareStarted",
            owner=self.instance.id,
            devices=[p.record() for p in plan.devices],
            updated=time.time(),
        )

    def _begin(
        self,
        txn: Txn[PluginState],
        plan: Plan,
        *,
        drop: bool = False,
        done: ClaimRecord | None = None,
    ) -> tuple[str, ClaimRecord]:
        """("done", record) | ("leftover", record to tear down first) | ("started", intent).
        With ``done`` (side effects already applied) the record is committed completed."""
        state = txn.state
        existing = state.claims.get(plan.uid)
        if existing is not None:
            if existing.state == "PrepareCompleted":
                return "done", existing.model_copy(deep=True)
            if not self._leftover(existing):
                raise ClaimError(
                    "InProgress",
                    f"ResourceClaim {plan.claim.ref} is being worked on by another plugin "
                    f"instance ({existing.owner}, {existing.state}); the kubelet will retry",
                )
            if not drop:
                return "leftover", existing.model_copy(deep=True)
        check_overlap(plan, state)
        check_time_slices(plan, state)
        if done is not None:
            return "done", self._finish(txn, done)
        record = self._record(plan)
        txn.put(plan.uid, record)
        return "started", record.model_copy(deep=True)

    def _apply(self, record: ClaimRecord, plan: Plan) -> None:
        """The side effects, in the order they are torn down in reverse."""
        for device, planned in zip(record.devices, plan.devices, strict=True):
            mig = planned.device.mig
            if mig is not None and mig.dynamic:
                instance = self.mig.create(
                    planned.device.gpu_uuid, mig.profile, mig.placement_start, record.uid
                )
                device.uuid = instance.mig_uuid
                device.gpu_instance_id = instance.gpu_instance_id
        self.time_slicer.apply(record)
        kinds = {d.kind for d in record.devices}
        record.enforcement = "mig" if kinds == {"mig"} else "exclusive"
        if plan.share is not None:
            grant = self.enforcer.create_share(plan.share)
            record_grant(record, grant)
            if grant.level == "none":
                log.info("share is accounted, not enforced", reason=grant.reason)
        ids = self.cdi.write(record, self._minors(), self._migs())
        for device in record.devices:
            device.cdi_device_ids = ids[self.cdi.device_name(record.uid, device)]

    def _finish(self, txn: Txn[PluginState], record: ClaimRecord) -> ClaimRecord:
        record.state = "PrepareCompleted"
        record.updated = time.time()
        txn.put(record.uid, record)
        self._refresh_gauges(txn.state)
        return record.model_copy(deep=True)

    def _abort(self, record: ClaimRecord) -> None:
        try:
            self._teardown(record)
        except Exception as exc:  # the record stays; the next attempt tears down again
            log.warning("rollback of a failed prepare failed", error=str(exc))
            return
        self.committer.run(lambda txn: txn.delete(record.uid))

    # ---- teardown --------------------------------------------------------------------------
    def _teardown(self, record: ClaimRecord) -> None:
        """Undo every side effect of a claim; each step is idempotent."""
        self.cdi.delete(record.uid)
        if self.enforcer.present:
            self.enforcer.release_share(record.uid)
        self.time_slicer.release(record, self.committer.read)
        if self.dynamic_mig:
            owner = owner_for(record.uid)
            destroyed = set()
            for d in record.devices:
                if d.gpu_instance_id is not None:
                    self.mig.destroy(d.gpu_uuid, d.gpu_instance_id, owner)
                    destroyed.add((d.gpu_uuid, d.gpu_instance_id))
            for inst in self.mig.owned():  # created but killed before the record said so
                if inst.owner == owner and (inst.gpu_uuid, inst.gpu_instance_id) not in destroyed:
                    self.mig.destroy(inst.gpu_uuid, inst.gpu_instance_id, owner)

    # ---- unprepare -------------------------------------------------------------------------
    def unprepare(self, refs: list[ClaimRef]) -> dict[str, ClaimError | None]:
        outcomes = self._map(self._unprepare_one, refs)
        return {ref.uid: out for ref, out in zip(refs, outcomes, strict=True)}

    def _unprepare_one(self, ref: ClaimRef) -> ClaimError | None:
        with structlog.contextvars.bound_contextvars(claim=str(ref), claim_uid=ref.uid):
            start = time.perf_counter()
            try:
                self._unprepare(ref.uid)
            except Exception as exc:
                err = claim_error(exc)
                self.metrics.claim_failed("unprepare", err.reason, time.perf_counter() - start)
                log.warning("unprepare failed", reason=err.reason, error=str(err))
                return err
            self.metrics.claim_done("unprepare", time.perf_counter() - start)
            return None

    def _unprepare(self, uid: str) -> None:
        if uid not in self.committer.read().claims:
            return  # never prepared, or already unprepared
        with self._lock(uid):
            record = self.committer.run(lambda s: self._begin_unprepare(s, uid))
            if record is None:
                return
            self._teardown(record)
            self.committer.run(lambda s: self._drop(s, uid))
        self.unprepared(ClaimRef(record.namespace, record.name, uid))
        log.info("unprepared", devices=[d.device for d in record.devices])

    def _begin_unprepare(self, txn: Txn[PluginState], uid: str) -> ClaimRecord | None:
        committed = txn.state.claims.get(uid)
        if committed is None:
            return None
        record = committed.model_copy(deep=True)  # readers' snapshots share the committed one
        if record.state != "PrepareCompleted" and not self._leftover(record):
            raise ClaimError(
                "InProgress",
                f"ResourceClaim {record.ref} is being worked on by another plugin instance "
                f"({record.owner}, {record.state}); the kubelet will retry",
            )
        record.state = "UnprepareStarted"
        record.owner = self.instance.id
        record.updated = time.time()
        txn.put(uid, record)
        return record.model_copy(deep=True)

    def _drop(self, txn: Txn[PluginState], uid: str) -> None:
        txn.delete(uid)
        self._refresh_gauges(txn.state)

    # ---- recovery --------------------------------------------------------------------------
    def completed(self) -> list[ClaimRecord]:
        return [r for r in self.committer.read().claims.values() if r.state == "PrepareCompleted"]

    def recover(self) -> None:
        """Finish what dead instances left: roll back half-done prepares, complete half-done
        unprepares, rewrite lost CDI specs, remove orphaned specs, shares and MIG instances."""
        specs = set(self.cdi.claim_uids())  # listed before the state is read: see below
        # The enforcer and the MIG manager are sidecars that may start after the plugin (or
        # restart): one that does not answer is left out of this pass — its orphans are looked
        # for again at the next one (every --gc-interval) — instead of failing start-up.
        shares: set[str] = set()
        if self.enforcer.present:
            try:
                shares = set(self.enforcer.share_claims())
            except GpusliceError as exc:
                log.warning("orphaned enforcer shares not checked this time", error=str(exc))
        owned: list[MigInstance] = []
        if self.dynamic_mig:
            try:
                owned = self.mig.owned()
            except GpusliceError as exc:
                log.warning("orphaned MIG instances not checked this time", error=str(exc))
        state = self.committer.read()
        # Intent is written before every side effect, so anything listed above whose claim has
        # no record in the state read afterwards is an orphan.
        for record in state.claims.values():
            if record.state == "PrepareCompleted":
                if record.uid not in specs:
                    log.warning("rewriting the lost CDI spec of a prepared claim", claim=record.ref)
                    self.cdi.write(record, self._minors(), self._migs())
                    self.metrics.recovered.labels(action="spec_rewritten").inc()
                continue
            if not self._leftover(record) or record.owner == self.instance.id:
                continue
            with self._lock(record.uid):
                action = "rolled_back" if record.state == "PrepareStarted" else "unprepared"
                log.warning(
                    "recovering a claim left half-done by a dead instance",
                    claim=record.ref,
                    claim_uid=record.uid,
                    state=record.state,
                    owner=record.owner,
                    action=action,
                )
                try:
                    self._teardown(record)
                except GpusliceError as exc:  # a sidecar not up yet: the record stays
                    log.warning(
                        "half-done claim kept for the next recovery pass",
                        claim=record.ref,
                        claim_uid=record.uid,
                        error=str(exc),
                    )
                    continue
                self.committer.run(functools.partial(self._drop, uid=record.uid))
                self.metrics.recovered.labels(action=action).inc()
        self._orphans(state, specs, shares, owned)
        self.instance.sweep()
        self._refresh_gauges(self.committer.read())

    def _orphans(
        self,
        state: PluginState,
        specs: Iterable[str],
        shares: Iterable[str],
        owned: list[MigInstance],
    ) -> None:
        known = set(state.claims)
        now = time.time()
        for uid in sorted(set(specs) - known):
            if now - self.cdi.written_at(uid) < self.orphan_grace:
                continue  # may be a prepare committing right now (in one commit, see above)
            log.warning("removing an orphaned CDI spec", claim_uid=uid)
            self.cdi.delete(uid)
            self.metrics.recovered.labels(action="orphan_spec").inc()
        for uid in sorted(set(shares) - known):
            log.warning("releasing an orphaned enforcer share", claim_uid=uid)
            self.enforcer.release_share(uid)
            self.metrics.recovered.labels(action="orphan_share").inc()
        for inst in owned:
            uid = inst.owner.rsplit("/", 1)[-1]
            if uid not in known:
                log.warning("destroying an orphaned MIG instance", claim_uid=uid, mig=inst.mig_uuid)
                self.mig.destroy(inst.gpu_uuid, inst.gpu_instance_id, inst.owner)
                self.metrics.recovered.labels(action="orphan_mig").inc()


def device_rows(inventory: Inventory, state: PluginState) -> list[DeviceRow]:
    """The devices that exist now. Whole GPUs and static MIG devices are the inventory's; a
    dynamic MIG device exists from its claim's prepare to its unprepare, and only the claim's
    record knows the GPU instance id NVML gave it."""
    rows = [
        device_row(d, d.mig.gpu_instance_id if d.mig else None)
        for d in inventory.devices
        if d.mig is None or not d.mig.dynamic
    ]
    for record in state.claims.values():
        for held in record.devices:
            device = inventory.get(held.device)
            if held.gpu_instance_id is not None and device is not None:
                rows.append(device_row(device, held.gpu_instance_id))
    return rows


def device_row(device: Device, gpu_instance_id: int | None) -> DeviceRow:
    """A device as dcgm-exporter labels it: a MIG device is its parent GPU's index and UUID
    with its profile and GPU instance id."""
    profile = device.mig.profile if device.mig else ""
    gi = "" if gpu_instance_id is None else str(gpu_instance_id)
    return DeviceRow(str(device.gpu_index), device.gpu_uuid, profile, gi, device.name)


def record_grant(record: ClaimRecord, grant: ShareGrant) -> None:
    """Write what the enforcer granted for the claim's share into its record (the CDI spec's
    edits and variables come from there)."""
    record.enforcement = grant.level
    record.enforcement_reason = grant.reason
    record.enforcer_share_id = grant.share_id
    record.memory_mechanism = grant.memory_mechanism
    record.cores_mechanism = grant.cores_mechanism
    if not grant.edits.is_empty():
        record.enforcer_edits = grant.edits.model_dump(
            mode="json", by_alias=True, exclude_defaults=True
        )
