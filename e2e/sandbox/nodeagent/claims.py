"""Which ResourceClaims a pod uses, whether it may use them, and which CDI devices each of its
containers gets — pure functions over API objects (docs/node-agent.md, "What it simulates": DRA
manager, CDI into containers)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from e2e.sandbox.nodeagent.dra_plugins import PreparedDevice
from gpuslice_kube.raw import Obj


class ClaimError(Exception):
    """The pod cannot start yet (or ever) with these claims; the message says why."""


@dataclass(frozen=True)
class PodClaim:
    pod_claim_name: str  # the entry in pod.spec.resourceClaims ("" for the extended-resource claim)
    claim_name: str  # the ResourceClaim object
    from_template: bool  # generated for this pod: it must be controlled by the pod


def pod_ref(pod: Obj) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}/{meta['name']}"


def pod_claims(pod: Obj) -> list[PodClaim]:
    """The claims of ``pod``; raises ClaimError when a template claim is not created yet."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    statuses = {s["name"]: s for s in status.get("resourceClaimStatuses") or []}
    out: list[PodClaim] = []
    for entry in spec.get("resourceClaims") or []:
        name = entry["name"]
        if entry.get("resourceClaimName"):
            out.append(PodClaim(name, entry["resourceClaimName"], from_template=False))
        elif entry.get("resourceClaimTemplateName"):
            st = statuses.get(name)
            if st is None:
                raise ClaimError(
                    f"ResourceClaim not created yet: pod {pod_ref(pod)}, pod claim {name}"
                )
            if st.get("resourceClaimName"):  # None: deliberately not created, skip
                out.append(PodClaim(name, st["resourceClaimName"], from_template=True))
    extended = status.get("extendedResourceClaimStatus") or {}
    if extended.get("resourceClaimName"):
        out.append(PodClaim("", extended["resourceClaimName"], from_template=True))
    return out


def allocated_drivers(claim: Obj) -> list[str]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return sorted({r["driver"] for r in results})


def validate_claim(
    pod: Obj, claim: Obj, pc: PodClaim, driver_registered: Callable[[str], bool]
) -> None:
    """The kubelet's checks before preparing: ownership, reservation, allocation, drivers."""
    pmeta, cmeta = pod["metadata"], claim["metadata"]
    cname = f"{cmeta['namespace']}/{cmeta['name']}"
    if pc.from_template:
        owners = cmeta.get("ownerReferences") or []
        if not any(o.get("controller") and o.get("uid") == pmeta["uid"] for o in owners):
            raise ClaimError(
                f"ResourceClaim {cname} was not created for pod {pod_ref(pod)} (pod is not owner)"
            )
    status = claim.get("status") or {}
    reserved = status.get("reservedFor") or []
    if not any(r.get("uid") == pmeta["uid"] for r in reserved):
        raise ClaimError(
            f"pod {pod_ref(pod)} ({pmeta['uid']}) is not allowed to use ResourceClaim {cname} "
            f"({cmeta['uid']})"
        )
    if not status.get("allocation"):
        raise ClaimError(f"ResourceClaim {cname} is not allocated")
    for driver in allocated_drivers(claim):
        if not driver_registered(driver):
            raise ClaimError(f"DRA driver {driver} is not registered")


def _request_matches(device: PreparedDevice, request: str) -> bool:
    if not device.request_names:
        return True
    return any(rn.split("/", 1)[0] == request for rn in device.request_names)


def container_cdi_ids(
    pod: Obj,
    container: Obj,
    claims: Iterable[PodClaim],
    devices: Callable[[str], list[PreparedDevice]],
) -> list[str]:
    """The CDI ids the kubelet puts into ``container``'s CRI config: only the claims (and
    requests) it lists, in the kubelet's order — the pod's claims in ``spec.resourceClaims``
    order, for each every entry of the container that names it, a device's ids when the entry
    names no request or the device's ``request_names`` are empty or hold it — then its share of
    the extended-resource claim. Not deduplicated, as the kubelet's list is not (the runtime
    skips repeats). ``devices(claim_name)`` returns the prepared devices of a claim."""
    refs = (container.get("resources") or {}).get("claims") or []
    ids: list[str] = []
    for pc in claims:
        if not pc.pod_claim_name:
            continue
        for ref in refs:
            if ref["name"] != pc.pod_claim_name:
                continue
            request = ref.get("request") or ""
            for device in devices(pc.claim_name):
                if not request or _request_matches(device, request):
                    ids.extend(device.cdi_device_ids)
    extended_pc = next((pc for pc in claims if not pc.pod_claim_name), None)
    extended = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    if extended_pc is not None:
        requests = [
            m["requestName"]
            for m in extended.get("requestMappings") or []
            if m.get("containerName") == container["name"]
        ]
        for device in devices(extended_pc.claim_name):
            if any(_request_matches(device, r) for r in requests):
                ids.extend(device.cdi_device_ids)
    return ids


def container_claim_devices(
    pod: Obj,
    container: Obj,
    claims: Iterable[PodClaim],
    devices: Callable[[str], list[tuple[str, PreparedDevice]]],
) -> dict[str, list[tuple[str, PreparedDevice]]]:
    """Claim name → the (driver, device) pairs ``container`` gets from it: the same selection
    as ``container_cdi_ids`` (the claims and requests it lists, plus its share of the
    extended-resource claim), for the pod resources API. Claims with no prepared device are
    left out; ``devices(claim_name)`` returns [] for a claim not prepared here."""
    by_pod_name = {pc.pod_claim_name: pc for pc in claims}
    out: dict[str, list[tuple[str, PreparedDevice]]] = {}

    def add(claim_name: str, requests: list[str]) -> None:
        # no requests: every device of the claim
        for driver, device in devices(claim_name):
            if not requests or any(_request_matches(device, r) for r in requests):
                chosen = out.setdefault(claim_name, [])
                if (driver, device) not in chosen:
                    chosen.append((driver, device))

    for ref in (container.get("resources") or {}).get("claims") or []:
        pc = by_pod_name.get(ref["name"])
        if pc is None or not pc.pod_claim_name:
            continue
        add(pc.claim_name, [ref["request"]] if ref.get("request") else [])
    extended_pc = by_pod_name.get("")
    extended = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    if extended_pc is not None:
        requests = [
            m["requestName"]
            for m in extended.get("requestMappings") or []
            if m.get("containerName") == container["name"]
        ]
        if requests:
            add(extended_pc.claim_name, requests)
    return out
