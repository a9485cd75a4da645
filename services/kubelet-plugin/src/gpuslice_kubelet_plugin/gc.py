"""Background upkeep of prepared claims.

The kubelet may never call NodeUnprepareResources for a claim (a node that was down while its
pods were force-deleted, a kubelet restarted with its state lost). Every ``--gc-interval``
seconds the collector reads each prepared claim from the API and unprepares those that are gone
or were re-created under the same name (another UID), and finishes work that dead plugin
instances left half-done (``DeviceState.recover``). A failing API read skips the claim until
the next round; nothing is unprepared on doubt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_draplugin import ClaimRef
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj
from gpuslice_kubelet_plugin.metrics import PluginMetrics
from gpuslice_kubelet_plugin.state import DeviceState

log = get_logger(__name__)


class ClaimCollector:
    def __init__(
        self,
        state: DeviceState,
        read_claim: Callable[[ClaimRef], Obj],
        metrics: PluginMetrics,
        *,
        interval: float = 60.0,
    ) -> None:
        self.state = state
        self.read_claim = read_claim
        self.metrics = metrics
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="claim-gc", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_once()
            except Exception:
                log.exception("claim garbage collection failed; trying again next round")

    def _gone(self, ref: ClaimRef) -> str | None:
        try:
            obj = self.read_claim(ref)
        except KubeNotFoundError:
            return "deleted"
        except GpusliceError as exc:
            log.info("cannot check a prepared claim; keeping it", claim=str(ref), error=str(exc))
            return None
        uid = (obj.get("metadata") or {}).get("uid")
        return None if uid == ref.uid else f"re-created with UID {uid}"

    def run_once(self) -> list[str]:
        """One round; returns the UIDs unprepared."""
        self.state.recover()
        unprepared = []
        for record in self.state.completed():
            ref = ClaimRef(namespace=record.namespace, name=record.name, uid=record.uid)
            why = self._gone(ref)
            if why is None:
                continue
            log.info(
                "unpreparing a claim that left the API", claim=str(ref), claim_uid=ref.uid, why=why
            )
            error = self.state.unprepare([ref])[ref.uid]
            if error is None:
                unprepared.append(ref.uid)
                self.metrics.gc_unprepared.inc()
        return unprepared
