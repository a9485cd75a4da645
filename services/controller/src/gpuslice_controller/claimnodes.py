"""The node label on allocated claims: what lets each node watch its own claims only.

Each kubelet plugin keeps the claims allocated to its node in a watch-fed cache, so prepare
needs no API read. Kubernetes has no field selector on ResourceClaims that names a node, and
RBAC cannot scope a list or a watch to "the claims allocated to this node": a cache that watched
every claim would cost every node every claim event of the cluster (docs/kubelet-plugin.md,
"The claim cache"). The controller, the one component that watches every claim anyway, writes
the node as a label::

    gpu.gpuslice.dev/node=<pool>    on a claim with a result of our driver in <pool>

(our driver's pool is its node's name; ``gpuslice_api.names.node_label_value`` shortens a name
longer than a label value may be) and removes it from a claim that has no such result any more.
Each kubelet plugin watches claims with its own node's label, so the API server filters and a
node receives the events of its own claims only.

Only the leader writes. Claim keys queue up from the watch and a few workers write them (a
claim's key always to the same worker, so its writes keep their order), reading each claim's
newest state from the reflector's cache when it comes to it: a burst of events on one claim
costs at most one write, and a claim whose label already matches costs none (a new
leader's first pass over every claim writes only what is missing). A write is a merge patch of
that one label; it changes nothing else, and the allocation it follows is the scheduler's, so a
write that races a newer allocation is corrected by the event that allocation brings. The label
is a hint, never an authority: a plugin checks the allocation of every claim it uses, and a
claim without the label (not written yet, written by a tenant, no controller) is read from the
API at prepare.
"""

from __future__ import annotations

import queue
import threading

from gpuslice_api.names import DRIVER, NODE_LABEL, node_label_value
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import KubeForbiddenError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kube.reflector import Reflector, object_key

log = get_logger(__name__)

#: Seconds before a failed write is tried again (the API client already retried it).
RETRY_AFTER_S = 5.0


def wanted_label(claim: Obj) -> str | None:
    """The node label ``claim`` should carry: its first pool of our driver, or None."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    pools = sorted(str(r["pool"]) for r in results if r.get("driver") == DRIVER and r.get("pool"))
    return node_label_value(pools[0]) if pools else None


def digest(claim: Obj) -> Obj:
    """What the reflector keeps of a claim: its identity, its label and the label it wants."""
    meta = claim.get("metadata") or {}
    kept = {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta}
    return {
        "metadata": kept,
        "label": (meta.get("labels") or {}).get(NODE_LABEL),
        "wanted": wanted_label(claim),
    }


class ClaimNodeLabels:
    """Keep ``NODE_LABEL`` on every claim equal to its allocation's node, while leading."""

    def __init__(self, raw: RawApi, *, version: str, workers: int = 4) -> None:
        self.raw = raw
        self.path = resource_path(f"resource.k8s.io/{version}", "resourceclaims")
        self.version = version
        self.reflector = Reflector(raw, self.path, self.observe, keep=digest)
        self.writes = 0  # labels sent, written or removed (the bench and tests read it)
        # a claim's key always goes to the same worker: its writes stay in order
        self._queues: list[queue.Queue[str]] = [queue.Queue() for _ in range(workers)]
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._leading = threading.Event()
        self._forbidden_logged = False

    def start(self) -> None:
        self.reflector.start()

    def stop(self) -> None:
        self.reflector.stop()

    def observe(self, event_type: str, claim: Obj) -> None:
        """The reflector's handler: queue a claim whose label differs from its allocation."""
        if event_type == "DELETED" or not self._leading.is_set():
            return
        d = digest(claim)
        if d["label"] != d["wanted"]:
            self._enqueue(object_key(claim))

    def _enqueue(self, key: str) -> None:
        with self._lock:
            if key in self._queued:
                return
            self._queued.add(key)
        self._queues[hash(key) % len(self._queues)].put(key)

    def run(self, stop_leading: threading.Event) -> None:
        """The leader's work: every claim once (what a previous leader left), then the changes
        the watch brings, until ``stop_leading``."""
        self._leading.set()
        try:
            while not self.reflector.synced.wait(0.2):
                if stop_leading.is_set():
                    return
            for key in list(self.reflector.cache):
                self._enqueue(key)
            workers = [
                threading.Thread(
                    target=self._work, args=(q, stop_leading), name=f"claim-nodes-{i}", daemon=True
                )
                for i, q in enumerate(self._queues)
            ]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        finally:
            self._leading.clear()

    def _work(self, keys: queue.Queue[str], stop_leading: threading.Event) -> None:
        """One worker: the claims whose keys hash to its queue, one write at a time."""
        while not stop_leading.is_set():
            try:
                key = keys.get(timeout=0.2)
            except queue.Empty:
                continue
            with self._lock:
                self._queued.discard(key)
            if not self._write(key):
                stop_leading.wait(RETRY_AFTER_S)
                self._enqueue(key)

    def _write(self, key: str) -> bool:
        """Make ``key``'s label match its allocation. False: try again later."""
        current = self.reflector.cache.get(key)
        if current is None or current["label"] == current["wanted"]:
            return True
        meta = current["metadata"]
        path = resource_path(
            f"resource.k8s.io/{self.version}", "resourceclaims", namespace=meta["namespace"]
        )
        patch: Obj = {"metadata": {"labels": {NODE_LABEL: current["wanted"]}}}
        with self._lock:  # counted before it is sent: whoever sees the label sees the count
            self.writes += 1
        try:
            self.raw.patch(f"{path}/{meta['name']}", patch)
        except KubeNotFoundError:
            return True  # deleted meanwhile: its DELETED event follows
        except KubeForbiddenError as exc:
            if not self._forbidden_logged:
                self._forbidden_logged = True
                log.warning(
                    "cannot label claims with their node (grant patch on resourceclaims); "
                    "kubelet plugins read those claims from the API at prepare",
                    error=str(exc),
                )
            return True
        except GpusliceError as exc:
            log.warning("claim node label not written", claim=key, error=str(exc))
            return False
        log.debug("claim node label", claim=key, node=current["wanted"])
        return True
