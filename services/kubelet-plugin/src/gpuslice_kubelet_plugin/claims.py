"""What a ResourceClaim asks this node for: its allocation results for this driver and pool,
the capacity each result consumed (and which of it the request asked for by name) and the
GpuConfigs that may apply to it (the plan picks one by device type).

The kubelet sends only namespace, name and UID; everything else comes from the claim object.
Every problem is a ``ClaimError`` with a short ``reason`` (a metric label) and a message that
says what is wrong with which claim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuslice_api import gpuconfig as cfg
from gpuslice_core.errors import GpusliceError, InvalidArgumentError
from gpuslice_draplugin import ClaimRef
from gpuslice_kube.raw import Obj

SOURCE_ORDER = {"FromClass": 0, "FromClaim": 1}


class ClaimError(GpusliceError):
    """One claim cannot be prepared (or unprepared); the other claims of the call go on."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class PodRef:
    uid: str
    namespace: str
    name: str


@dataclass(frozen=True)
class Result:
    """One allocation result of this driver: a device (or a share of one) for a request."""

    request: str
    device: str
    pool: str
    share_id: str | None
    admin_access: bool
    consumed: dict[str, str]  # consumedCapacity as quantities
    configs: tuple[cfg.Candidate, ...] = ()  # those whose requests match, in precedence order
    requested: frozenset[str] = frozenset()  # capacities the request asks for by name


@dataclass(frozen=True)
class AllocatedClaim:
    ref: ClaimRef
    results: tuple[Result, ...]
    pods: tuple[PodRef, ...] = field(default=())


def _applies(config_requests: list[str], request: str) -> bool:
    if not config_requests:
        return True
    parent = request.split("/", 1)[0]
    return request in config_requests or parent in config_requests


def _configs(ref: ClaimRef, allocation: Obj, driver: str) -> list[tuple[list[str], cfg.GpuConfig]]:
    entries = list(enumerate((allocation.get("devices") or {}).get("config") or []))
    entries.sort(key=lambda e: SOURCE_ORDER.get(str(e[1].get("source")), 1))
    out = []
    for index, entry in entries:
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != driver:
            continue
        source = "DeviceClass" if entry.get("source") == "FromClass" else "claim"
        requests = list(entry.get("requests") or [])
        what = f"ResourceClaim {ref}: GpuConfig #{index} (from the {source}"
        what += f", requests {requests})" if requests else ")"
        try:
            out.append((requests, cfg.decode(opaque.get("parameters"), what=what)))
        except InvalidArgumentError as exc:
            raise ClaimError("BadConfig", str(exc)) from exc
    return out


def _requested_capacity(claim: Obj) -> dict[str, frozenset[str]]:
    """Request (or ``request/subrequest``) → the capacity names it asks for. v1 and v1beta2
    nest a request's fields under ``exactly``; v1beta1 has them on the request itself."""
    out: dict[str, frozenset[str]] = {}
    for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        name = str(r.get("name", ""))
        exact = r.get("exactly") or r
        out[name] = frozenset(((exact.get("capacity") or {}).get("requests") or {}).keys())
        for sub in r.get("firstAvailable") or []:
            names = ((sub.get("capacity") or {}).get("requests") or {}).keys()
            out[f"{name}/{sub.get('name', '')}"] = frozenset(names)
    return out


def _pods(status: Obj) -> tuple[PodRef, ...]:
    return tuple(
        PodRef(uid=str(r.get("uid", "")), namespace="", name=str(r.get("name", "")))
        for r in status.get("reservedFor") or []
        if r.get("resource") == "pods"
    )


def parse_claim(claim: Obj, ref: ClaimRef, *, driver: str, pool: str) -> AllocatedClaim:
    """The results of ``driver`` in ``pool``, with their configs; ``ClaimError`` otherwise."""
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise ClaimError(
            "UIDMismatch",
            f"ResourceClaim {ref} has UID {meta.get('uid')}, the kubelet asked for {ref.uid} "
            "(the claim was deleted and created again)",
        )
    status = claim.get("status") or {}
    allocation = status.get("allocation")
    if not allocation:
        raise ClaimError("NotAllocated", f"ResourceClaim {ref} is not allocated")
    all_results = (allocation.get("devices") or {}).get("results") or []
    ours = [r for r in all_results if r.get("driver") == driver]
    if not ours:
        drivers = sorted({str(r.get("driver")) for r in all_results})
        raise ClaimError(
            "WrongDriver",
            f"ResourceClaim {ref} has no device allocated by driver {driver} "
            f"(its devices come from {drivers or 'no driver'})",
        )
    foreign = [r for r in ours if r.get("pool") != pool]
    if foreign:
        r = foreign[0]
        raise ClaimError(
            "WrongPool",
            f"ResourceClaim {ref}: device {r.get('device')} of request {r.get('request')} was "
            f"allocated from pool {r.get('pool')}, but this plugin serves pool {pool}",
        )
    configs = _configs(ref, allocation, driver)
    requested = _requested_capacity(claim)
    results = []
    for r in ours:
        request = str(r.get("request", ""))
        matching = [
            cfg.Candidate(c, named=bool(requests))
            for requests, c in configs
            if _applies(requests, request)
        ]
        consumed = {k: str(v) for k, v in (r.get("consumedCapacity") or {}).items()}
        results.append(
            Result(
                request=request,
                device=str(r.get("device", "")),
                pool=str(r.get("pool", "")),
                share_id=r.get("shareID") or None,
                admin_access=bool(r.get("adminAccess")),
                consumed=consumed,
                configs=tuple(matching),
                requested=requested.get(request, frozenset()),
            )
        )
    return AllocatedClaim(ref=ref, results=tuple(results), pods=_pods(status))


def claim_error(exc: BaseException) -> ClaimError:
    """Any failure of one claim as a ClaimError (reason = the error's kind)."""
    if isinstance(exc, ClaimError):
        return exc
    if isinstance(exc, GpusliceError):
        reason = type(exc).__name__.removesuffix("Error") or "Error"
        return ClaimError(reason, str(exc))
    return ClaimError("Internal", f"internal error: {type(exc).__name__}: {exc}")
