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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuslice_core.errors import InvalidArgumentError
from gpuslice_kubelet_plugin.quantity import MIB, parse_quantity, quantity_int

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
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError("must be a quantity string such as 20Gi")
        try:
            parsed = parse_quantity(value, what="limits.memory")
        except InvalidArgumentError as exc:
            raise ValueError("not a quantity (examples: 20Gi, 512Mi)") from exc
        if parsed < MIB:
            raise ValueError("must be at least 1Mi")
        return quantity_int(value)


class GpuConfig(_Strict):
    api_version: Literal["gpu.gpuslice.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["GpuConfig"]
    sharing: Sharing = Sharing()
    enforcement: Enforcement = Enforcement()
    limits: Limits = Limits()


DEFAULT = GpuConfig.model_validate({"apiVersion": API_VERSION, "kind": KIND})


def _loc(loc: Sequence[int | str]) -> str:
    return ".".join(str(p) for p in loc)


def _describe(err: Mapping[str, Any]) -> str:
    loc = _loc(err["loc"])
    if err["type"] == "extra_forbidden":
        parent, _, name = loc.rpartition(".")
        where = f" in {parent}" if parent else ""
        return f"unknown field {name!r}{where}"
    if err["type"] == "missing":
        return f"{loc}: required (allowed: {ALLOWED.get(loc, 'see docs/kubelet-plugin.md')})"
    value = err.get("input")
    allowed = ALLOWED.get(loc)
    reason = str(err["msg"]).removeprefix("Value error, ")
    text = f"{loc}: {value!r} is not allowed ({reason})"
    return f"{text}; allowed: {allowed}" if allowed else text


def format_config_error(exc: ValidationError) -> str:
    """One line naming every bad field, its value and what it allows."""
    return "; ".join(_describe(err) for err in exc.errors())


def decode(parameters: Any, *, what: str = "GpuConfig") -> GpuConfig:
    """Decode ``opaque.parameters`` strictly; ``InvalidArgumentError`` says what is wrong."""
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(f"{what}: parameters must be an object, got {parameters!r}")
    kind, version = parameters.get("kind"), parameters.get("apiVersion")
    if version != API_VERSION or kind != KIND:
        raise InvalidArgumentError(
            f"{what}: unsupported apiVersion/kind {version!r}/{kind!r}; "
            f"this driver accepts {API_VERSION} {KIND}"
        )
    try:
        return GpuConfig.model_validate(parameters, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise InvalidArgumentError(f"{what}: {format_config_error(exc)}") from exc


def effective_config(configs: Sequence[GpuConfig]) -> GpuConfig:
    """The config that applies: the last one (class configs come before claim configs)."""
    return configs[-1] if configs else DEFAULT
