"""A watch-fed cache of the ResourceClaims allocated to this node's pool.

The scheduler writes a claim's allocation before the kubelet can call NodePrepareResources, so
a reflector (``gpuslice_kube.reflector``) that watches claims has it by then in the common case,
and prepare does not have to read the claim from the API (a GET is 2-5 ms of a ~6 ms prepare).
The API stays the authority:

- with a ``label_selector`` (the kubelet plugin's node label) the API server sends only the
  claims it selects, so what a node receives grows with its own claims; a claim the label has
  not reached yet is a miss, read from the API;
- only claims with a result of this driver in this pool are kept whole; of every other claim
  the reflector keeps only its name, UID and resourceVersion (``metadata_only``), so a node
  does not hold other nodes' claims;
- ``get(ref)`` answers only for the UID the kubelet names; anything else (not cached yet,
  another UID, not allocated here) is ``None`` and prepare reads the claim from the API
  (``read(ref)``);
- a driver treats a cached claim it cannot use as a miss and reads the API (the kubelet
  plugin does so on any ``ClaimError``);
- after the driver unprepared a claim (``unprepared(ref)``), its UID is not answered from the
  cache until the cache has seen the claim leave this pool (deallocated or deleted): an
  allocation it holds from before could be the previous one;
- without list/watch permission on ResourceClaims (the chart's RBAC must grant it), the cache
  is off after one log line and every prepare reads the API, as before.

What a lagging watch can still do: hand out a claim's previous allocation in this pool if the
claim was deallocated and allocated again before its first prepare here (a scheduler unreserve
followed by a new pod), faster than the watch delivered it. The overlap check against the
checkpoint still refuses a device in use, so this cannot double-allocate capacity.
"""

from __future__ import annotations

import threading

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_draplugin.kubeapi import ResourceApi
from gpuslice_draplugin.plugin import ClaimRef
from gpuslice_kube.errors import KubeForbiddenError
from gpuslice_kube.raw import Obj, resource_path
from gpuslice_kube.reflector import Reflector, metadata_only, object_key

log = get_logger(__name__)


def allocated_here(claim: Obj, *, driver: str, pool: str) -> bool:
    """The claim has at least one allocation result of ``driver`` in ``pool``."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return any(r.get("driver") == driver and r.get("pool") == pool for r in results)


class ClaimCache:
    """The claims allocated to this node's pool, kept by a reflector; see the module doc."""

    def __init__(
        self, api: ResourceApi, *, driver: str, pool: str, label_selector: str | None = None
    ) -> None:
        """``label_selector``: watch only the claims it selects (the kubelet plugin's: the node
        label the gpuslice controller writes on claims allocated to this node), so the API
        server sends this node the events of its own claims, not of every claim."""
        self.api = api
        self.driver = driver
        self.pool = pool
        self.label_selector = label_selector
        self.path = resource_path(api.server.group_version, "resourceclaims")
        self._claims: dict[str, Obj] = {}  # namespace/name -> claim allocated here
        self._unprepared: set[str] = set()  # UIDs not answered until they leave the pool
        self._lock = threading.Lock()
        self.reflector: Reflector | None = None

    @property
    def enabled(self) -> bool:
        return self.reflector is not None

    def start(self) -> bool:
        """Start watching; False (cache off, logged once) without list permission."""
        try:
            # one page of one claim: the permission check must not walk the collection
            next(self.api.raw.pages(self.path, limit=1, label_selector=self.label_selector))
        except KubeForbiddenError as exc:
            log.warning(
                "claim cache off: no permission to list ResourceClaims; every prepare reads "
                "its claim from the API (grant list and watch on resourceclaims to turn it on)",
                error=str(exc),
            )
            return False
        except GpusliceError as exc:  # the reflector retries with backoff; misses read the API
            log.info("claim cache starts without an initial check", error=str(exc))
        self.reflector = self.new_reflector()
        self.reflector.start()
        return True

    def new_reflector(self) -> Reflector:
        """The reflector that feeds ``observe`` (not started)."""
        return Reflector(
            self.api.raw,
            self.path,
            self.observe,
            keep=metadata_only,
            label_selector=self.label_selector,
        )

    def stop(self) -> None:
        if self.reflector is not None:
            self.reflector.stop()

    def observe(self, event_type: str, claim: Obj) -> None:
        """The reflector's handler (its thread): keep the claims allocated here, drop the
        rest."""
        key = object_key(claim)
        uid = str((claim.get("metadata") or {}).get("uid", ""))
        here = event_type != "DELETED" and allocated_here(claim, driver=self.driver, pool=self.pool)
        with self._lock:
            if here:
                self._claims[key] = claim
                return
            self._claims.pop(key, None)
            self._unprepared.discard(uid)  # it left the pool: what comes next is newer

    def read(self, ref: ClaimRef) -> Obj:
        """The claim as the API has it now (``KubeNotFoundError`` when it does not exist)."""
        return self.api.get_claim(ref.namespace, ref.name)

    def get(self, ref: ClaimRef) -> Obj | None:
        """The cached claim ``ref`` names (same UID, allocated here), or None: read the API."""
        if self.reflector is None or not self.reflector.synced.is_set():
            return None
        with self._lock:
            if ref.uid in self._unprepared:
                return None
            claim = self._claims.get(f"{ref.namespace}/{ref.name}")
        if claim is None or (claim.get("metadata") or {}).get("uid") != ref.uid:
            return None
        return claim

    def unprepared(self, ref: ClaimRef) -> None:
        """The driver unprepared ``ref``: do not answer its UID until it left the pool."""
        if self.reflector is None:
            return
        with self._lock:
            claim = self._claims.get(f"{ref.namespace}/{ref.name}")
            if claim is not None and (claim.get("metadata") or {}).get("uid") == ref.uid:
                self._unprepared.add(ref.uid)
