"""One pod on one node, from admission to the final DELETE (docs/node-agent.md, "What it
simulates": DRA manager, Prepare failure, Containers of a pod, Termination, Device plugins, Pod
status). Each pod has a worker thread; the pod manager feeds it the latest pod object.

Start: device-plugin allocation at admission (failure: phase Failed, UnexpectedAdmissionError)
→ DRA validation + NodePrepareResources (failure: Warning FailedPrepareDynamicResources, pod
stays Pending with ContainerCreating and PodReadyToStartContainers=False, retried with
backoff) → the containers (``podcontainers.py``) with their CDI devices.
Termination (deletionTimestamp, disappearance, or every container done): stop the containers
(SIGTERM, SIGKILL after the grace), NodeUnprepareResources when this was the claim's last
local pod (retried until it succeeds), free devices, report the terminal phase, and only then —
for a deleted pod — DELETE it with grace 0 and a UID precondition.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from e2e.sandbox.nodeagent import health, podstatus
from e2e.sandbox.nodeagent.claims import ClaimError, PodClaim, container_cdi_ids, pod_claims
from e2e.sandbox.nodeagent.containers import build_config
from e2e.sandbox.nodeagent.devicemanager import AdmissionError
from e2e.sandbox.nodeagent.dra_manager import PrepareError, UnprepareError
from e2e.sandbox.nodeagent.podcontainers import ContainerRun, PodContainers
from e2e.sandbox.nodeagent.runtime import ContainerConfig
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import ConflictError, KubeError, KubeInvalidError, KubeNotFoundError
from gpuslice_kube.raw import Obj

if TYPE_CHECKING:
    from e2e.sandbox.nodeagent.pods import PodManager

log = get_logger(__name__)

TERMINAL = ("Succeeded", "Failed")


def _rv(obj: Obj) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except ValueError:
        return 0


class PodWorker:
    def __init__(self, manager: PodManager, pod: Obj) -> None:
        self.m = manager
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.ref = f"{meta['namespace']}/{meta['name']}"
        self.gone = False
        self.admitted = False
        self.rejected = False
        self.sandbox_ready = False
        self.terminated = False  # containers stopped, claims and devices released
        self.finished = False  # nothing left to do: the worker thread ends
        self.claims: list[PodClaim] = []
        self.dp: dict[str, list[Obj]] = {}
        self._backoff = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.containers = PodContainers(
            pod, manager.runtime, manager.timings, self._container_event, self.ref
        )
        self.thread = threading.Thread(target=self._loop, name=f"pod-{self.ref}", daemon=True)

    # ---- feeding ------------------------------------------------------------------------------
    def update(self, pod: Obj | None) -> None:
        with self._lock:
            if pod is None:
                self.gone = True
            elif _rv(pod) >= _rv(self.pod):
                self.pod = pod
        self._wake.set()

    def start(self) -> None:
        self.thread.start()

    def stop(self, kill_containers: bool, grace: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=30)
        if kill_containers:
            self.containers.stop_all(grace, announce=False)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                delay = self.sync()
            except Exception:
                log.exception("pod sync crashed", pod=self.ref)
                delay = self.m.timings.pod_backoff_max
            if self.finished:
                break
            self._wake.wait(delay)
            self._wake.clear()
        self.m.worker_done(self)

    # ---- sync ---------------------------------------------------------------------------------
    def sync(self) -> float:
        with self._lock:
            pod, gone = self.pod, self.gone
        t = self.m.timings
        if gone or pod["metadata"].get("deletionTimestamp"):
            return self._terminate(pod, gone)
        if self.terminated or self.rejected:
            return t.pod_resync
        if not self.admitted:
            if (pod.get("status") or {}).get("phase") in TERMINAL:
                self.terminated = True  # finished before this agent started
                return t.pod_resync
            if self._adopt(pod):
                self.admitted = self.sandbox_ready = True
            else:
                try:
                    self.dp = self.m.devices.allocate(pod)
                except AdmissionError as exc:
                    self._reject(pod, f"Allocate failed due to {exc}, which is unexpected")
                    return t.pod_resync
                self.admitted = True
        if not self.sandbox_ready:
            try:
                self.claims = self.m.dra.prepare(pod)
            except PrepareError as exc:
                message = f"Failed to prepare dynamic resources: prepare dynamic resources: {exc}"
                log.warning("prepare failed", pod=self.ref, error=str(exc))
                self._event(pod, "Warning", "FailedPrepareDynamicResources", message)
                self._report(pod)
                return self._next_backoff()
            self.sandbox_ready = True
            self._backoff = 0.0
        self.containers.step(lambda run: self._container_config(pod, run))
        ph = self.containers.phase(terminal=False)
        if ph in TERMINAL:
            return self._complete(pod, ph)
        self._report(pod, ph)
        return self.containers.next_delay()

    def _next_backoff(self) -> float:
        t = self.m.timings
        self._backoff = min(max(self._backoff * 2, t.pod_backoff_initial), t.pod_backoff_max)
        return self._backoff

    def _adopt(self, pod: Obj) -> bool:
        """Containers a previous agent started, with their claims prepared: take them over."""
        if not self.containers.adopt(pod):
            return False
        try:
            self.claims = pod_claims(pod)
        except ClaimError:
            self.claims = []
        if self.claims and not self.m.dra.prepared_for(self.uid):
            return False
        log.info("adopted running pod", pod=self.ref)
        return True

    def _container_config(self, pod: Obj, run: ContainerRun) -> ContainerConfig:
        ns = pod["metadata"]["namespace"]
        cdi_ids = container_cdi_ids(
            pod, run.spec, self.claims, lambda name: self.m.dra.devices(ns, name)
        )
        cfg = build_config(
            pod,
            run.spec,
            node_name=self.m.config.name,
            cdi_root=self.m.config.cdi_dir,
            cdi_ids=cdi_ids,
            device_plugin=[] if run.view.init else self.dp.get(run.view.name, []),
            workdir=self.m.config.pods_dir / self.uid,
        )
        self.m.devices.pre_start(self.uid, run.key)
        return cfg

    # ---- status, events -------------------------------------------------------------------------
    def _report(self, pod: Obj, ph: str | None = None, terminal: bool = False) -> None:
        inits, apps = self.containers.views()
        status = podstatus.build(
            pod,
            pod_phase=ph or self.containers.phase(terminal=terminal),
            sandbox_ready=self.sandbox_ready and not terminal,
            inits=inits,
            apps=apps,
            allocated=self._allocated(pod),
        )
        self._patch(pod, status)

    def _allocated(self, pod: Obj) -> dict[str, list[Obj]]:
        """Device health of the containers' claims (with the ResourceHealthStatus gate)."""
        node_health = self.m.health
        if node_health is None or not self.claims:
            return {}
        ns = pod["metadata"]["namespace"]
        return health.allocated_resources_status(
            pod,
            self.claims,
            lambda name: self.m.dra.driver_devices(ns, name),
            node_health.cache.get,
            messages=node_health.messages,
        )

    def _patch(self, pod: Obj, status: Obj) -> None:
        if not podstatus.changed(pod, status):
            return
        try:
            updated = self.m.api.patch_pod_status(pod, status)
        except (KubeNotFoundError, KubeInvalidError) as exc:
            log.info("pod gone or replaced while patching status", pod=self.ref, error=str(exc))
            with self._lock:
                self.gone = True
            return
        except KubeError as exc:
            log.warning("pod status patch failed", pod=self.ref, error=str(exc))
            return
        if self.m.health is not None:
            self.m.health.observe_readback(status, updated)
        self.update(updated)

    def snapshot(self) -> tuple[Obj, list[PodClaim]]:
        """The latest pod object and its claims (for the pod resources API)."""
        with self._lock:
            return self.pod, list(self.claims)

    def poke(self) -> None:
        """Sync now (device health of its claims changed)."""
        self._wake.set()

    def _event(self, pod: Obj, etype: str, reason: str, message: str, field_path: str = "") -> None:
        try:
            self.m.api.event(pod, etype, reason, message, field_path)
        except KubeError as exc:
            log.warning("event not recorded", pod=self.ref, reason=reason, error=str(exc))

    def _container_event(self, etype: str, reason: str, message: str, field_path: str) -> None:
        with self._lock:
            pod = self.pod
        self._event(pod, etype, reason, message, field_path)

    def _reject(self, pod: Obj, message: str) -> None:
        reason = "UnexpectedAdmissionError"
        log.warning("pod rejected at admission", pod=self.ref, error=message)
        self.rejected = True
        self._event(pod, "Warning", reason, message)
        self._patch(pod, podstatus.rejected(pod, reason, message))

    # ---- termination ---------------------------------------------------------------------------
    def _release(self) -> bool:
        """Unprepare claims and free devices; False (retry later) when unprepare failed."""
        try:
            self.m.dra.unprepare(self.uid)
        except UnprepareError as exc:
            log.warning("unprepare failed; will retry", pod=self.ref, error=str(exc))
            return False
        self.m.devices.free(self.uid)
        self.terminated = True
        return True

    def _complete(self, pod: Obj, ph: str) -> float:
        """Every container is done and the restart policy keeps them so: the pod is terminal."""
        if not self.terminated and not self._release():
            return self._next_backoff()
        self._report(pod, ph)
        return self.m.timings.pod_resync

    def _grace(self, pod: Obj) -> float:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
        return float(self.m.timings.default_grace if grace is None else grace)

    def _terminate(self, pod: Obj, gone: bool) -> float:
        if not self.terminated:
            self.containers.stop_all(self._grace(pod))
            if not self._release():
                return self._next_backoff()
        if gone:
            self.finished = True
            return 0.0
        if not self.rejected:
            self._report(pod, terminal=True)
        with self._lock:
            if self.gone:
                self.finished = True
                return 0.0
            pod = self.pod
        if not pod["metadata"].get("deletionTimestamp"):
            return self.m.timings.pod_resync
        try:
            self.m.api.delete_pod_finally(pod)
        except (KubeNotFoundError, ConflictError, KubeInvalidError):
            pass
        except KubeError as exc:
            log.warning("final pod delete failed", pod=self.ref, error=str(exc))
            return self._next_backoff()
        log.info("pod deleted", pod=self.ref)
        self.finished = True
        return 0.0
