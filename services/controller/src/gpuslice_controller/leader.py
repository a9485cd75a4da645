"""Leader election through a coordination.k8s.io Lease: the kubernetes client's own.

Every replica serves the webhooks; only the leader writes (the certificates today, the cluster
view's Events later). ``Leadership`` runs the client's ``LeaderElection`` in a thread, calls
``lead(stop)`` when this replica becomes leader, sets ``stop`` when the lease is lost, and then
campaigns again. The client's lock talks to the API through its own ``CoordinationV1Api``; it is
given ours so that it uses the same kubeconfig and credentials.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kubernetes import client
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from gpuslice_core.logging import get_logger

log = get_logger(__name__)

Lead = Callable[[threading.Event], None]


class Leadership:
    """Campaign for ``namespace/name`` as ``identity``; run ``lead`` while leading."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        lead: Lead,
        lease_duration: int = 15,
        renew_deadline: int = 10,
        retry_period: int = 2,
    ) -> None:
        self.lock = LeaseLock(name, namespace, identity)
        self.lock.api_instance = client.CoordinationV1Api(api_client)
        self.identity = identity
        self.lead = lead
        self.timings = (lease_duration, renew_deadline, retry_period)
        self.leading = threading.Event()
        self._stop_leading = threading.Event()
        self._thread: threading.Thread | None = None

    def _started(self) -> None:
        self._stop_leading.clear()
        self.leading.set()
        log.info(
            "became the leader",
            lease=f"{self.lock.namespace}/{self.lock.name}",
            identity=self.identity,
        )
        self.lead(self._stop_leading)

    def _stopped(self) -> None:
        self.leading.clear()
        self._stop_leading.set()
        log.warning("lost the lease; campaigning again", identity=self.identity)

    def _campaign(self) -> None:
        duration, deadline, retry = self.timings
        config = electionconfig.Config(
            self.lock, duration, deadline, retry, self._started, self._stopped
        )
        while True:  # run() returns when the lease is lost
            leaderelection.LeaderElection(config).run()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._campaign, name="leader-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the leader's work. The lease is not released: the client cannot; the next
        leader takes over when it expires (``lease_duration``)."""
        self._stop_leading.set()
