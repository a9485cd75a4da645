"""The cluster view: every device our driver publishes, who holds what of it, its taints.

What is kept, per object, is the reduced record of ``objects`` and nothing else: a device's
identity, totals, published taints and its attribute/capacity maps (selectors need them); a
claim's requests, allocation results and reservations; a pod's claims and placement; a taint
rule's selector and taint; a DeviceClass's selectors. Everything else is derived when asked:
used and free cores and memory, claims and pods per device, taints from rules, cordons. So the
memory per GPU is its device record, and what a claim costs does not grow with the GPUs.

``ClusterView.apply(kind, event, obj)`` takes one change, as a reflector reports it
(``ADDED``/``MODIFIED``/``DELETED``); ``ClusterView.build`` takes whole lists. No API calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from gpuslice_api.names import DRIVER
from gpuslice_core.errors import NotFoundError
from gpuslice_view.live import NodeLive, ShareLive
from gpuslice_view.objects import (
    CORDON_KEY,
    Claim,
    ClaimKey,
    Device,
    DeviceKey,
    Obj,
    Pod,
    Share,
    SliceContent,
    Taint,
    TaintRule,
    claim_from,
    class_selectors,
    pod_from,
    slice_from,
    taint_rule_from,
)

KINDS = ("ResourceSlice", "ResourceClaim", "Pod", "DeviceClass", "DeviceTaintRule")


K = TypeVar("K")
V = TypeVar("V")


def _put(store: dict[K, V], key: K, value: V | None) -> None:
    """Keep ``value`` under ``key``; None (deleted, or nothing to keep) forgets the key."""
    if value is None:
        store.pop(key, None)
    else:
        store[key] = value


@dataclass(frozen=True)
class Usage:
    """What is allocated on one device (derived)."""

    device: Device
    shares: tuple[Share, ...]
    cores: int
    memory: int

    @property
    def free_cores(self) -> int:
        return max(self.device.cores - self.cores, 0)

    @property
    def free_memory(self) -> int:
        return max(self.device.memory - self.memory, 0)

    @property
    def full(self) -> bool:
        """Nothing more fits: a MIG device in use, or a GPU without free cores or memory."""
        if not self.device.shareable:
            return bool(self.shares)
        return self.free_cores == 0 or self.free_memory == 0


@dataclass(frozen=True)
class Live:
    """What a device's enforcer measures (derived from the node's latest scrape).

    ``state``: ``ok``; ``unreachable`` or ``stale`` (figures unknown, not old ones shown as
    current); ``unknown`` (no enforcer found on the node). ``memory_used``/``sm_used``: the sum
    over the shares the enforcer reports on the device, None unless ``ok``; ``shares``: per
    allocation, by (namespace, claim)."""

    state: str
    age: float | None = None
    error: str = ""
    memory_used: int | None = None
    sm_used: float | None = None
    shares: Mapping[ClaimKey, ShareLive] = field(default_factory=dict)


UNKNOWN = Live("unknown")


@dataclass
class ClusterView:
    driver: str = DRIVER
    slices: dict[str, SliceContent] = field(default_factory=dict)
    claims: dict[ClaimKey, Claim] = field(default_factory=dict)
    pods: dict[ClaimKey, Pod] = field(default_factory=dict)
    classes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rules: dict[str, TaintRule] = field(default_factory=dict)
    live: dict[str, NodeLive] = field(default_factory=dict)
    """Per node, the latest scrape of its enforcer (``gpuslice_view.live``); set whole."""
    live_stale_after: float = 60.0
    """Seconds after which a node's last good scrape no longer counts as current."""
    _index: dict[DeviceKey, Device] | None = field(default=None, repr=False, compare=False)
    """Devices by key, rebuilt on the first lookup after a slice changed (derived, not state)."""
    _uids: dict[str, ClaimKey] | None = field(default=None, repr=False, compare=False)
    """Claim keys by UID, rebuilt on the first lookup after a claim changed (derived)."""

    @classmethod
    def build(
        cls,
        *,
        slices: Iterable[Obj] = (),
        claims: Iterable[Obj] = (),
        pods: Iterable[Obj] = (),
        classes: Iterable[Obj] = (),
        rules: Iterable[Obj] = (),
        driver: str = DRIVER,
    ) -> ClusterView:
        view = cls(driver=driver)
        for kind, objs in zip(KINDS, (slices, claims, pods, classes, rules), strict=True):
            for obj in objs:
                view.apply(kind, "ADDED", obj)
        return view

    def apply(self, kind: str, event: str, obj: Obj) -> None:
        """One change of one object (``kind`` as in ``KINDS``)."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        key = (str(meta.get("namespace", "")), name)
        deleted = event == "DELETED"
        if kind == "ResourceSlice":
            _put(self.slices, name, None if deleted else slice_from(obj, self.driver))
            self._index = None
        elif kind == "ResourceClaim":
            _put(self.claims, key, None if deleted else claim_from(obj))
            self._uids = None
        elif kind == "Pod":
            _put(self.pods, key, None if deleted else pod_from(obj))
        elif kind == "DeviceClass":
            _put(self.classes, name, None if deleted else class_selectors(obj))
        elif kind == "DeviceTaintRule":
            _put(self.rules, name, None if deleted else taint_rule_from(obj))
        else:
            raise ValueError(f"the view keeps no {kind}; it keeps {', '.join(KINDS)}")

    # --- derived -------------------------------------------------------------------------

    def devices(self) -> list[Device]:
        """Every device, node by node; of a pool only the slices of its newest generation."""
        newest: dict[str, int] = {}
        for content in self.slices.values():
            newest[content.pool] = max(newest.get(content.pool, 0), content.generation)
        devices = [
            d
            for content in self.slices.values()
            if content.generation == newest[content.pool]
            for d in content.devices
        ]
        return sorted(
            devices, key=lambda d: (d.node, d.index if d.index is not None else -1, d.name)
        )

    def taints(self, device: Device) -> tuple[Taint, ...]:
        """The device's published taints and those of the taint rules that select it."""
        ruled = tuple(r.taint for r in self.rules.values() if r.selects(device))
        return device.taints + ruled

    def cordon(self, device: Device) -> Taint | None:
        return next((t for t in self.taints(device) if t.key == CORDON_KEY and t.rule), None)

    def usage(self) -> dict[DeviceKey, Usage]:
        """Per device: the shares on it and the cores and memory they take."""
        shares: dict[DeviceKey, list[Share]] = {}
        for claim in self.claims.values():
            for share in claim.shares:
                shares.setdefault(share.device, []).append(share)
        out = {}
        for device in self.devices():
            on = tuple(shares.get(device.key, ()))
            cores = sum(device.cores if s.cores is None else s.cores for s in on)
            memory = sum(device.memory if s.memory is None else s.memory for s in on)
            out[device.key] = Usage(device, on, cores, memory)
        return out

    def live_of(self, device: Device, now: float) -> Live:
        """The enforcer's figures for ``device`` at wall-clock time ``now``."""
        node = self.live.get(device.node)
        if node is None:
            return UNKNOWN
        state = node.state_at(now, self.live_stale_after)
        age = max(now - node.at, 0.0)
        if state != "ok":
            return Live(state, age, node.error)
        on = [
            (uid, share)
            for (uid, uuid), share in node.shares.items()
            if device.uuid and uuid.lower() == device.uuid.lower()
        ]
        # The enforcer names shares by claim UID. A UID no claim here has (deleted since, or
        # not seen yet) still counts in the device's total, but has no name to be shown under.
        names = self._claims_by_uid()
        named = {names[uid]: share for uid, share in on if uid in names}
        memory = sum(s.memory_used for _, s in on)
        sm = sum(s.sm_used for _, s in on)
        return Live("ok", age, "", memory, sm, named)

    def _claims_by_uid(self) -> dict[str, ClaimKey]:
        if self._uids is None:
            self._uids = {c.uid: c.key for c in self.claims.values() if c.uid}
        return self._uids

    def device_of(self, key: DeviceKey) -> Device | None:
        if self._index is None:
            self._index = {d.key: d for d in self.devices()}
        return self._index.get(key)

    def ours(self, claim: Claim) -> bool:
        """Whether a claim is on our devices or asks a DeviceClass that names our driver."""
        if any(s.device[0] == self.driver for s in claim.shares):
            return True
        classes = {r.device_class for r in claim.requests} | {
            a.device_class for r in claim.requests for a in r.alternatives
        }
        return any(
            any(self.driver in expr for expr in self.classes.get(c, ())) for c in classes if c
        )

    def find(self, ref: str) -> Device:
        """The device a user names: a GPU or MIG UUID, ``<node>/<index>`` (a whole GPU) or
        ``<node>/<device name>``. ``NotFoundError`` names what was given and what exists."""
        devices = self.devices()
        wanted = ref.strip()
        if "/" in wanted:
            node, _, what = wanted.partition("/")
            on_node = [d for d in devices if d.node == node]
            if not on_node:
                nodes = sorted({d.node for d in devices})
                raise NotFoundError(
                    f"no GPU {ref!r}: node {node!r} has no {self.driver} devices; "
                    f"nodes with GPUs: {_some(nodes)}"
                )
            found = [d for d in on_node if d.name == what]
            if not found and what.isdigit():
                found = [d for d in on_node if d.kind == "gpu" and d.index == int(what)]
                migs = [d for d in on_node if d.kind == "mig" and d.index == int(what)]
                if not found and migs:
                    raise NotFoundError(
                        f"no GPU {ref!r}: GPU {what} on {node} is in MIG mode; name one of its "
                        f"MIG devices: {_some([d.ref for d in migs])}"
                    )
            choices = [d.ref for d in on_node]
        else:
            found = [d for d in devices if d.uuid and d.uuid.lower() == wanted.lower()]
            choices = [f"{d.uuid} ({d.ref})" for d in devices if d.uuid]
        if not found:
            raise NotFoundError(
                f"no GPU {ref!r}; give a UUID, <node>/<index> or <node>/<device>. "
                f"Known: {_some(choices)}"
            )
        return found[0]


def _some(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    more = len(items) - limit
    return f"{shown} and {more} more" if more > 0 else shown or "none"
