"""Start-up recovery and periodic reconciliation of records against the GPUs.

``recover`` runs once at start, before the socket opens: it settles every intent a killed
predecessor left. A create intent whose GPU instance exists but was never recorded is rolled
back (compute instances, then the GPU instance): its caller never got an answer and retries, and
CreateInstance is idempotent. Only an instance a process already runs on is kept and recorded,
because destroying it would kill the process. A destroy intent is finished.

``reconcile`` runs at start and then every ``--reconcile-interval``: records whose instance is
gone are dropped, instances without a record are *orphans*. With dynamic MIG an orphan that no
process uses is destroyed (nobody can own it: owners live only in the records); otherwise it is
reported. Every difference is a :class:`Drift`, logged and counted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

from gpuslice_core.errors import GpusliceError, NotFoundError
from gpuslice_core.logging import get_logger
from gpuslice_mig_manager.kube import WARNING, NodeReporter
from gpuslice_mig_manager.manager import MigManager, record_of
from gpuslice_mig_manager.snapshot import GpuSnapshot

log = get_logger(__name__)


@dataclass(frozen=True)
class Drift:
    """One difference between the records and the GPUs."""

    #: vanished | orphan | orphan-destroyed | orphan-in-use | no-compute-instance
    kind: str
    gpu_index: int
    gpu_instance_id: int
    message: str

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.gpu_index}/{self.gpu_instance_id}"


def recover(manager: MigManager) -> list[str]:
    """Settle the intents left by a killed predecessor; returns what was done, one line each."""
    done: list[str] = []
    with manager.lock:
        state = manager.state()
        for key, intent in sorted(state.intents.items()):
            try:
                index = manager.index_of(intent.gpu_uuid)
            except NotFoundError:
                _drop(manager, key)
                done.append(f"{key}: GPU {intent.gpu_uuid} is gone; intent dropped")
                continue
            snap = manager.snapshot(index)
            view = snap.at(intent.placement)
            if view is not None and view.profile_id != intent.profile_id:
                view = None
            if view is None:
                _drop(manager, key, forget=intent.gpu_instance_id, uuid=intent.gpu_uuid)
                done.append(f"{key}: no instance at {intent.placement}; nothing to undo")
            elif intent.op == "create" and view.recorded:
                _drop(manager, key)
                done.append(f"{key}: {view.describe()} was recorded; intent dropped")
            elif view.in_use:
                with manager.store.transaction() as st:
                    st.intents.pop(key, None)
                    st.instances[view.key] = st.instances.get(view.key) or record_of(
                        view, owner=intent.owner, layout=intent.layout
                    )
                done.append(f"{key}: {view.describe()} is in use; kept and recorded")
            else:
                try:
                    manager.destroy_batch(snap, [view])
                except GpusliceError as exc:
                    done.append(f"{key}: could not undo {view.describe()}: {exc}")
                    continue
                _drop(manager, key)
                verb = "rolled back" if intent.op == "create" else "finished destroying"
                done.append(f"{key}: {verb} {view.describe()}")
    for line in done:
        log.warning("recovered interrupted MIG change", action=line)
    return done


def reconcile(manager: MigManager) -> list[Drift]:
    """Compare records with the GPUs, fix what is safe to fix, and report the rest.

    Returns the drift not reported by the previous pass (a lasting difference is reported once,
    and again if it comes back after going away)."""
    drifts: list[Drift] = []
    with manager.lock:
        state = manager.state()
        snaps = {s.info.uuid: s for s in manager.snapshots()}
        for key, record in sorted(state.instances.items()):
            snap = snaps.get(record.gpu_uuid)
            view = snap.instance(record.gpu_instance_id) if snap else None
            if snap is None or view is None or not view.recorded:
                where = f"GPU {snap.index}" if snap else f"GPU {record.gpu_uuid}"
                drifts.append(
                    Drift(
                        "vanished",
                        snap.index if snap else -1,
                        record.gpu_instance_id,
                        f"{record.profile_name} instance {record.gpu_instance_id} at"
                        f" {record.placement} on {where}"
                        + (f" (held by claim {record.owner})" if record.owner else "")
                        + " no longer exists; its record was dropped",
                    )
                )
                with manager.store.transaction() as st:
                    st.instances.pop(key, None)
            elif view.compute_instances == 0:
                drifts.append(
                    Drift(
                        "no-compute-instance",
                        snap.index,
                        view.gpu_instance_id,
                        f"{view.describe()} on {snap.label()} has lost its compute instance",
                    )
                )
            elif view.mig_uuid != record.mig_uuid or view.compute_instance_id != (
                record.compute_instance_id
            ):
                with manager.store.transaction() as st:
                    if key in st.instances:
                        st.instances[key].mig_uuid = view.mig_uuid
                        st.instances[key].compute_instance_id = view.compute_instance_id
        for snap in snaps.values():
            drifts += _orphans(manager, snap)
    fresh = [d for d in drifts if d.key not in manager.reported_drift]
    manager.reported_drift = {d.key for d in drifts}
    for d in fresh:
        manager.metrics.drift.labels(kind=d.kind).inc()
        log.warning(
            "mig drift",
            kind=d.kind,
            gpu=d.gpu_index,
            gpu_instance=d.gpu_instance_id,
            detail=d.message,
        )
    if drifts:
        manager.snapshots()
    return fresh


def _orphans(manager: MigManager, snap: GpuSnapshot) -> list[Drift]:
    drifts = []
    for view in snap.instances:
        if view.recorded:
            continue
        what = f"{view.describe()} on {snap.label()} was not made by gpuslice"
        if not manager.dynamic:
            drifts.append(Drift("orphan", snap.index, view.gpu_instance_id, what))
        elif view.in_use or snap.unplaced_pids:
            pids = ", ".join(str(p) for p in view.pids or snap.unplaced_pids)
            drifts.append(
                Drift(
                    "orphan-in-use",
                    snap.index,
                    view.gpu_instance_id,
                    f"{what}; processes {pids} use it, so it is left alone",
                )
            )
        else:
            try:
                manager.destroy_batch(snap, [view])
            except GpusliceError as exc:
                drifts.append(
                    Drift("orphan", snap.index, view.gpu_instance_id, f"{what}; destroy: {exc}")
                )
                continue
            drifts.append(
                Drift(
                    "orphan-destroyed",
                    snap.index,
                    view.gpu_instance_id,
                    f"{what} and nobody owns it; destroyed (dynamic MIG)",
                )
            )
    return drifts


def _drop(manager: MigManager, key: str, *, forget: int | None = None, uuid: str = "") -> None:
    with manager.store.transaction() as st:
        st.intents.pop(key, None)
        if forget is not None:
            st.instances.pop(f"{uuid}/{forget}", None)


class Reconciler:
    """Runs :func:`reconcile` every ``interval`` seconds and reports new drift as Events."""

    def __init__(self, manager: MigManager, reporter: NodeReporter, interval: float) -> None:
        self.manager = manager
        self.reporter = reporter
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def once(self) -> None:
        try:
            drifts = reconcile(self.manager)
        except GpusliceError as exc:
            log.error("reconcile failed", error=str(exc))
            return
        for drift in drifts:
            self.reporter.event(WARNING, "MigDrift", drift.message)

    def start(self) -> None:
        if self.interval > 0:
            self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The periodic thread once started, None without one (a liveness check asks)."""
        return self._thread if self._thread.ident is not None else None

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        structlog.contextvars.bind_contextvars(component="mig-manager")  # a thread's own context
        while not self._stop.wait(self.interval):
            self.once()
