"""Why a claim (or a pod's claims) does not get a GPU, computed from the view.

For each request of a pending claim, devices are narrowed step by step as the scheduler narrows
them, and the first step that leaves too few devices is the reason:

1. the request's DeviceClass and its own selectors, clause by clause (top-level ``&&``): the
   clause that rules every remaining device out is named, with the values the devices have
   (``NoMatch``);
2. taints that the request does not tolerate, from the driver or from a DeviceTaintRule such as
   a cordon (``Tainted``);
3. capacity: every device taken (``FullyBooked``), not enough free memory (``NoFreeMemory``,
   with the largest free amount and where), not enough free cores (``NoFreeCores``), neither at
   once (``NoFit``), or fewer fitting devices than the request's count (``NotEnoughDevices``).

Each request is judged on its own (two requests of one claim that compete for one GPU are not
modelled), and only the pod's node name or ``kubernetes.io/hostname`` selector narrows nodes.
When the view finds room the reason is ``Fits`` and the scheduler's own message decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuslice_api.quantity import human_bytes
from gpuslice_view import cel
from gpuslice_view.model import ClusterView, Usage
from gpuslice_view.objects import Claim, Device, DeviceKey, Pod, Request, Taint

BLOCKING = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class Reason:
    code: str
    message: str
    claim: str = ""
    request: str = ""

    def __str__(self) -> str:
        where = ", ".join(
            p for p in (f"claim {self.claim}" if self.claim else "", self.request) if p
        )
        return f"{where}: {self.message}" if where else self.message

    def to_dict(self) -> dict[str, str]:
        return {
            "code": self.code,
            "claim": self.claim,
            "request": self.request,
            "message": self.message,
        }


def tolerated(taint: Taint, tolerations: Sequence[Mapping[str, Any]]) -> bool:
    """Whether one of a request's tolerations tolerates ``taint`` (as the scheduler matches)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.effect:
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint.key:
                return True
        elif t.get("key") == taint.key and (t.get("value") or "") == taint.value:
            return True
    return False


def _values(refs: list[tuple[str, str, str]], devices: Sequence[Device], driver: str) -> str:
    parts = []
    for field, domain, name in refs:
        values = set()
        for d in devices:
            source = d.attributes if field == "attributes" else d.capacity
            raw = source.get(name if domain == driver else f"{domain}/{name}")
            if raw is None and domain == driver:
                raw = source.get(f"{driver}/{name}")
            if raw is None:
                values.add("(not set)")
            elif field == "capacity":
                values.add(str(raw.get("value")))
            else:
                values.add(
                    repr(next(raw[k] for k in ("string", "int", "bool", "version") if k in raw))
                )
        shown = sorted(values)
        listed = ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")
        parts.append(f"{name} is {listed}" if len(shown) == 1 else f"{name} is one of {listed}")
    return "; ".join(parts)


class _Judge:
    def __init__(self, view: ClusterView, nodes: set[str] | None) -> None:
        self.view = view
        self.usage: dict[DeviceKey, Usage] = view.usage()
        self.devices = [d for d in view.devices() if nodes is None or d.node in nodes]
        self.nodes = nodes
        self._envs: dict[DeviceKey, dict[str, Any]] = {}

    def env(self, d: Device) -> dict[str, Any]:
        if d.key not in self._envs:
            self._envs[d.key] = cel.device_env(d.driver, d.attributes, d.capacity)
        return self._envs[d.key]

    def select(self, req: Request) -> tuple[list[Device], str | None]:
        """The devices the class and selectors pick, or None and why none."""
        origins = [
            (f"device class {req.device_class}", e) for e in self.view.classes[req.device_class]
        ]
        origins += [("the selector", e) for e in req.selectors]
        remaining = list(self.devices)
        for origin, expression in origins:
            try:
                clauses = cel.clauses(cel.parse(expression))
            except cel.Unsupported:
                continue  # not judged here; the scheduler judges it
            for clause in clauses:
                try:
                    kept = [d for d in remaining if cel.matches(clause, self.env(d))]
                except cel.Unsupported:
                    continue
                if not kept:
                    values = _values(cel.attribute_refs(clause), remaining, self.view.driver)
                    detail = f" ({values})" if values else ""
                    n = len(remaining)
                    return [], (
                        f"{origin} matches no device: `{cel.unparse(clause)}` rules out "
                        f"{'the one device' if n == 1 else f'all {n} devices'} left{detail}"
                    )
                remaining = kept
        return remaining, None

    def judge(self, req: Request) -> tuple[str, str] | None:
        """(code, message) of why ``req`` cannot be allocated; None when the view finds room."""
        if req.device_class not in self.view.classes:
            return "NoDeviceClass", f"device class {req.device_class!r} does not exist"
        if not any(self.view.driver in e for e in self.view.classes[req.device_class]):
            return "NotOurs", (
                f"device class {req.device_class} selects no {self.view.driver} devices; "
                "gpuslice does not judge it"
            )
        if not self.devices:
            where = f" on node {', '.join(sorted(self.nodes))}" if self.nodes else ""
            return "NoDevices", f"no {self.view.driver} device is published{where}"
        candidates, why = self.select(req)
        if why is not None:
            return "NoMatch", why
        usable = [d for d in candidates if not self.blocking(d, req)]
        if not usable:
            listed = "; ".join(
                f"{d.ref}: {', '.join(str(t) + self.by(t) for t in self.blocking(d, req))}"
                for d in candidates[:6]
            )
            return "Tainted", f"every matching device is tainted: {listed}"
        return self.capacity(req, [self.usage[d.key] for d in usable])

    def blocking(self, d: Device, req: Request) -> list[Taint]:
        return [
            t
            for t in self.view.taints(d)
            if t.effect in BLOCKING and not tolerated(t, req.tolerations)
        ]

    @staticmethod
    def by(taint: Taint) -> str:
        return f" (DeviceTaintRule {taint.rule})" if taint.rule else ""

    def capacity(self, req: Request, usable: list[Usage]) -> tuple[str, str] | None:
        def want_memory(u: Usage) -> int:
            return u.device.memory if req.memory is None else req.memory

        def want_cores(u: Usage) -> int:
            return u.device.cores if req.cores is None else req.cores

        def fits(u: Usage) -> bool:
            if not u.device.shareable:
                return not u.shares
            return want_memory(u) <= u.free_memory and want_cores(u) <= u.free_cores

        needed = len(usable) if req.all_devices else req.count
        fitting = [u for u in usable if fits(u)]
        if len(fitting) >= needed:
            return None
        if fitting:
            return "NotEnoughDevices", (
                f"asks for {needed} devices; {len(fitting)} fit: "
                f"{', '.join(u.device.ref for u in fitting)}"
            )
        if all(u.full for u in usable):
            models = ", ".join(sorted({u.device.model or u.device.kind for u in usable}))
            holders = "; ".join(
                f"{u.device.ref} by {', '.join(sorted({'/'.join(s.claim) for s in u.shares}))}"
                for u in usable[:6]
            )
            n = len(usable)
            what = "the one matching device is" if n == 1 else f"all {n} matching devices are"
            return "FullyBooked", f"{what} fully booked ({models}): {holders}"
        shareable = [u for u in usable if u.device.shareable]
        best_memory = max(shareable or usable, key=lambda u: u.free_memory)
        best_cores = max(shareable or usable, key=lambda u: u.free_cores)
        where_memory = (
            f"{human_bytes(best_memory.free_memory)} on node {best_memory.device.node} "
            f"({best_memory.device.ref})"
        )
        if not any(want_memory(u) <= u.free_memory for u in shareable):
            if req.memory is None:
                return "NoFreeMemory", (
                    "the request asks for no capacity, so it takes a whole GPU, and no matching "
                    f"GPU is wholly free; the most free memory is {where_memory}"
                )
            largest = max(u.device.memory for u in usable)
            beyond = (
                f" (the largest matching GPU has {human_bytes(largest)})"
                if req.memory > largest
                else ""
            )
            return "NoFreeMemory", (
                f"no matching GPU has {human_bytes(req.memory)} of free memory{beyond}; "
                f"the largest free is {where_memory}"
            )
        if not any(want_cores(u) <= u.free_cores for u in shareable):
            return "NoFreeCores", (
                f"no matching GPU has {want_cores(best_cores)}% of its cores free; the most free "
                f"is {best_cores.free_cores}% on node {best_cores.device.node} "
                f"({best_cores.device.ref})"
            )
        return "NoFit", (
            "no matching GPU has both the cores and the memory free at once "
            f"(most free memory: {where_memory}; most free cores: {best_cores.free_cores}% on "
            f"{best_cores.device.ref})"
        )


def why_claim(view: ClusterView, claim: Claim, *, nodes: set[str] | None = None) -> list[Reason]:
    """The reasons ``claim`` has no devices (or where it has them, when it is allocated)."""
    name = f"{claim.namespace}/{claim.name}"
    if claim.allocated:
        places = []
        for share in claim.shares:
            device = view.device_of(share.device)
            where = device.ref if device else "/".join(share.device[1:])
            places.append(f"{share.request} on {where}")
        pods = ", ".join(claim.reserved_for) or "no pod yet"
        return [Reason("Allocated", f"allocated: {'; '.join(places)}; reserved for {pods}", name)]
    judge = _Judge(view, nodes)
    reasons = []
    for request in claim.requests:
        alternatives = request.alternatives or (request,)
        found: list[Reason] = []
        for alternative in alternatives:
            verdict = judge.judge(alternative)
            if verdict is None:
                found = []
                break
            found.append(Reason(verdict[0], verdict[1], name, alternative.name))
        reasons += found
    if not reasons:
        reasons.append(
            Reason(
                "Fits",
                "the view finds room for every request; the scheduler's message decides "
                "(other requests of the pod, node affinity, constraints)",
                name,
            )
        )
    return reasons


def pod_nodes(pod: Pod) -> set[str] | None:
    """The nodes a pod may go to, as far as the view can tell (None: any)."""
    if pod.node:
        return {pod.node}
    return {pod.hostname} if pod.hostname else None


def why_pod(view: ClusterView, pod: Pod) -> list[Reason]:
    """The reasons of each of the pod's claims."""
    reasons = []
    for pc in pod.claims:
        if pc.claim is None:
            reasons.append(
                Reason(
                    "ClaimNotCreated",
                    f"the claim of {pc.name!r} (template {pc.template}) is not created yet; "
                    "kube-controller-manager's resource-claim controller creates it",
                    request=pc.name,
                )
            )
            continue
        claim = view.claims.get((pod.namespace, pc.claim))
        if claim is None:
            reasons.append(
                Reason(
                    "ClaimMissing",
                    f"ResourceClaim {pod.namespace}/{pc.claim} does not exist",
                    request=pc.name,
                )
            )
            continue
        reasons += why_claim(view, claim, nodes=pod_nodes(pod))
    return reasons
