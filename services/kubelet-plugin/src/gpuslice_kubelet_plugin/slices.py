"""Publishing the node's pool as ResourceSlices, and keeping it published.

The pool (name = node name) is owned here, like the upstream resourceslice controller does it:

- slices are built from the inventory and the health taints: at most 128 devices per slice, 64
  when a slice's devices carry taints or consume counters; on 1.35+ counter sets go into slices
  of their own (at most 8 sets each), on older servers each GPU's counter set shares a slice
  with the devices that consume it; an empty pool still gets one empty slice ("driver up, no
  devices");
- every slice carries ``pool.generation`` and the exact ``resourceSliceCount``; any change
  writes every slice with generation + 1 (new and changed slices first, surplus ones deleted
  last), so a consumer never mixes generations;
- a reflector watches this node's slices of this driver (field selector ``spec.nodeName``,
  ``spec.driver``); any event (the kubelet wiping the node's slices at its start or 30 s after
  the driver went away, a human editing one) triggers a reconcile, which lists the slices
  afresh and rewrites the pool when what is there differs from what should be. Other nodes'
  slices are never touched.

A slice is compared by a hash of its content (annotation ``gpu.gpuslice.dev/content``), so the
API server's normalisation of quantities does not look like a change.

Every slice names the Node as its controlling owner (``ownerReferences``, as the upstream
kubelet-plugin helper does), so the garbage collector deletes the pool with its Node: a lost
node's GPUs leave the cluster with it instead of staying published until someone deletes them.
The Node's UID is read whenever the pool is about to be written (a Node deleted and registered
again has a new UID; slices owned by the old one would be collected at once). Without a Node to
read (none yet, or no permission) the slices are published without an owner, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj
from gpuslice_kube.reflector import Reflector
from gpuslice_kubelet_plugin.discovery import DRIVER, CounterSet, Device
from gpuslice_kubelet_plugin.kubeapi import ResourceApi, device_fields, to_version
from gpuslice_kubelet_plugin.metrics import PluginMetrics

log = get_logger(__name__)

MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64
MAX_COUNTER_SETS = 8
CONTENT = f"{DRIVER}/content"
INDEX = f"{DRIVER}/slice-index"


@dataclass(frozen=True)
class PoolContent:
    """What the pool should hold: v1-shaped devices (taints included) and counter sets."""

    devices: tuple[dict[str, Any], ...]
    counter_sets: tuple[CounterSet, ...] = ()


def device_with_taints(device: Device, taints: list[dict[str, Any]]) -> dict[str, Any]:
    out = device.api()
    if taints:
        out["taints"] = taints
    return out


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


def build_specs(content: PoolContent, *, counters_in_own_slices: bool) -> list[dict[str, Any]]:
    """The pool's slices as spec fragments (``devices`` or ``sharedCounters``), in order."""
    devices = list(content.devices)
    sets = list(content.counter_sets)
    specs: list[dict[str, Any]] = []
    if counters_in_own_slices or not sets:
        for i in range(0, len(sets), MAX_COUNTER_SETS):
            specs.append({"sharedCounters": [c.api() for c in sets[i : i + MAX_COUNTER_SETS]]})
        specs += [{"devices": chunk} for chunk in _chunks(devices)]
    else:  # 1.34: a device and the counter set it consumes share a slice
        by_set: dict[str, list[dict[str, Any]]] = {c.name: [] for c in sets}
        plain: list[dict[str, Any]] = []
        for d in devices:
            uses = [c["counterSet"] for c in d.get("consumesCounters") or []]
            (by_set[uses[0]] if uses and uses[0] in by_set else plain).append(d)
        for cset in sets:
            for chunk in _chunks(by_set[cset.name]) or [[]]:
                specs.append({"sharedCounters": [cset.api()], "devices": chunk})
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


def _index(obj: Obj) -> int:
    try:
        return int((obj["metadata"].get("annotations") or {}).get(INDEX, 1 << 30))
    except (TypeError, ValueError):
        return 1 << 30


class SlicePublisher:
    def __init__(
        self,
        api: ResourceApi,
        *,
        node: str,
        driver: str,
        content: Callable[[], PoolContent],
        metrics: PluginMetrics,
        resync: float = 300.0,
        backoff_max: float = 30.0,
        owner: Callable[[], Obj | None] = lambda: None,
    ) -> None:
        self.api = api
        self.owner = owner
        self.node = node
        self.driver = driver
        self.content = content
        self.metrics = metrics
        self.resync = resync
        self.backoff_max = backoff_max
        self.generation = 0
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

    def trigger(self) -> None:
        """Ask for a reconcile (inventory or health changed, or a slice event arrived)."""
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
    def _existing(self) -> list[Obj]:
        # A fresh list, not the reflector's cache: the cache may not have seen our own last
        # writes yet, and acting on it would rewrite the pool for nothing (or hit conflicts).
        items = self.api.raw.list(
            self.api.slices_path,
            field_selector=f"spec.nodeName={self.node},spec.driver={self.driver}",
        )["items"]
        mine = [s for s in items if (s.get("spec") or {}).get("nodeName") == self.node]
        return sorted(mine, key=lambda s: (_index(s), s["metadata"]["name"]))

    def reconcile(self) -> bool:
        """Make the API hold the pool; True when something was written."""
        fragments = build_specs(
            self.content(), counters_in_own_slices=self.api.server.counters_in_own_slices
        )
        hashes = [content_hash(f) for f in fragments]
        existing = self._existing()
        count = len(fragments)
        generations = [int(s["spec"]["pool"].get("generation", 0)) for s in existing]
        top = max([self.generation, *generations])
        current = [
            (
                _index(s),
                (s["metadata"].get("annotations") or {}).get(CONTENT),
                fingerprint(s["spec"]),
            )
            for s in existing
            if int(s["spec"]["pool"].get("generation", 0)) == top
            and int(s["spec"]["pool"].get("resourceSliceCount", 0)) == count
        ]
        wanted = [
            (i, h, fingerprint(f)) for i, (h, f) in enumerate(zip(hashes, fragments, strict=True))
        ]
        same = len(existing) == count and sorted(current) == wanted
        owners = [_owners(s) for s in existing]
        # Owned alike: up to date without asking for the Node (a stale owner UID gets the
        # slices collected, and the reconcile that follows writes them with the new one).
        if same and owners and owners[0] and all(o == owners[0] for o in owners):
            return self._unchanged(top)
        owner = self.owner()
        if same and all(o == ([owner] if owner is not None else []) for o in owners):
            return self._unchanged(top)
        with self.metrics.publish.time():
            self._write(fragments, hashes, existing, top + 1, owner)
        self.generation = top + 1
        self.metrics.published_slices.set(count)
        self.metrics.published_devices.set(sum(len(f.get("devices") or []) for f in fragments))
        self.published.set()
        log.info(
            "published ResourceSlices",
            generation=self.generation,
            slices=count,
            devices=sum(len(f.get("devices") or []) for f in fragments),
            api=self.api.server.group_version,
        )
        return True

    def _unchanged(self, generation: int) -> bool:
        self.generation = generation
        self.published.set()
        return False

    def _body(
        self, index: int, fragment: dict[str, Any], digest: str, generation: int, owner: Obj | None
    ) -> Obj:
        version = self.api.server.version
        spec: dict[str, Any] = {
            "driver": self.driver,
            "nodeName": self.node,
            "pool": {"name": self.node, "generation": generation, "resourceSliceCount": 0},
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
                "annotations": {CONTENT: digest, INDEX: str(index)},
                **({"ownerReferences": [owner]} if owner is not None else {}),
            },
            "spec": spec,
        }

    def _write(
        self,
        fragments: list[dict[str, Any]],
        hashes: list[str],
        existing: list[Obj],
        gen: int,
        owner: Obj | None,
    ) -> None:
        count = len(fragments)
        for index, (fragment, digest) in enumerate(zip(fragments, hashes, strict=True)):
            body = self._body(index, fragment, digest, gen, owner)
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
        for old in existing[count:]:
            with contextlib.suppress(KubeNotFoundError):  # already gone is fine
                self.api.raw.delete(
                    self.api.slice_path(old["metadata"]["name"]),
                    precondition_uid=old["metadata"]["uid"],
                )
