"""Translate a pod written in another GPU-sharing system's dialect into DRA, as pure code.

``translate_pod`` reads the pod the mutating webhook received and returns what the webhook must
do: the ResourceClaimTemplates to ensure in the pod's namespace and an RFC 6902 patch that adds
``spec.resourceClaims``, the containers' ``resources.claims``, removes the extended resources and
records the original request in the ``gpu.gpuslice.dev/translated-from`` annotation. It talks to
nothing: what it needs to know about the cluster comes in :class:`ClusterFacts`. The dialects
are tables in :mod:`gpuslice_controller.admission.dialects`; the decisions are explained in
docs/controller.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gpuslice_api.names import (
    CONFIG_API_VERSION,
    DIALECT_LABEL,
    DRIVER,
    GPU_CLASS,
    MIG_CLASS,
    TRANSLATE_LABEL,
    TRANSLATED_ANNOTATION,
)
from gpuslice_api.quantity import MIB, format_bytes, human_bytes, parse_quantity
from gpuslice_controller.admission.dialects import DEFAULT, Dialect, Dialects
from gpuslice_controller.admission.selectors import annotation_selectors, size_selector
from gpuslice_core.errors import InvalidArgumentError

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpuslice-controller"
REQUEST_NAME = "gpu"
"""The single request in every template."""

MAX_ALTERNATIVES = 8
"""``firstAvailable`` holds at most 8 subrequests (one per distinct GPU memory size)."""

_CONTAINER_KINDS = ("initContainers", "containers")


class Denied(InvalidArgumentError):  # noqa: N818 - the webhook's verdict, not a fault
    """A pod the webhook must refuse; ``reason`` is for the user and names the container, the
    resource and the value. Permanent: the same pod is denied again."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ClusterFacts:
    """What translation needs to know about the cluster.

    ``gpu_memory_sizes``: the distinct total memory (bytes, the ``memory`` capacity) of the whole
    GPUs (``type == gpu``) in this driver's ResourceSlices. Empty = unknown: the "larger than any
    GPU" check is skipped, memory-only shares take all cores, and memory percentages are denied.
    """

    gpu_memory_sizes: frozenset[int] = frozenset()

    @classmethod
    def of(cls, sizes: Iterable[int]) -> ClusterFacts:
        return cls(frozenset(sizes))

    @property
    def max_gpu_memory(self) -> int | None:
        """Bytes of the largest GPU published; None = unknown."""
        return max(self.gpu_memory_sizes) if self.gpu_memory_sizes else None


@dataclass(frozen=True)
class Translation:
    """What the webhook does with a pod it translates."""

    dialect: str
    templates: list[dict[str, Any]]
    """Full ``resource.k8s.io/v1`` ResourceClaimTemplates (no namespace: the pod's)."""
    patch: list[dict[str, Any]]
    """RFC 6902 operations against the pod as received."""
    summary: str
    """One line for logs."""
    warnings: list[str] = field(default_factory=list)
    """For the AdmissionReview response's ``warnings``."""


@dataclass(frozen=True)
class _Ask:
    """One container's request in canonical form (per GPU)."""

    count: int
    cores: int | None  # 1..100; None = not asked
    memory: int | None  # bytes; None = not asked
    memory_percent: int | None  # 1..99; None = not asked (100 is "all": None)


@dataclass(frozen=True)
class _Slot:
    kind: str  # "containers" | "initContainers"
    index: int
    container: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str(self.container.get("name", f"{self.kind}[{self.index}]"))

    @property
    def what(self) -> str:
        noun = "init container" if self.kind == "initContainers" else "container"
        return f"{noun} {self.name!r}"

    def resource_lists(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        res = self.container.get("resources") or {}
        return res.get("limits") or {}, res.get("requests") or {}

    def resource_names(self) -> list[str]:
        limits, requests = self.resource_lists()
        return sorted(set(limits) | set(requests))


def translate_pod(
    pod: Mapping[str, Any],
    facts: ClusterFacts,
    *,
    driver_domain: str = DRIVER,
    device_class: str = GPU_CLASS,
    dialects: Dialects = DEFAULT,
) -> Translation | None:
    """The templates and patch that run ``pod`` on DRA; None when there is nothing to translate
    (no dialect resources, only the plain ``nvidia.com/gpu``, already translated, or opted out by
    the pod label). Raises :class:`Denied` for a request that cannot be translated.
    ``dialects``: the tables to read (HAMi's names and defaults as the install set them)."""
    meta = pod.get("metadata") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    if TRANSLATED_ANNOTATION in annotations:
        return None
    if str(labels.get(TRANSLATE_LABEL, "")).lower() == "false":
        return None
    spec = pod.get("spec") or {}
    slots = [
        _Slot(kind, i, c) for kind in _CONTAINER_KINDS for i, c in enumerate(spec.get(kind) or [])
    ]
    owners = dialects.by_resource
    dialect = _pick_dialect(slots, annotations, owners)
    if dialect is None:
        return None
    mode = annotations.get(dialect.mode_annotation or "", "")
    if "mig" in mode.lower().split(","):
        raise Denied(
            f"annotation {dialect.mode_annotation}={mode!r} asks for MIG, which is not "
            f"translated: ask for a MIG device with a ResourceClaim of class {MIG_CLASS}"
        )
    warnings: list[str] = []
    try:
        selectors = annotation_selectors(dialect, annotations, driver_domain)
    except ValueError as exc:
        raise Denied(str(exc)) from exc
    taken = {str(c.get("name")) for c in spec.get("resourceClaims") or []}

    templates: dict[str, dict[str, Any]] = {}
    claims: list[dict[str, Any]] = []
    patch: list[dict[str, Any]] = []
    record: list[dict[str, Any]] = []
    parts: list[str] = []
    for slot in slots:
        names = [n for n in slot.resource_names() if owners.get(n) is dialect]
        if not names:
            continue
        ask = _ask(dialect, slot, labels, warnings)
        patch.extend(_removals(slot, dialect))
        entry: dict[str, Any] = {
            "container": slot.name,
            **{k: dict(v) for k, v in _originals(slot, dialect).items() if v},
        }
        if slot.kind == "initContainers":
            entry["init"] = True
        record.append(entry)
        if ask is None:
            parts.append(f"{slot.name}: no GPU (count 0)")
            continue
        request, config, describe = _request(
            ask, slot, facts, selectors, warnings, driver_domain, device_class
        )
        template = _template(dialect, request, config)
        tname = template["metadata"]["name"]
        templates.setdefault(tname, template)
        claim = _claim_name(slot.name, taken)
        taken.add(claim)
        claims.append({"name": claim, "resourceClaimTemplateName": tname})
        patch.extend(_container_claim_ops(slot, claim))
        entry.update(claim=claim, template=tname)
        parts.append(f"{slot.name}: {describe}")
    if not record:
        return None

    original: dict[str, Any] = {"dialect": dialect.name, "containers": record}
    used = {k: annotations[k] for k in dialect.annotations if k in annotations}
    if used:
        original["annotations"] = used
    patch[:0] = _pod_claim_ops(spec, claims)
    patch.append(_annotation_op(meta, json.dumps(original, sort_keys=True, separators=(",", ":"))))
    return Translation(
        dialect=dialect.name,
        templates=list(templates.values()),
        patch=patch,
        summary=f"{dialect.title}: " + "; ".join(parts),
        warnings=warnings,
    )


# --- which dialect -----------------------------------------------------------------------------


def _pick_dialect(
    slots: Sequence[_Slot], annotations: Mapping[str, str], owners: Mapping[str, Dialect]
) -> Dialect | None:
    """The one dialect the pod speaks; ``Denied`` when it mixes two."""
    flavoured: set[str] = set()  # dialects asked for by more than a plain count
    for slot in slots:
        for name in slot.resource_names():
            owner = owners.get(name)
            if owner and not (owner.count_alone_is_plain and name == owner.count):
                flavoured.add(owner.name)
    for key in annotations:
        for owner in owners.values():
            if key in owner.annotations:
                flavoured.add(owner.name)

    seen: dict[str, tuple[_Slot, str, Dialect]] = {}  # dialect -> first (slot, resource)
    for slot in slots:
        in_slot: dict[str, str] = {}
        for name in slot.resource_names():
            owner = owners.get(name)
            if owner is None:
                continue
            if owner.count_alone_is_plain and name == owner.count and owner.name not in flavoured:
                in_slot.setdefault("plain", name)
                continue
            in_slot.setdefault(owner.name, name)
            seen.setdefault(owner.name, (slot, name, owner))
        dialects = sorted(k for k in in_slot if k != "plain")
        if dialects and "plain" in in_slot:
            raise Denied(
                f"{slot.what} asks for {in_slot['plain']} together with "
                f"{in_slot[dialects[0]]} ({owners[in_slot[dialects[0]]].title}): "
                f"one container must use one way of asking for GPUs"
            )
    if len(seen) > 1:
        (s1, r1, d1), (s2, r2, d2) = list(seen.values())[:2]
        raise Denied(
            f"{s1.what} asks for {r1} ({d1.title}) and {s2.what} asks for {r2} ({d2.title}): "
            f"a pod must use one GPU-sharing dialect"
        )
    if seen:
        return next(iter(seen.values()))[2]
    return None


# --- reading values ----------------------------------------------------------------------------


def _value(slot: _Slot, name: str) -> int | None:
    """The whole, non-negative value of extended resource ``name``; limits win, and a request
    that differs from its limit is denied."""
    limits, requests = slot.resource_lists()
    raw_limit, raw_request = limits.get(name), requests.get(name)
    if raw_limit is None and raw_request is None:
        return None
    limit = _number(slot, name, raw_limit, "limit") if raw_limit is not None else None
    request = _number(slot, name, raw_request, "request") if raw_request is not None else None
    if limit is not None and request is not None and limit != request:
        raise Denied(
            f"{slot.what}: {name} request {raw_request!r} differs from its limit "
            f"{raw_limit!r}; an extended resource's request must equal its limit"
        )
    value = limit if limit is not None else request
    assert value is not None
    return value


def _number(slot: _Slot, name: str, raw: object, which: str) -> int:
    try:
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            raise InvalidArgumentError(f"{raw!r}")
        exact: Fraction = parse_quantity(raw, what=name)
    except InvalidArgumentError as exc:
        raise Denied(f"{slot.what}: {name} {which} {raw!r} is not a quantity") from exc
    if exact < 0 or exact.denominator != 1:
        raise Denied(f"{slot.what}: {name} {which} {raw!r} is not a whole number of at least 0")
    return int(exact)


def _label_count(slot: _Slot, label: str, labels: Mapping[str, str]) -> int | None:
    raw = labels.get(label)
    if raw is None:
        return None
    if not str(raw).isdigit():
        raise Denied(f"pod label {label}={raw!r} is not a whole number (used by {slot.what})")
    return int(raw)


def _percent(slot: _Slot, name: str | None, value: int | None, what: str) -> int | None:
    """A percentage 1..100 (0 = not asked); over 100 is denied."""
    if name is None or not value:
        return None
    if value > 100:
        raise Denied(f"{slot.what}: {name} {value} is over 100 ({what} of one GPU, per GPU)")
    return value


def _ask(d: Dialect, slot: _Slot, labels: Mapping[str, str], warnings: list[str]) -> _Ask | None:
    """The container's request per GPU; None: it asks for 0 GPUs."""
    cores_raw = _value(slot, d.cores) if d.cores else None
    units = _value(slot, d.memory) if d.memory else None
    percent_raw = _value(slot, d.memory_percentage) if d.memory_percentage else None
    # The install's defaults (HAMi's defaultCores, defaultMem) for what the container leaves out.
    if cores_raw is None and d.default_cores:
        cores_raw = d.default_cores
    if units is None and percent_raw is None and d.default_memory:
        units = d.default_memory
    for ignored in d.ignored:
        if _value(slot, ignored) is not None:
            warnings.append(f"{slot.what}: {ignored} has no DRA counterpart; it was removed")
    memory = units * d.memory_unit if units else None

    if d.cores_count_whole_gpus:
        count, cores = 1, cores_raw or None
        if cores is not None and cores >= 100:
            if cores % 100:
                raise Denied(
                    f"{slot.what}: {d.cores} {cores} is over 100 and not a multiple of 100 "
                    f"(below 100 is a share of one GPU, multiples of 100 are whole GPUs)"
                )
            if memory is not None:
                warnings.append(
                    f"{slot.what}: {d.memory} is ignored: {d.cores} {cores} asks for "
                    f"{cores // 100} whole GPU(s), with all their memory"
                )
            return _Ask(cores // 100, None, None, None)
    else:
        explicit = _value(slot, d.count) if d.count else None
        if explicit is None and d.count_label:
            explicit = _label_count(slot, d.count_label, labels)
        count = d.default_count if explicit is None else explicit
        cores = _percent(slot, d.cores, cores_raw, "percent of the SMs")
        if cores is not None and count > 1 and not d.cores_with_count:
            raise Denied(
                f"{slot.what}: {d.cores} {cores} cannot be combined with {count} GPUs "
                f"({d.title} shares compute only on a single GPU)"
            )
    if count == 0:
        return None
    percent = _percent(slot, d.memory_percentage, percent_raw, "percent of the memory")

    if memory is not None and d.memory_is_total:
        assert units is not None
        if units % count:
            raise Denied(
                f"{slot.what}: {d.memory} {units} cannot be split evenly over {count} GPUs "
                f"({d.title} gives each GPU the same share)"
            )
        memory //= count
    if memory is not None and percent is not None:
        warnings.append(
            f"{slot.what}: {d.memory_percentage} is ignored because {d.memory} is given"
        )
        percent = None
    if percent == 100:
        percent = None  # all of each GPU's memory: the capacity's default
    if cores == 100 and memory is None and percent is None:
        cores = None  # all cores and all memory: a whole GPU
    return _Ask(count, cores, memory, percent)


# --- building the request ----------------------------------------------------------------------


def _request(
    ask: _Ask,
    slot: _Slot,
    facts: ClusterFacts,
    selectors: list[str],
    warnings: list[str],
    domain: str,
    device_class: str,
) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """The template's device request, an opaque config (or None), and a description."""
    gpus = f"{ask.count} GPU" + ("s" if ask.count > 1 else "")
    largest = facts.max_gpu_memory
    if ask.memory is not None and largest is not None and ask.memory > largest:
        raise Denied(
            f"{slot.what} asks for {human_bytes(ask.memory)} of GPU memory per GPU, more than "
            f"any GPU in the cluster has (largest: {human_bytes(largest)})"
        )

    def exactly(capacity: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, Any]:
        body: dict[str, Any] = {
            "deviceClassName": device_class,
            "allocationMode": "ExactCount",
            "count": ask.count,
        }
        if capacity:
            body["capacity"] = {"requests": dict(capacity)}
        cel = [*selectors, *extra]
        if cel:
            body["selectors"] = [{"cel": {"expression": e}} for e in cel]
        return body

    if ask.memory is None and ask.memory_percent is None and ask.cores is None:
        return _single(exactly({})), None, f"{gpus}, whole (exclusive)"
    if ask.memory is not None and ask.cores is not None:
        capacity = {"cores": str(ask.cores), "memory": format_bytes(ask.memory)}
        return _single(exactly(capacity)), None, f"{gpus}, {_show(capacity)}"
    if ask.memory is None and ask.memory_percent is None:
        assert ask.cores is not None
        warnings.append(
            f"{slot.what} asks for cores only: its share takes all of each GPU's memory, so "
            f"nothing else fits on that GPU; ask for memory too to share it"
        )
        capacity = {"cores": str(ask.cores)}
        return _single(exactly(capacity)), None, f"{gpus}, {_show(capacity)}"

    # Memory without cores (bytes or a percentage): sized per distinct GPU memory size.
    sizes = sorted(facts.gpu_memory_sizes)
    if ask.memory_percent is not None and not sizes:
        raise Denied(
            f"{slot.what} asks for {ask.memory_percent}% of GPU memory, but no GPU sizes are "
            f"known (no GPUs published in the cluster): ask for memory in bytes"
        )
    if not sizes:
        assert ask.memory is not None
        warnings.append(
            f"{slot.what} asks for memory only and no GPU sizes are known: its share takes all "
            f"cores of the GPU, so no other share fits on that GPU"
        )
        capacity = {"memory": format_bytes(ask.memory)}
        return _single(exactly(capacity)), None, f"{gpus}, {_show(capacity)}"
    invented = ask.cores is None
    options: list[tuple[int, dict[str, str]]] = []
    for size in sizes:
        if ask.memory is not None:
            if ask.memory > size:
                continue
            memory = ask.memory
        else:
            assert ask.memory_percent is not None
            memory = max(MIB, size // MIB * ask.memory_percent // 100 * MIB)
        cores = ask.cores if ask.cores is not None else max(1, -(-100 * memory // size))
        options.append((size, {"cores": str(cores), "memory": format_bytes(memory)}))
    config = _work_conserving(domain) if invented else None
    if len(options) == 1:
        _, capacity = options[0]
        return _single(exactly(capacity)), config, f"{gpus}, {_show(capacity)}"
    if len(options) > MAX_ALTERNATIVES:
        raise Denied(
            f"{slot.what}: the cluster has {len(options)} GPU memory sizes that fit, more than "
            f"the {MAX_ALTERNATIVES} alternatives one request can list: ask for cores too"
        )
    subrequests = []
    for size, capacity in options:
        sub = exactly(capacity, [size_selector(domain, size)])
        subrequests.append({"name": f"gpu-{format_bytes(size).lower()}", **sub})
    shown = " or ".join(f"{_show(c)} on {human_bytes(s)}" for s, c in options)
    return {"firstAvailable": subrequests}, config, f"{gpus}, {shown}"


def _single(body: dict[str, Any]) -> dict[str, Any]:
    return {"exactly": body}


def _show(capacity: Mapping[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in capacity.items())


def _work_conserving(domain: str) -> dict[str, Any]:
    """GpuConfig for a share whose cores gpuslice chose (memory-only asks): the SM limit holds
    only under contention, as HAMi's default core policy."""
    return {
        "requests": [REQUEST_NAME],
        "opaque": {
            "driver": domain,
            "parameters": {
                "apiVersion": CONFIG_API_VERSION,
                "kind": "GpuConfig",
                "enforcement": {"workConserving": True},
            },
        },
    }


def _template(d: Dialect, request: dict[str, Any], config: dict[str, Any] | None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{"name": REQUEST_NAME, **request}]}
    if config is not None:
        devices["config"] = [config]
    spec = {"spec": {"devices": devices}}
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:10]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": f"gpuslice-{d.name}-{digest}",
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, DIALECT_LABEL: d.name},
        },
        "spec": spec,
    }


# --- the patch ---------------------------------------------------------------------------------


def pointer_escape(token: str) -> str:
    """One JSON-pointer reference token (RFC 6901): ``~`` -> ``~0``, ``/`` -> ``~1``."""
    return token.replace("~", "~0").replace("/", "~1")


def _originals(slot: _Slot, d: Dialect) -> dict[str, dict[str, Any]]:
    limits, requests = slot.resource_lists()
    return {
        "limits": {k: v for k, v in limits.items() if k in d.resources},
        "requests": {k: v for k, v in requests.items() if k in d.resources},
    }


def _removals(slot: _Slot, d: Dialect) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    base = f"/spec/{slot.kind}/{slot.index}/resources"
    limits, requests = slot.resource_lists()
    for key, values in (("limits", limits), ("requests", requests)):
        ours = [k for k in values if k in d.resources]
        if not ours:
            continue
        if len(ours) == len(values):
            ops.append({"op": "remove", "path": f"{base}/{key}"})
        else:
            ops.extend({"op": "remove", "path": f"{base}/{key}/{pointer_escape(k)}"} for k in ours)
    return ops


def _container_claim_ops(slot: _Slot, claim: str) -> list[dict[str, Any]]:
    base = f"/spec/{slot.kind}/{slot.index}/resources/claims"
    if (slot.container.get("resources") or {}).get("claims"):
        return [{"op": "add", "path": f"{base}/-", "value": {"name": claim}}]
    return [{"op": "add", "path": base, "value": [{"name": claim}]}]


def _pod_claim_ops(spec: Mapping[str, Any], claims: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not claims:
        return []
    if spec.get("resourceClaims"):
        return [{"op": "add", "path": "/spec/resourceClaims/-", "value": c} for c in claims]
    return [{"op": "add", "path": "/spec/resourceClaims", "value": claims}]


def _annotation_op(meta: Mapping[str, Any], value: str) -> dict[str, Any]:
    if meta.get("annotations"):
        path = f"/metadata/annotations/{pointer_escape(TRANSLATED_ANNOTATION)}"
        return {"op": "add", "path": path, "value": value}
    return {"op": "add", "path": "/metadata/annotations", "value": {TRANSLATED_ANNOTATION: value}}


def _claim_name(container: str, taken: set[str]) -> str:
    """``gpu-<container>``: a DNS label of at most 63 characters, unique in the pod."""
    name = f"gpu-{container}"
    if len(name) > 63 or name in taken:
        digest = hashlib.sha256(container.encode()).hexdigest()[:8]
        name = f"gpu-{container[:50].rstrip('-')}-{digest}"
    if name in taken:
        raise Denied(f"the pod already has a resource claim named {name!r}")
    return name
