"""Publishing a driver's pools on this node as ResourceSlices, and keeping them published.

The pools (``Pool``: plain v1-shaped devices and counter sets, by pool name; the kubelet plugin
publishes one, named after the node) are owned here, as the upstream resourceslice controller
owns them:

- slices are cut from each pool: at most 128 devices per slice, 64 when a slice's devices
  carry taints or consume counters; on 1.35+ counter sets go into slices of their own (at most
  8 sets each), on older servers each counter set shares a slice with the devices that consume
  it; an empty pool still gets one empty slice ("driver up, no devices");
- every slice carries its pool's ``generation`` and the exact ``resourceSliceCount``; any change
  writes every slice of the pool with generation + 1 (new and changed slices first, surplus
  ones deleted last), so a consumer never mixes generations; the slices of a pool no longer
  published are deleted;
- a reflector watches this node's slices of this driver (field selector ``spec.nodeName``,
  ``spec.driver``); any event (the kubelet wiping the node's slices at its start or 30 s after
  the driver went away, a human editing one) triggers a reconcile, which lists the slices
  afresh and rewrites a pool when what is there differs from what should be. Other nodes'
  slices are never touched. Nothing is written or deleted before the first ``set_pools``.

A slice is compared by a hash of its content (annotation ``<driver>/content``), so the API
server's normalisation of quantities does not look like a change.

Every slice names the Node as its controlling owner (``ownerReferences``, as the upstream
kubelet-plugin helper does), so the garbage collector deletes the pools with their Node: a lost
node's devices leave the cluster with it instead of staying published until someone deletes
them. The Node's UID is read whenever a pool is about to be written (a Node deleted and
registered again has a new UID; slices owned by the old one would be collected at once).
Without a Node to read (none yet, or no permission) the slices are published without an owner.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_draplugin.kubeapi import ResourceApi, device_fields, to_version
from gpuslice_draplugin.metrics import HelperMetrics
from gpuslice_draplugin.plugin import Pool
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj
from gpuslice_kube.reflector import Reflector

log = get_logger(__name__)

MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64
MAX_COUNTER_SETS = 8


def _advanced(device: dict[str, Any]) -> bool:
    return bool(device.get("taints") or device.get("consumesCounters"))


def _chunks(devices: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Greedy chunks in order: 128 per slice, 64 once a chunk holds an advanced device."""
    out: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for device in devices:
        candidate = [*current, device]
        limit = MAX_DEVICES_ADVANCED if any(_advanced(d) for d in candidate) else MAX_DEVICES
        if len(candidate) > limit:
            out.append(current)
            current = [device]
        else:
            current = candidate
    if current:
        out.append(current)
    return out


def build_specs(pool: Pool, *, counters_in_own_slices: bool) -> list[dict[str, Any]]:
    """The pool's slices as spec fragments (``devices`` or ``sharedCounters``), in order."""
    devices = [dict(d) for d in pool.devices]
    sets = [dict(c) for c in pool.shared_counters]
    specs: list[dict[str, Any]] = []
    if counters_in_own_slices or not sets:
        for i in range(0, len(sets), MAX_COUNTER_SETS):
            specs.append({"sharedCounters": sets[i : i + MAX_COUNTER_SETS]})
        specs += [{"devices": chunk} for chunk in _chunks(devices)]
    else:  # 1.34: a device and the counter set it consumes share a slice
        by_set: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in sets}
        plain: list[dict[str, Any]] = []
        for d in devices:
            uses = [c["counterSet"] for c in d.get("consumesCounters") or []]
            (by_set[uses[0]] if uses and uses[0] in by_set else plain).append(d)
        for cset in sets:
            for chunk in _chunks(by_set[cset["name"]]) or [[]]:
                specs.append({"sharedCounters": [cset], "devices": chunk})
        specs += [{"devices": chunk} for chunk in _chunks(plain)]
    return specs or [{"devices": []}]


def content_hash(fragment: dict[str, Any]) -> str:
    canonical = json.dumps(fragment, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def fingerprint(fragment: dict[str, Any]) -> str:
    """What must match between a fragment and a slice read back, whatever the API server
    normalised: device names, their taints, counter set names. Catches a slice edited by hand
    behind the content annotation's back."""
    parts = []
    for device in fragment.get("devices") or []:
        fields = device_fields(device)
        taints = sorted(
            (t.get("key", ""), t.get("value", ""), t.get("effect", ""))
            for t in fields.get("taints") or []
        )
        parts.append((device["name"], taints))
    sets = sorted(c["name"] for c in fragment.get("sharedCounters") or [])
    return json.dumps([parts, sets])


def node_owner(node: Obj) -> Obj:
    """The owner reference that makes ``node`` the controller of its pool's slices."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "name": node["metadata"]["name"],
        "uid": node["metadata"]["uid"],
        "controller": True,
    }


def _owners(obj: Obj) -> list[Obj]:
    return list((obj.get("metadata") or {}).get("ownerReferences") or [])


def _pool_name(obj: Obj) -> str:
    return str(((obj.get("spec") or {}).get("pool") or {}).get("name") or "")


def _pool_field(obj: Obj, key: str) -> int:
    return int(obj["spec"]["pool"].get(key, 0))


class SlicePublisher:
    """This node's pools of ``driver`` in the API, kept as the last ``set_pools`` said."""

    def __init__(
        self,
        api: ResourceApi,
        *,
        node: str,
        driver: str,
        metrics: HelperMetrics,
        resync: float = 300.0,
        backoff_max: float = 30.0,
        owner: Callable[[], Obj | None] = lambda: None,
    ) -> None:
        self.api = api
        self.owner = owner
        self.node = node
        self.driver = driver
        self.metrics = metrics
        self.resync = resync
        self.backoff_max = backoff_max
        self.content_key = f"{driver}/content"
        self.index_key = f"{driver}/slice-index"
        self.generations: dict[str, int] = {}  # per pool: the last one written or found
        self._pools: dict[str, Pool] | None = None  # None: nothing to publish yet
        self._pools_lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = threading.Event()  # set after the first successful reconcile
        self.reflector = Reflector(
            api.raw,
            api.slices_path,
            lambda _type, _obj: self.trigger(),
            field_selector=f"spec.nodeName={node},spec.driver={driver}",
        )

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.reflector.start()
        self._thread = threading.Thread(target=self._run, name="slices", daemon=True)
        self._thread.start()
        self.trigger()

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        self.reflector.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def pools(self) -> dict[str, Pool] | None:
        """The pools as last set; None before the first ``set_pools``."""
        with self._pools_lock:
            return self._pools

    def set_pools(self, pools: Mapping[str, Pool]) -> None:
        """What this node's pools should hold from now on (a pool left out is deleted)."""
        with self._pools_lock:
            self._pools = dict(pools)
        self.trigger()

    def trigger(self) -> None:
        """Ask for a reconcile (the pools changed, or a slice event arrived)."""
        self._dirty.set()

    def _run(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            self._dirty.wait(self.resync)
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                self.reconcile()
                delay = 0.2
            except GpusliceError as exc:
                log.warning(
                    "publishing ResourceSlices failed; retrying", error=str(exc), retry_in_s=delay
                )
                self._dirty.set()
                if self._stop.wait(delay):
                    return
                delay = min(delay * 2, self.backoff_max)

    # ---- reconcile -------------------------------------------------------------------------
    def _index(self, obj: Obj) -> int:
        try:
            return int((obj["metadata"].get("annotations") or {}).get(self.index_key, 1 << 30))
        except (TypeError, ValueError):
            return 1 << 30

    def _existing(self) -> dict[str, list[Obj]]:
        """This node's slices of this driver by pool name, each pool's in slice-index order."""
        # A fresh list, not the reflector's cache: the cache may not have seen our own last
        # writes yet, and acting on it would rewrite the pool for nothing (or hit conflicts).
        items = self.api.raw.list(
            self.api.slices_path,
            field_selector=f"spec.nodeName={self.node},spec.driver={self.driver}",
        )["items"]
        pools: dict[str, list[Obj]] = {}
        for s in items:
            if (s.get("spec") or {}).get("nodeName") == self.node:
                pools.setdefault(_pool_name(s), []).append(s)
        for slices in pools.values():
            slices.sort(key=lambda s: (self._index(s), s["metadata"]["name"]))
        return pools

    def reconcile(self) -> bool:
        """Make the API hold the pools; True when something was written or deleted."""
        pools = self.pools
        if pools is None:
            return False
        existing = self._existing()
        owner_read: list[Obj | None] = []

        def owner() -> Obj | None:  # read at most once per reconcile, and only when needed
            if not owner_read:
                owner_read.append(self.owner())
            return owner_read[0]

        wrote = False
        slices = devices = 0
        for name, pool in pools.items():
            fragments = build_specs(
                pool, counters_in_own_slices=self.api.server.counters_in_own_slices
            )
            wrote |= self._reconcile_pool(name, fragments, existing.pop(name, []), owner)
            slices += len(fragments)
            devices += sum(len(f.get("devices") or []) for f in fragments)
        for name, stale in existing.items():  # pools no longer published
            self._delete(stale)
            self.generations.pop(name, None)
            log.info("deleted the ResourceSlices of a pool no longer published", pool=name)
            wrote = True
        self.metrics.published_slices.set(slices)
        self.metrics.published_devices.set(devices)
        self.published.set()
        return wrote

    def _reconcile_pool(
        self,
        name: str,
        fragments: list[dict[str, Any]],
        existing: list[Obj],
        owner: Callable[[], Obj | None],
    ) -> bool:
        hashes = [content_hash(f) for f in fragments]
        count = len(fragments)
        top = max(
            [self.generations.get(name, 0), *(_pool_field(s, "generation") for s in existing)]
        )
        current = [
            (
                self._index(s),
                (s["metadata"].get("annotations") or {}).get(self.content_key),
                fingerprint(s["spec"]),
            )
            for s in existing
            if _pool_field(s, "generation") == top and _pool_field(s, "resourceSliceCount") == count
        ]
        wanted = [
            (i, h, fingerprint(f)) for i, (h, f) in enumerate(zip(hashes, fragments, strict=True))
        ]
        same = len(existing) == count and sorted(current) == wanted
        owners = [_owners(s) for s in existing]
        # Owned alike: up to date without asking for the Node (a stale owner UID gets the
        # slices collected, and the reconcile that follows writes them with the new one).
        if same and owners and owners[0] and all(o == owners[0] for o in owners):
            self.generations[name] = top
            return False
        node = owner()
        if same and all(o == ([node] if node is not None else []) for o in owners):
            self.generations[name] = top
            return False
        with self.metrics.publish.time():
            self._write(name, fragments, hashes, existing, top + 1, node)
        self.generations[name] = top + 1
        log.info(
            "published ResourceSlices",
            pool=name,
            generation=top + 1,
            slices=count,
            devices=sum(len(f.get("devices") or []) for f in fragments),
            api=self.api.server.group_version,
        )
        return True

    def _body(
        self,
        pool: str,
        index: int,
        fragment: dict[str, Any],
        digest: str,
        generation: int,
        owner: Obj | None,
    ) -> Obj:
        version = self.api.server.version
        spec: dict[str, Any] = {
            "driver": self.driver,
            "nodeName": self.node,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": 0},
        }
        if "sharedCounters" in fragment:
            spec["sharedCounters"] = fragment["sharedCounters"]
        if "devices" in fragment:
            spec["devices"] = [to_version(d, version) for d in fragment["devices"]]
        return {
            "apiVersion": self.api.server.group_version,
            "kind": "ResourceSlice",
            "metadata": {
                "generateName": f"{self.node}-{self.driver}-",
                "annotations": {self.content_key: digest, self.index_key: str(index)},
                **({"ownerReferences": [owner]} if owner is not None else {}),
            },
            "spec": spec,
        }

    def _write(
        self,
        pool: str,
        fragments: list[dict[str, Any]],
        hashes: list[str],
        existing: list[Obj],
        gen: int,
        owner: Obj | None,
    ) -> None:
        count = len(fragments)
        for index, (fragment, digest) in enumerate(zip(fragments, hashes, strict=True)):
            body = self._body(pool, index, fragment, digest, gen, owner)
            body["spec"]["pool"]["resourceSliceCount"] = count
            if index < len(existing):
                old = existing[index]
                metadata = body["metadata"]
                metadata.pop("generateName")
                metadata["name"] = old["metadata"]["name"]
                metadata["resourceVersion"] = old["metadata"]["resourceVersion"]
                self.api.raw.replace(self.api.slice_path(old["metadata"]["name"]), body)
            else:
                self.api.raw.create(self.api.slices_path, body)
        self._delete(existing[count:])

    def _delete(self, slices: list[Obj]) -> None:
        for old in slices:
            with contextlib.suppress(KubeNotFoundError):  # already gone is fine
                self.api.raw.delete(
                    self.api.slice_path(old["metadata"]["name"]),
                    precondition_uid=old["metadata"]["uid"],
                )
