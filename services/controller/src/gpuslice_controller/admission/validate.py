"""The validating webhook: ResourceClaims and ResourceClaimTemplates that ask for our GPUs.

A claim is ours when a request (or a ``firstAvailable`` subrequest) names one of our
DeviceClasses, or a config entry carries our driver's opaque parameters. For those:

- every opaque config is decoded with the kubelet plugin's own strict decoder
  (``gpuslice_api.gpuconfig``), so a claim admitted here is accepted at prepare;
- capacity requests on a whole GPU name only ``cores`` (an integer 1..100) and ``memory``
  (at least 1Mi, at most the largest GPU the cluster publishes);
- MIG devices are allocated whole: capacity requests or ``limits`` on them are refused;
- a request that names only one of ``cores``/``memory`` is admitted with a warning: the device
  model gives it the other's default, all of it.

Every problem is reported in one denial, each naming its field, value and what is allowed.
Claims of other drivers never reach this code (the webhook configuration's match conditions
send only ours); if one does, it is allowed untouched. resource.k8s.io v1 and v1beta2 nest a
request's device fields under ``exactly``; v1beta1 has them on the request itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpuslice_api.gpuconfig import GpuConfig, decode
from gpuslice_api.names import DRIVER, GPU_CLASS, MIG_CLASS
from gpuslice_api.quantity import MIB, human_bytes, parse_quantity
from gpuslice_controller.admission.review import Decision, Request
from gpuslice_core.errors import InvalidArgumentError

CAPACITIES = ("cores", "memory")
KINDS = ("ResourceClaim", "ResourceClaimTemplate")


@dataclass(frozen=True)
class Classes:
    """Our driver and the DeviceClasses that select its whole GPUs and its MIG devices."""

    driver: str = DRIVER
    gpu: frozenset[str] = frozenset({GPU_CLASS})
    mig: frozenset[str] = frozenset({MIG_CLASS})


@dataclass(frozen=True)
class Wanted:
    """One request or subrequest: where it is, its name for config entries, what it asks."""

    path: str
    name: str
    device_class: str
    capacity: dict[str, Any]


def _requests(devices: dict[str, Any], prefix: str, version: str) -> Iterator[Wanted]:
    for i, request in enumerate(devices.get("requests") or []):
        path = f"{prefix}.devices.requests[{i}]"
        name = str(request.get("name", ""))
        exact = request if version == "v1beta1" else request.get("exactly")
        if exact and exact.get("deviceClassName"):
            capacity = (exact.get("capacity") or {}).get("requests") or {}
            where = path if version == "v1beta1" else f"{path}.exactly"
            yield Wanted(where, name, exact["deviceClassName"], dict(capacity))
        for j, sub in enumerate(request.get("firstAvailable") or []):
            capacity = (sub.get("capacity") or {}).get("requests") or {}
            yield Wanted(
                f"{path}.firstAvailable[{j}]",
                f"{name}/{sub.get('name', '')}",
                str(sub.get("deviceClassName", "")),
                dict(capacity),
            )


class ClaimValidator:
    """Reviews ResourceClaims and ResourceClaimTemplates (``review``)."""

    def __init__(
        self, classes: Classes, max_gpu_memory: Callable[[], int | None] = lambda: None
    ) -> None:
        self.classes = classes
        self.max_gpu_memory = max_gpu_memory

    def review(self, request: Request) -> Decision:
        kind = (request.get("kind") or {}).get("kind")
        version = str((request.get("kind") or {}).get("version") or "v1")
        obj = request.get("object") or {}
        if kind not in KINDS or request.get("operation") not in (None, "CREATE", "UPDATE"):
            return Decision.allow()
        if kind == "ResourceClaim":
            spec, prefix = obj.get("spec") or {}, "spec"
        else:
            spec, prefix = (obj.get("spec") or {}).get("spec") or {}, "spec.spec"
        problems, warnings = self.check(spec.get("devices") or {}, prefix, version)
        if problems:
            what = f"{kind} {obj.get('metadata', {}).get('name') or '(generated name)'}"
            return Decision.deny(f"{what}: " + "; ".join(problems), *warnings)
        return Decision.allow(*warnings)

    def check(
        self, devices: dict[str, Any], prefix: str, version: str
    ) -> tuple[list[str], list[str]]:
        """Problems (deny) and warnings for one ``spec.devices``."""
        problems: list[str] = []
        warnings: list[str] = []
        ours = {
            w.name: w
            for w in _requests(devices, prefix, version)
            if w.device_class in self.classes.gpu | self.classes.mig
        }
        for wanted in ours.values():
            if wanted.device_class in self.classes.mig:
                if wanted.capacity:
                    problems.append(
                        f"{wanted.path}.capacity.requests: {sorted(wanted.capacity)} not allowed "
                        f"on {wanted.device_class}: a MIG device is allocated whole and has no "
                        "cores or memory to share; allowed: no capacity requests"
                    )
                continue
            self._check_capacity(wanted, problems, warnings)
        for i, entry in enumerate(devices.get("config") or []):
            opaque = entry.get("opaque") or {}
            if opaque.get("driver") != self.classes.driver:
                continue
            where = f"{prefix}.devices.config[{i}].opaque.parameters"
            try:
                config = decode(opaque.get("parameters"), what=where)
            except InvalidArgumentError as exc:
                problems.append(str(exc))
                continue
            self._check_config_targets(config, entry.get("requests") or [], ours, where, problems)
        return problems, warnings

    def _check_capacity(self, wanted: Wanted, problems: list[str], warnings: list[str]) -> None:
        where = f"{wanted.path}.capacity.requests"
        unknown = sorted(set(wanted.capacity) - set(CAPACITIES))
        if unknown:
            problems.append(
                f"{where}: unknown capacity {', '.join(unknown)}; allowed: cores, memory"
            )
        cores = wanted.capacity.get("cores")
        if cores is not None:
            value = _quantity(cores)
            if value is None or value.denominator != 1 or not 1 <= value <= 100:
                problems.append(
                    f"{where}.cores: {cores!r} is not allowed; allowed: an integer 1..100 "
                    "(percent of the GPU's SMs)"
                )
        memory = wanted.capacity.get("memory")
        if memory is not None:
            self._check_memory(where, memory, problems, warnings)
        asked = [c for c in CAPACITIES if c in wanted.capacity]
        if len(asked) == 1:
            other = "memory" if asked == ["cores"] else "cores"
            whole = "all of its memory" if other == "memory" else "all 100 cores"
            warnings.append(
                f"{wanted.path}: asks for {asked[0]} but not {other}, so it gets the device's "
                f"default for {other}: {whole}, and no other claim can share the GPU's {other}. "
                f"Add capacity.requests.{other} to share it."
            )

    def _check_memory(
        self, where: str, memory: Any, problems: list[str], warnings: list[str]
    ) -> None:
        value = _quantity(memory)
        largest = self.max_gpu_memory()
        if value is None or value < MIB:
            problems.append(
                f"{where}.memory: {memory!r} is not allowed; allowed: a quantity of at least "
                "1Mi, e.g. 20Gi"
            )
        elif largest is not None and value > largest:
            problems.append(
                f"{where}.memory: {memory!r} is more than any GPU in the cluster has; allowed: "
                f"1Mi..{human_bytes(largest)} (the largest GPU published)"
            )
        elif value % MIB:
            rounded = (value // MIB + 1) * MIB
            warnings.append(
                f"{where}.memory: {memory!r} is not a whole number of MiB; the scheduler "
                f"rounds it up to {human_bytes(int(rounded))}"
            )

    def _check_config_targets(
        self,
        config: GpuConfig,
        names: list[str],
        ours: dict[str, Wanted],
        where: str,
        problems: list[str],
    ) -> None:
        limited = config.limits.cores is not None or config.limits.memory is not None
        for wanted in ours.values():
            named = wanted.name in names or wanted.name.split("/", 1)[0] in names
            if names and not named:
                continue
            kind = "mig" if wanted.device_class in self.classes.mig else "gpu"
            if config.targets not in (None, kind):
                # NVIDIA's kinds configure one device type, as in NVIDIA's driver: an entry
                # for all requests passes over the other type, one that names it is an error.
                if named:
                    problems.append(
                        f"{where}: {config.origin} cannot configure {wanted.path} "
                        f"({wanted.device_class}); allowed: GpuConfig for whole GPUs, "
                        "MigDeviceConfig for MIG devices"
                    )
                continue
            if kind == "mig" and limited:
                problems.append(
                    f"{where}: limits apply to {wanted.path} ({wanted.device_class}), a MIG "
                    "device, whose size is its limit; allowed: limits only on whole GPUs "
                    f"({', '.join(sorted(self.classes.gpu))})"
                )


def _quantity(value: Any) -> Fraction | None:
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    try:
        return parse_quantity(value)
    except InvalidArgumentError:
        return None
