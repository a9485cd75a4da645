"""The pods bound to one node: a reflector (list + watch, ``spec.nodeName=<node>``) feeding one
worker per pod, and the periodic reconcile that unprepares claims of pods that are gone."""

from __future__ import annotations

import threading
from collections import OrderedDict

from e2e.sandbox.nodeagent.config import NodeConfig, Timings
from e2e.sandbox.nodeagent.devicemanager import DeviceManager
from e2e.sandbox.nodeagent.dra_manager import DraManager
from e2e.sandbox.nodeagent.health import NodeHealth
from e2e.sandbox.nodeagent.kubeapi import KubeletApi
from e2e.sandbox.nodeagent.podresources import PodEntry
from e2e.sandbox.nodeagent.podworker import PodWorker
from e2e.sandbox.nodeagent.runtime import Runtime
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_kube.reflector import Reflector

log = get_logger(__name__)

SYNC_TIMEOUT = 30.0
_FINISHED_KEEP = 1000


class PodManager:
    def __init__(
        self,
        config: NodeConfig,
        raw: RawApi,
        api: KubeletApi,
        dra: DraManager,
        devices: DeviceManager,
        runtime: Runtime,
        health: NodeHealth | None = None,
    ) -> None:
        self.config = config
        self.health = health
        self.timings: Timings = config.timings
        self.api = api
        self.dra = dra
        self.devices = devices
        self.runtime = runtime
        self.workers: dict[str, PodWorker] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reconciler: threading.Thread | None = None
        self.reflector = Reflector(
            raw,
            "/api/v1/pods",
            self._on_event,
            field_selector=f"spec.nodeName={config.name}",
            watch_timeout=120,
        )

    def start(self) -> None:
        self.reflector.start()
        if not self.reflector.synced.wait(SYNC_TIMEOUT):
            raise TimeoutError(
                f"node {self.config.name}: the pod list did not sync in {SYNC_TIMEOUT}s"
            )
        self._reconciler = threading.Thread(
            target=self._reconcile_loop, name=f"{self.config.name}-dra-reconcile", daemon=True
        )
        self._reconciler.start()

    def stop(self, kill_containers: bool = True) -> None:
        self._stop.set()
        self.reflector.stop()
        if self._reconciler is not None:
            self._reconciler.join(timeout=10)
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stop(kill_containers)

    def _on_event(self, event_type: str, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if worker is None:
                if event_type == "DELETED" or uid in self._finished or self._stop.is_set():
                    return
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.start()
                return
        worker.update(None if event_type == "DELETED" else pod)

    def worker_done(self, worker: PodWorker) -> None:
        if not worker.finished:
            return  # stopped with the agent, not finished
        with self._lock:
            self.workers.pop(worker.uid, None)
            self._finished[worker.uid] = None
            while len(self._finished) > _FINISHED_KEEP:
                self._finished.popitem(last=False)

    def active_pod_uids(self) -> set[str]:
        with self._lock:
            return {uid for uid, w in self.workers.items() if not w.terminated}

    def active_pods(self) -> list[PodEntry]:
        """The pods the pod resources API lists: not terminated, not rejected at admission."""
        with self._lock:
            workers = [w for w in self.workers.values() if not w.terminated and not w.rejected]
        return [PodEntry(*w.snapshot()) for w in workers]

    def find_pod(self, namespace: str, name: str) -> PodEntry | None:
        """An active pod, else a pod bound here that is no longer active (no resources)."""
        for entry in self.active_pods():
            meta = entry.pod["metadata"]
            if meta["namespace"] == namespace and meta["name"] == name:
                return entry
        obj = self.reflector.cache.get(f"{namespace}/{name}")
        return PodEntry(obj, active=False) if obj is not None else None

    def reconcile(self) -> None:
        active = self.active_pod_uids()
        self.dra.reconcile(active)
        with self._lock:
            known = set(self.workers)
        for uid in self.devices.pod_uids() - known:
            self.devices.free(uid)

    def _reconcile_loop(self) -> None:
        while not self._stop.wait(self.timings.dra_reconcile):
            try:
                self.reconcile()
            except Exception:
                log.exception("DRA reconcile failed", node=self.config.name)

    def poke(self, uids: set[str]) -> None:
        """Sync these pods now (their devices' health changed)."""
        with self._lock:
            workers = [w for uid, w in self.workers.items() if uid in uids]
        for w in workers:
            w.poke()

    def worker(self, uid: str) -> PodWorker | None:
        with self._lock:
            return self.workers.get(uid)
