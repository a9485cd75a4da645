"""The kubelet's DRA manager: prepare a pod's claims before its sandbox, unprepare them when
their last local pod is gone, and checkpoint the claim cache so a restart neither loses nor
repeats work (docs/node-agent.md, "What it simulates": DRA manager, Termination).

The checkpoint (``<root>/dra_manager_state``, ``gpuslice_core.checkpoint``: atomic, versioned,
checksummed, boot id) holds per claim: UID, drivers, the pods using it, whether it is prepared
and the devices NodePrepareResources returned. The pod reference is written *before* the
plugin is called; ``prepared`` and the devices after every batch of the pod succeeded.
Unlike the kubelet we also checkpoint ``prepared``: a restarted agent then sends no second
NodePrepareResources for claims it already prepared (the kubelet gets the same effect because
it only prepares when it creates a sandbox).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable

from pydantic import BaseModel

from e2e.sandbox.nodeagent.claims import (
    ClaimError,
    PodClaim,
    allocated_drivers,
    pod_claims,
    validate_claim,
)
from e2e.sandbox.nodeagent.dra_plugins import ClaimRef, DraCallError, DraPlugins, PreparedDevice
from e2e.sandbox.nodeagent.kubeapi import KubeletApi
from gpuslice_core.checkpoint import CheckpointStore
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import KubeError
from gpuslice_kube.raw import Obj

log = get_logger(__name__)

CHECKPOINT_KIND = "gpuslice-nodeagent-dra"
CHECKPOINT_VERSION = 1


class DeviceEntry(BaseModel):
    driver: str
    pool_name: str
    device_name: str
    request_names: list[str] = []
    cdi_device_ids: list[str] = []
    share_id: str | None = None


class ClaimEntry(BaseModel):
    namespace: str
    name: str
    uid: str
    drivers: list[str] = []
    pod_uids: list[str] = []
    prepared: bool = False
    devices: list[DeviceEntry] = []

    def ref(self) -> ClaimRef:
        return ClaimRef(namespace=self.namespace, uid=self.uid, name=self.name)


class DraState(BaseModel):
    """Schema version 1. Compatible changes add defaulted fields; anything else is version 2
    with a migration (gpuslice_core.checkpoint rules)."""

    claims: dict[str, ClaimEntry] = {}  # key: namespace/name


class PrepareError(Exception):
    """Preparing failed; the pod stays Pending and is retried."""


class UnprepareError(Exception):
    """Unpreparing failed; retried until it succeeds."""


def open_store(path: str) -> CheckpointStore[DraState]:
    return CheckpointStore(
        path, kind=CHECKPOINT_KIND, model=DraState, schema_version=CHECKPOINT_VERSION
    )


class DraManager:
    def __init__(self, api: KubeletApi, plugins: DraPlugins, store: CheckpointStore[DraState]):
        self.api = api
        self.plugins = plugins
        self.store = store
        self.state = store.load().state
        self._lock = threading.Lock()  # one prepare/unprepare at a time (shared claims)

    def _save(self) -> None:
        self.store.save(self.state)

    # ---- prepare -----------------------------------------------------------------------------
    def prepare(self, pod: Obj) -> list[PodClaim]:
        """Prepare every claim of ``pod`` (validated first, without changing any state)."""
        meta = pod["metadata"]
        ns, pod_uid = meta["namespace"], meta["uid"]
        try:
            pcs = pod_claims(pod)
            claims: list[tuple[PodClaim, Obj]] = []
            for pc in pcs:
                claim = self.api.get_claim(ns, pc.claim_name)
                validate_claim(pod, claim, pc, self.plugins.registered)
                claims.append((pc, claim))
        except (ClaimError, KubeError) as exc:
            raise PrepareError(str(exc)) from exc
        if not claims:
            return pcs
        with self._lock:
            pending: list[ClaimEntry] = []
            for _pc, claim in claims:
                cmeta = claim["metadata"]
                key = f"{ns}/{cmeta['name']}"
                entry = self.state.claims.get(key)
                if entry is not None and entry.uid != cmeta["uid"]:
                    raise PrepareError(
                        f"old ResourceClaim with same name {cmeta['name']} and different UID "
                        f"{entry.uid} still exists (previous pod force-deleted?!)"
                    )
                if entry is None:
                    entry = ClaimEntry(
                        namespace=ns,
                        name=cmeta["name"],
                        uid=cmeta["uid"],
                        drivers=allocated_drivers(claim),
                    )
                    self.state.claims[key] = entry
                if pod_uid not in entry.pod_uids:
                    entry.pod_uids.append(pod_uid)
                if not entry.prepared and entry not in pending:
                    pending.append(entry)
            self._save()  # the pod reference is durable before any plugin call
            if pending:
                devices = self._call_prepare(pending)
                for entry in pending:
                    entry.devices = devices[entry.uid]
                    entry.prepared = True
                self._save()
        return pcs

    def _call_prepare(self, entries: list[ClaimEntry]) -> dict[str, list[DeviceEntry]]:
        by_driver: dict[str, list[ClaimEntry]] = defaultdict(list)
        for entry in entries:
            for driver in entry.drivers:
                by_driver[driver].append(entry)
        out: dict[str, list[DeviceEntry]] = {e.uid: [] for e in entries}
        for driver, batch in sorted(by_driver.items()):
            log.info("NodePrepareResources", driver=driver, claims=[e.name for e in batch])
            try:
                response = self.plugins.prepare(driver, [e.ref() for e in batch])
            except DraCallError as exc:
                raise PrepareError(f"NodePrepareResources failed: {exc}") from exc
            wanted = {e.uid: e for e in batch}
            unknown = sorted(set(response) - set(wanted))
            if unknown:
                raise PrepareError(
                    f"NodePrepareResources returned result for unknown claim UID {unknown[0]}"
                )
            for uid, result in response.items():
                if isinstance(result, str):
                    raise PrepareError(
                        "NodePrepareResources failed for ResourceClaim "
                        f"{wanted[uid].name}: {result}"
                    )
                out[uid] += [_entry(driver, d) for d in result]
            if len(response) < len(batch):
                raise PrepareError(
                    f"NodePrepareResources skipped {len(batch) - len(response)} ResourceClaims"
                )
        return out

    # ---- queries -----------------------------------------------------------------------------
    def devices(self, namespace: str, claim_name: str) -> list[PreparedDevice]:
        entry = self.state.claims.get(f"{namespace}/{claim_name}")
        if entry is None or not entry.prepared:
            return []
        return [
            PreparedDevice(
                pool_name=d.pool_name,
                device_name=d.device_name,
                request_names=tuple(d.request_names),
                cdi_device_ids=tuple(d.cdi_device_ids),
                share_id=d.share_id,
            )
            for d in entry.devices
        ]

    def driver_devices(self, namespace: str, claim_name: str) -> list[tuple[str, PreparedDevice]]:
        """(driver, device) for each device of a claim prepared here ([] when it is not)."""
        entry = self.state.claims.get(f"{namespace}/{claim_name}")
        if entry is None or not entry.prepared:
            return []
        return [
            (
                d.driver,
                PreparedDevice(
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    request_names=tuple(d.request_names),
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=d.share_id,
                ),
            )
            for d in list(entry.devices)
        ]

    def pods_using(self, devices: Iterable[tuple[str, str, str]]) -> set[str]:
        """UIDs of the pods whose prepared claims hold any of these (driver, pool, device)."""
        wanted = set(devices)
        return {
            uid
            for entry in list(self.state.claims.values())
            if any((d.driver, d.pool_name, d.device_name) in wanted for d in list(entry.devices))
            for uid in list(entry.pod_uids)
        }

    def holds(self, pod_uid: str) -> bool:
        """True while any claim still references the pod (it may not turn terminal)."""
        return any(pod_uid in e.pod_uids for e in self.state.claims.values())

    def prepared_for(self, pod_uid: str) -> bool:
        entries = [e for e in self.state.claims.values() if pod_uid in e.pod_uids]
        return bool(entries) and all(e.prepared for e in entries)

    def pod_uids(self) -> set[str]:
        return {u for e in self.state.claims.values() for u in e.pod_uids}

    # ---- unprepare ---------------------------------------------------------------------------
    def unprepare(self, pod_uid: str) -> None:
        """Drop the pod's references; NodeUnprepareResources for claims it was the last user of."""
        with self._lock:
            last: list[ClaimEntry] = []
            for entry in self.state.claims.values():
                if pod_uid not in entry.pod_uids:
                    continue
                if len(entry.pod_uids) > 1:
                    entry.pod_uids.remove(pod_uid)
                else:
                    last.append(entry)
            self._save()
            if not last:
                return
            by_driver: dict[str, list[ClaimEntry]] = defaultdict(list)
            for entry in last:
                for driver in entry.drivers:
                    by_driver[driver].append(entry)
            for driver, batch in sorted(by_driver.items()):
                log.info("NodeUnprepareResources", driver=driver, claims=[e.name for e in batch])
                try:
                    response = self.plugins.unprepare(driver, [e.ref() for e in batch])
                except DraCallError as exc:
                    raise UnprepareError(f"NodeUnprepareResources failed: {exc}") from exc
                for entry in batch:
                    if entry.uid not in response:
                        raise UnprepareError(
                            f"NodeUnprepareResources skipped ResourceClaim {entry.name}"
                        )
                    if response[entry.uid]:
                        raise UnprepareError(
                            f"NodeUnprepareResources failed for ResourceClaim {entry.name}: "
                            f"{response[entry.uid]}"
                        )
            for entry in last:
                self.state.claims.pop(f"{entry.namespace}/{entry.name}", None)
            self._save()

    def reconcile(self, active_pod_uids: Iterable[str]) -> None:
        """Unprepare for pods that are no longer active (force-deleted, failed prepare)."""
        active = set(active_pod_uids)
        for pod_uid in sorted(self.pod_uids() - active):
            try:
                self.unprepare(pod_uid)
            except UnprepareError as exc:
                log.warning(
                    "unprepare of an inactive pod failed; will retry",
                    pod_uid=pod_uid,
                    error=str(exc),
                )


def _entry(driver: str, d: PreparedDevice) -> DeviceEntry:
    return DeviceEntry(
        driver=driver,
        pool_name=d.pool_name,
        device_name=d.device_name,
        request_names=list(d.request_names),
        cdi_device_ids=list(d.cdi_device_ids),
        share_id=d.share_id,
    )
