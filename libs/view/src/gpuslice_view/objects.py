"""API objects reduced to what the view keeps, for resource.k8s.io v1, v1beta2 and v1beta1.

Each ``*_from`` function takes an object as the API returns it (a plain dict) and returns a small
frozen record, or None when the object is nothing the view keeps (a slice of another driver, a
pod without claims). The differences between versions are settled here and only here: v1beta1
nests a device's fields under ``basic`` and puts a request's fields on the request instead of
under ``exactly``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuslice_api.names import DRIVER
from gpuslice_api.quantity import MIB, parse_quantity
from gpuslice_core.errors import InvalidArgumentError

Obj = dict[str, Any]
CORDON_KEY = f"{DRIVER}/cordon"
"""The key of the taint ``kubectl gpuslice cordon`` puts on a device (through a DeviceTaintRule)."""

DeviceKey = tuple[str, str, str]
"""(driver, pool, device): how allocation results and taint rules name a device."""
ClaimKey = tuple[str, str]
"""(namespace, name)"""


def _quantity(value: Any) -> int | None:
    try:
        return math.ceil(parse_quantity(value))
    except (InvalidArgumentError, TypeError):
        return None


def _attr(attributes: Mapping[str, Any], name: str, driver: str) -> Any:
    value = attributes.get(name) or attributes.get(f"{driver}/{name}") or {}
    return next((value[k] for k in ("string", "int", "bool", "version") if k in value), None)


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str
    rule: str = ""
    """The DeviceTaintRule that puts it there; empty for a taint the driver publishes."""

    def __str__(self) -> str:
        value = f"={self.value}" if self.value else ""
        return f"{self.key}{value}:{self.effect}"


def taint_from(obj: Mapping[str, Any], rule: str = "") -> Taint:
    return Taint(
        str(obj.get("key", "")), str(obj.get("value") or ""), str(obj.get("effect", "")), rule
    )


@dataclass(frozen=True)
class Device:
    """One device our driver publishes. ``attributes`` and ``capacity`` are the slice's own maps
    (selectors are evaluated against them); the rest is read from them once."""

    driver: str
    pool: str
    node: str
    name: str
    kind: str  # gpu | mig
    uuid: str
    index: int | None
    model: str
    parent_uuid: str
    profile: str
    cores: int  # 100 for a whole GPU; 0 where the device has no cores capacity (MIG)
    memory: int  # bytes
    shareable: bool
    taints: tuple[Taint, ...]
    attributes: Mapping[str, Any] = field(repr=False, compare=False)
    capacity: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def key(self) -> DeviceKey:
        return (self.driver, self.pool, self.name)

    @property
    def ref(self) -> str:
        """``<node>/<index>`` for a whole GPU, ``<node>/<device>`` for a MIG device."""
        if self.kind == "gpu" and self.index is not None and self.name == f"gpu-{self.index}":
            return f"{self.node}/{self.index}"
        return f"{self.node}/{self.name}"


@dataclass(frozen=True)
class SliceContent:
    pool: str
    generation: int
    devices: tuple[Device, ...]


def slice_from(obj: Obj, driver: str = DRIVER) -> SliceContent | None:
    spec = obj.get("spec") or {}
    if spec.get("driver") != driver:
        return None
    pool = spec.get("pool") or {}
    pool_name = str(pool.get("name", ""))
    node = str(spec.get("nodeName") or pool_name)
    devices = []
    for raw in spec.get("devices") or []:
        body = raw.get("basic") or raw  # v1beta1
        attributes = body.get("attributes") or {}
        capacity = body.get("capacity") or {}
        kind = str(_attr(attributes, "type", driver) or "gpu")
        index = _attr(attributes, "index", driver)
        memory = _quantity((capacity.get("memory") or {}).get("value")) or 0
        cores = _quantity((capacity.get("cores") or {}).get("value")) or 0
        devices.append(
            Device(
                driver=driver,
                pool=pool_name,
                node=node,
                name=str(raw.get("name", "")),
                kind=kind,
                uuid=str(_attr(attributes, "uuid", driver) or ""),
                index=index if isinstance(index, int) else None,
                model=str(_attr(attributes, "productName", driver) or ""),
                parent_uuid=str(_attr(attributes, "parentUUID", driver) or ""),
                profile=str(_attr(attributes, "profile", driver) or ""),
                cores=cores,
                memory=memory,
                shareable=bool(body.get("allowMultipleAllocations")),
                taints=tuple(taint_from(t) for t in body.get("taints") or []),
                attributes=attributes,
                capacity=capacity,
            )
        )
    return SliceContent(pool_name, int(pool.get("generation") or 0), tuple(devices))


@dataclass(frozen=True)
class Request:
    """One request of a claim (or one ``firstAvailable`` alternative: ``name`` is ``req/sub``)."""

    name: str
    device_class: str
    selectors: tuple[str, ...] = ()
    count: int = 1
    all_devices: bool = False
    cores: int | None = None
    memory: int | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    alternatives: tuple[Request, ...] = ()


def _exact_request(name: str, body: Mapping[str, Any]) -> Request:
    requests = (body.get("capacity") or {}).get("requests") or {}
    memory = _quantity(requests.get("memory")) if "memory" in requests else None
    if memory is not None:
        memory = -(-memory // MIB) * MIB  # the request policy's step: whole MiB, rounded up
    return Request(
        name=name,
        device_class=str(body.get("deviceClassName", "")),
        selectors=tuple(
            str(s["cel"]["expression"]) for s in body.get("selectors") or [] if s.get("cel")
        ),
        count=int(body.get("count") or 1),
        all_devices=body.get("allocationMode") == "All",
        cores=_quantity(requests.get("cores")) if "cores" in requests else None,
        memory=memory,
        tolerations=tuple(body.get("tolerations") or ()),
    )


def request_from(obj: Mapping[str, Any]) -> Request:
    name = str(obj.get("name", ""))
    if obj.get("firstAvailable"):
        subs = tuple(
            _exact_request(f"{name}/{s.get('name', '')}", s) for s in obj["firstAvailable"]
        )
        return Request(name=name, device_class="", alternatives=subs)
    return _exact_request(name, obj.get("exactly") or obj)  # v1beta1: fields on the request


@dataclass(frozen=True)
class Share:
    """One allocation result: a claim's request on one device, and what it consumes of it.
    ``cores``/``memory`` None: no consumed capacity recorded, i.e. the whole device."""

    claim: ClaimKey
    request: str
    device: DeviceKey
    cores: int | None
    memory: int | None
    share_id: str


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str
    requests: tuple[Request, ...]
    shares: tuple[Share, ...]
    allocated: bool
    reserved_for: tuple[str, ...]
    """Names of the pods (in the claim's namespace) the claim is reserved for."""
    deleting: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    """The claim's labels, sorted (``kubectl get gpuclaims -l`` selects by them)."""

    @property
    def key(self) -> ClaimKey:
        return (self.namespace, self.name)


def claim_from(obj: Obj) -> Claim:
    meta = obj.get("metadata") or {}
    key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
    status = obj.get("status") or {}
    allocation = status.get("allocation")
    shares = []
    for result in ((allocation or {}).get("devices") or {}).get("results") or []:
        consumed = result.get("consumedCapacity") or {}
        shares.append(
            Share(
                claim=key,
                request=str(result.get("request", "")),
                device=(
                    str(result.get("driver", "")),
                    str(result.get("pool", "")),
                    str(result.get("device", "")),
                ),
                cores=_quantity(consumed["cores"]) if "cores" in consumed else None,
                memory=_quantity(consumed["memory"]) if "memory" in consumed else None,
                share_id=str(result.get("shareID") or ""),
            )
        )
    spec_requests = ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []
    return Claim(
        namespace=key[0],
        name=key[1],
        uid=str(meta.get("uid", "")),
        requests=tuple(request_from(r) for r in spec_requests),
        shares=tuple(shares),
        allocated=allocation is not None,
        reserved_for=tuple(
            str(r.get("name", ""))
            for r in status.get("reservedFor") or []
            if r.get("resource") == "pods"
        ),
        deleting=bool(meta.get("deletionTimestamp")),
        labels=tuple(sorted((str(k), str(v)) for k, v in (meta.get("labels") or {}).items())),
    )


@dataclass(frozen=True)
class PodClaim:
    name: str
    """The pod's name for the claim (``spec.resourceClaims[].name``)."""
    claim: str | None
    """The ResourceClaim's name; None while a template's claim is not created yet."""
    template: str | None


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    uid: str
    node: str
    """``spec.nodeName``: where it is bound; empty while it is not scheduled."""
    hostname: str
    """The ``kubernetes.io/hostname`` of its node selector, if it has one."""
    phase: str
    claims: tuple[PodClaim, ...]
    scheduling: str
    """The message of ``PodScheduled=False``, if the scheduler wrote one."""

    @property
    def key(self) -> ClaimKey:
        return (self.namespace, self.name)


def pod_from(obj: Obj) -> Pod | None:
    spec = obj.get("spec") or {}
    if not spec.get("resourceClaims"):
        return None
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    generated = {
        s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []
    }
    claims = tuple(
        PodClaim(
            name=str(c.get("name", "")),
            claim=c.get("resourceClaimName") or generated.get(c.get("name")),
            template=c.get("resourceClaimTemplateName"),
        )
        for c in spec["resourceClaims"]
    )
    scheduled: Obj = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
    )
    return Pod(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        node=str(spec.get("nodeName") or ""),
        hostname=str((spec.get("nodeSelector") or {}).get("kubernetes.io/hostname") or ""),
        phase=str(status.get("phase") or ""),
        claims=claims,
        scheduling=str(scheduled.get("message") or "")
        if scheduled.get("status") == "False"
        else "",
    )


@dataclass(frozen=True)
class TaintRule:
    name: str
    driver: str
    pool: str
    device: str
    taint: Taint

    def selects(self, device: Device) -> bool:
        return all(
            not want or want == have
            for want, have in (
                (self.driver, device.driver),
                (self.pool, device.pool),
                (self.device, device.name),
            )
        )


def taint_rule_from(obj: Obj) -> TaintRule | None:
    """A DeviceTaintRule (v1, v1beta2, v1alpha3). Rules that also select by device class or CEL
    (v1alpha3 on 1.33/1.34) are not matched here: None."""
    spec = obj.get("spec") or {}
    selector = spec.get("deviceSelector")
    name = str((obj.get("metadata") or {}).get("name", ""))
    if selector is None or selector.get("deviceClassName") or selector.get("selectors"):
        return None
    return TaintRule(
        name=name,
        driver=str(selector.get("driver") or ""),
        pool=str(selector.get("pool") or ""),
        device=str(selector.get("device") or ""),
        taint=taint_from(spec.get("taint") or {}, rule=name),
    )


def class_selectors(obj: Obj) -> tuple[str, ...]:
    """The CEL expressions of a DeviceClass."""
    selectors = (obj.get("spec") or {}).get("selectors") or []
    return tuple(str(s["cel"]["expression"]) for s in selectors if s.get("cel"))
