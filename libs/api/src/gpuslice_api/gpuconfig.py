"""The opaque claim configuration ``gpu.gpuslice.dev/v1alpha1`` ``GpuConfig``, decoded strictly.

A claim (or its DeviceClass) carries it in ``spec.devices.config[].opaque.parameters`` with
``driver: gpu.gpuslice.dev``. It says how a claim's GPUs are shared and enforced::

    apiVersion: gpu.gpuslice.dev/v1alpha1
    kind: GpuConfig
    sharing:
      strategy: TimeSlicing        # or MPS; unset = exclusive or a consumable-capacity share
    enforcement:
      mode: Auto                   # Auto | Hard | Soft | Off
      strict: false                # fail instead of falling back to weaker enforcement
      workConserving: false        # soft SM limits throttle only under contention
    limits:                        # for clusters without consumable capacity; capacity wins
      cores: 30                    # 1..100 percent of the GPU's SMs
      memory: 20Gi                 # 1Mi .. the GPU's memory

Unknown fields are errors that name the field; a bad value is one error that names the field,
the value and the allowed range. Precedence: DeviceClass configs < claim configs, later entries
win (``effective_config``).

NVIDIA's ``resource.nvidia.com/v1beta1`` ``GpuConfig`` and ``MigDeviceConfig`` are accepted too
and mapped onto this model (``nvconfig``); the private attributes below keep what the mapping
needs that this API has no field for (which device type a config is for, per-device memory
limits, and the user's field names for messages).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from gpuslice_api import nvconfig
from gpuslice_api.quantity import memory_quantity
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_core.untrusted import LISTED, shown

API_VERSION = "gpu.gpuslice.dev/v1alpha1"
KIND = "GpuConfig"

# What each field accepts, for error messages ("allowed: ...").
ALLOWED: dict[str, str] = {
    "apiVersion": API_VERSION,
    "kind": KIND,
    "sharing.strategy": "TimeSlicing, MPS",
    "enforcement.mode": "Auto, Hard, Soft, Off",
    "enforcement.strict": "true or false",
    "enforcement.workConserving": "true or false",
    "limits.cores": "an integer 1..100 (percent of the GPU's SMs)",
    "limits.memory": "a quantity from 1Mi up to the GPU's memory, e.g. 20Gi",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=False)


class Sharing(_Strict):
    strategy: Literal["TimeSlicing", "MPS"] | None = None


class Enforcement(_Strict):
    mode: Literal["Auto", "Hard", "Soft", "Off"] = "Auto"
    strict: bool = False
    work_conserving: bool = Field(default=False, alias="workConserving")


class Limits(_Strict):
    cores: int | None = Field(default=None, ge=1, le=100)
    memory: int | None = None
    """Bytes (the YAML value is a quantity such as ``20Gi``)."""

    @field_validator("memory", mode="plain")
    @classmethod
    def _memory(cls, value: Any) -> int | None:
        return None if value is None else memory_quantity(value)


class GpuConfig(_Strict):
    api_version: Literal["gpu.gpuslice.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["GpuConfig"]
    sharing: Sharing = Sharing()
    enforcement: Enforcement = Enforcement()
    limits: Limits = Limits()

    # Set by nvconfig for NVIDIA's kinds (users cannot set private attributes):
    _origin: str = PrivateAttr(default=f"{API_VERSION} {KIND}")
    _targets: Literal["gpu", "mig"] | None = PrivateAttr(default=None)
    _device_memory: dict[str, int] = PrivateAttr(default_factory=dict)
    _time_slice: nvconfig.TimeSlice | None = PrivateAttr(default=None)
    _field_names: dict[str, str] = PrivateAttr(
        default_factory=lambda: {"cores": "limits.cores", "memory": "limits.memory"}
    )

    @property
    def origin(self) -> str:
        """``<apiVersion> <kind>`` as the user wrote it."""
        return self._origin

    @property
    def targets(self) -> Literal["gpu", "mig"] | None:
        """The device type an NVIDIA config is for (it skips the others when it names no
        requests); None: any (gpuslice's GpuConfig)."""
        return self._targets

    @property
    def device_memory(self) -> dict[str, int]:
        """Per-device memory limits in bytes, keyed by the device's index among the devices the
        config applies to or by its UUID (NVIDIA's ``defaultPerDevicePinnedMemoryLimit``)."""
        return dict(self._device_memory)

    @property
    def time_slice(self) -> nvconfig.TimeSlice | None:
        """The GPU's compute time slice NVIDIA's ``timeSlicingConfig.interval`` asks for; None:
        not asked (the GPU's is left as it is)."""
        return self._time_slice

    def field_name(self, limit: str) -> str:
        """Where the user set the ``cores`` or ``memory`` limit, for messages."""
        return self._field_names[limit]

    @classmethod
    def mapped_from(cls, mapped: nvconfig.Mapped, *, origin: str) -> GpuConfig:
        """The config an NVIDIA config maps onto, remembering where it came from."""
        config = cls.model_validate({"apiVersion": API_VERSION, "kind": KIND, **mapped.fields})
        config._origin = origin
        config._targets = mapped.targets
        config._device_memory = dict(mapped.device_memory)
        config._time_slice = mapped.time_slice
        config._field_names = dict(mapped.field_names)
        return config


DEFAULT = GpuConfig.model_validate({"apiVersion": API_VERSION, "kind": KIND})


def _loc(loc: Sequence[int | str]) -> str:
    return ".".join(str(p) for p in loc)


def _describe(err: Mapping[str, Any], allowed_by_field: Mapping[str, str]) -> str:
    loc = _loc(err["loc"])
    if err["type"] == "extra_forbidden":
        parent, _, name = loc.rpartition(".")
        where = f" in {parent}" if parent else ""
        return f"unknown field {shown(name)}{where}"
    if err["type"] == "missing":
        hint = allowed_by_field.get(loc, "see docs/kubelet-plugin.md")
        return f"{loc}: required (allowed: {hint})"
    value = err.get("input")
    allowed = allowed_by_field.get(loc)
    reason = str(err["msg"]).removeprefix("Value error, ")
    text = f"{loc}: {shown(value)} is not allowed ({reason})"
    return f"{text}; allowed: {allowed}" if allowed else text


def format_config_error(exc: ValidationError, allowed: Mapping[str, str] = ALLOWED) -> str:
    """One line naming each bad field (the first five, and how many there are), its value and
    what it allows."""
    errors = exc.errors()
    text = "; ".join(_describe(err, allowed) for err in errors[:LISTED])
    more = len(errors) - LISTED
    return f"{text}; and {more} more problems" if more > 0 else text


def decode(parameters: Any, *, what: str = "GpuConfig") -> GpuConfig:
    """Decode ``opaque.parameters`` strictly; ``InvalidArgumentError`` says what is wrong."""
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(f"{what}: parameters must be an object, got {shown(parameters)}")
    kind, version = parameters.get("kind"), parameters.get("apiVersion")
    if version == nvconfig.API_VERSION and kind in nvconfig.KINDS:
        return _from_nvidia(parameters, what)
    if version != API_VERSION or kind != KIND:
        raise InvalidArgumentError(
            f"{what}: unsupported apiVersion/kind {shown(version)}/{shown(kind)}; this driver "
            "accepts "
            f"{API_VERSION} {KIND} and NVIDIA's {nvconfig.API_VERSION} "
            f"{' and '.join(nvconfig.KINDS)}"
        )
    try:
        return GpuConfig.model_validate(parameters, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise InvalidArgumentError(f"{what}: {format_config_error(exc)}") from exc


def _from_nvidia(parameters: dict[str, Any], what: str) -> GpuConfig:
    try:
        mapped = nvconfig.translate(parameters)
    except ValidationError as exc:
        raise InvalidArgumentError(f"{what}: {format_config_error(exc, nvconfig.ALLOWED)}") from exc
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from exc
    return GpuConfig.mapped_from(mapped, origin=f"{nvconfig.API_VERSION} {parameters['kind']}")


@dataclass(frozen=True)
class Candidate:
    """A config whose entry matches a request; ``named``: the entry lists requests."""

    config: GpuConfig
    named: bool


def effective_config(candidates: Sequence[Candidate], kind: str, device: str) -> GpuConfig:
    """The config that applies to ``device`` (``kind`` gpu or mig): the last one (class configs
    come before claim configs). NVIDIA's kinds configure one device type, as in NVIDIA's
    driver: one that lists no requests passes over the other type, one that names the request
    of a device of the other type is an error."""
    applicable = []
    for c in candidates:
        if c.config.targets in (None, kind):
            applicable.append(c.config)
        elif c.named:
            what = "a MIG device" if kind == "mig" else "a whole GPU"
            other = "MigDeviceConfig" if kind == "mig" else "GpuConfig"
            raise InvalidArgumentError(
                f"{c.config.origin} cannot configure {device}, {what}; "
                f"use {nvconfig.API_VERSION} {other} for it"
            )
    return applicable[-1] if applicable else DEFAULT
