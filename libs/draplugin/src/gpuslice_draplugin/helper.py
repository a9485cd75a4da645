"""The helper: everything kubelet-facing that a DRA driver needs, around the driver's
``prepare`` and ``unprepare`` (the Python counterpart of k8s.io/dynamic-resource-allocation's
``kubeletplugin.Start``).

``Helper(plugin, driver=…, node=…, raw=…)`` builds every part — it detects the
resource.k8s.io version (``raw`` given), and builds the claim cache, the slice publisher and
both gRPC servers — and serves nothing yet; ``start()`` starts them: the claim cache, the DRA
socket, then the registration socket (the kubelet dials the DRA socket as soon as it has read
the registration), then the publisher once there are pools to publish. ``start(plugin, …)``
does both, as upstream's ``Start`` does. ``stop()`` takes the registration socket away first,
lets in-flight DRA calls finish within the grace period, then stops the publisher and the
cache. Slices stay in the API (a restarted driver takes them over; the kubelet deletes them
30 s after the driver is gone).

Building the helper before the driver's own state lets a driver hand ``helper.claims`` (the
claim cache and API reads) to that state, then start everything in its own order. A driver whose
plugin object needs that state built first (so that nothing is half-built) detects the API and
builds the claim cache itself and passes them as ``api`` and ``claims``; the helper then uses
those instead of its own.

Test switches are options: ``node_v1``/``node_v1beta1``/``registration`` serve less,
``versions``/``plugin_type`` advertise something else, ``sockets`` puts the sockets elsewhere,
``interceptors`` see every call on both sockets, ``raw=None`` runs without an API server (no
publishing, no claims).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from gpuslice_draplugin.claimcache import ClaimCache
from gpuslice_draplugin.kubeapi import ResourceApi, detect, read_node
from gpuslice_draplugin.metrics import HelperMetrics
from gpuslice_draplugin.plugin import HealthSource, Plugin, Pool
from gpuslice_draplugin.server import KubeletServer, Sockets
from gpuslice_draplugin.servicer import HealthStreamServicer
from gpuslice_draplugin.slices import SlicePublisher, node_owner
from gpuslice_kube.raw import Obj, RawApi

REGISTRAR_DIR = Path("/var/lib/kubelet/plugins_registry")
PLUGINS_DIR = Path("/var/lib/kubelet/plugins")


class Helper:
    """A driver's sockets, registration, claims and slices; see the module doc."""

    def __init__(
        self,
        plugin: Plugin,
        *,
        driver: str,
        node: str,
        raw: RawApi | None = None,
        registrar_dir: Path = REGISTRAR_DIR,
        plugins_dir: Path = PLUGINS_DIR,
        pod_uid: str = "",
        sockets: Sockets | None = None,
        health: HealthSource | None = None,
        claim_cache: bool = True,
        metrics: HelperMetrics | None = None,
        workers: int = 16,
        node_v1: bool = True,
        node_v1beta1: bool = True,
        registration: bool = True,
        versions: Sequence[str] | None = None,
        plugin_type: str = "DRAPlugin",
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        api: ResourceApi | None = None,
        claims: ClaimCache | None = None,
    ) -> None:
        """``driver``: the DRA driver name; ``node``: this node (and the name of the pool a
        health source's devices belong to). ``raw``: the API client; it is needed for
        ``publish`` and ``claims``. ``pod_uid``: socket names with a ``-<podUID>`` suffix, so
        two pods can serve during a rolling update. ``health``: serve
        ``v1alpha1.DRAResourceHealth`` from it. ``claim_cache``: keep the claims allocated to
        ``node``'s pool in a watch-fed cache (off: ``claims.get`` always misses). ``metrics``:
        where the helper's metrics go (default: a registry of its own). ``workers``: threads
        for DRA calls. ``api``/``claims``: resource.k8s.io as the driver detected it and the
        claim cache it built (``raw`` is then not needed); the helper starts and stops that
        cache as its own."""
        self.driver = driver
        self.node = node
        self.raw = raw if raw is not None or api is None else api.raw
        self.metrics = metrics or HelperMetrics("draplugin")
        self.sockets = sockets or Sockets.for_driver(
            driver, registrar_dir=registrar_dir, plugins_dir=plugins_dir, pod_uid=pod_uid
        )
        if api is None and raw is not None:
            api = ResourceApi(raw, detect(raw))
        self._api = api
        if claims is None and api is not None:
            claims = ClaimCache(api, driver=driver, pool=node)
        self._claims = claims
        self._claim_cache = claim_cache
        self._lock = threading.Lock()
        self._started = False
        self._publishing = False
        self.publisher = (
            SlicePublisher(
                self._api, node=node, driver=driver, metrics=self.metrics, owner=self._owner
            )
            if self._api
            else None
        )
        self.server = KubeletServer(
            driver=driver,
            sockets=self.sockets,
            plugin=plugin,
            metrics=self.metrics,
            health=HealthStreamServicer(health, node) if health is not None else None,
            node_v1=node_v1,
            node_v1beta1=node_v1beta1,
            registration=registration,
            versions=versions,
            plugin_type=plugin_type,
            workers=workers,
            interceptors=interceptors,
        )

    # ---- what a driver uses ------------------------------------------------------------------
    @property
    def api(self) -> ResourceApi:
        """resource.k8s.io as detected: its version, claims and this node's slices."""
        if self._api is None:
            raise RuntimeError(f"{self.driver}: the helper has no API client")
        return self._api

    @property
    def claims(self) -> ClaimCache:
        """The claims: ``get(ref)`` from the cache (None: read the API), ``read(ref)`` from the
        API, ``unprepared(ref)`` after an unprepare."""
        if self._claims is None:
            raise RuntimeError(f"{self.driver}: the helper reads claims only with an API client")
        return self._claims

    @property
    def registered(self) -> bool:
        """The kubelet said the registration succeeded (and has not refused it since)."""
        return self.server.registered.is_set()

    def publish(self, pools: Mapping[str, Pool]) -> None:
        """This node's pools from now on, by pool name; written in the background once the
        helper runs (a pool left out is deleted). Call it after every change; the helper puts
        back what others change or wipe. A helper that is never given pools never writes a
        slice (and watches none)."""
        if self.publisher is None:
            raise RuntimeError(f"{self.driver}: the helper publishes only with an API client")
        self.publisher.set_pools(pools)
        self._start_publisher()

    def _start_publisher(self) -> None:
        """Once started and given pools: the publisher's first start, and only that."""
        with self._lock:
            publisher = self.publisher
            if publisher is None or publisher.pools is None or self._publishing:
                return
            if not self._started:
                return
            self._publishing = True
        publisher.start()

    def _owner(self) -> Obj | None:
        """The Node as the owner of the pools' slices, read afresh."""
        node = read_node(self._api.raw, self.node) if self._api else None
        return node_owner(node) if node is not None else None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Helper:
        if self._claims is not None and self._claim_cache:
            self._claims.start()
        self.server.start()
        with self._lock:
            self._started = True
        self._start_publisher()  # pools given before start are published now
        return self

    def stop(self, grace: float = 10.0) -> None:
        self.server.stop(grace=grace)
        with self._lock:
            publishing, self._publishing, self._started = self._publishing, False, False
        if publishing and self.publisher is not None:
            self.publisher.stop()
        if self._claims is not None:
            self._claims.stop()


def start(plugin: Plugin, **options: Any) -> Helper:
    """A running helper: ``Helper(plugin, **options).start()`` (see ``Helper``)."""
    return Helper(plugin, **options).start()
