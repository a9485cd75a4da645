"""NVIDIA's opaque claim configuration, ``resource.nvidia.com/v1beta1`` ``GpuConfig`` and
``MigDeviceConfig``, decoded strictly and mapped onto gpuslice's ``GpuConfig``
(docs/nvidia-config.md), so that claims written for NVIDIA's DRA driver work unchanged under
``driver: gpu.gpuslice.dev``::

    sharing:
      strategy: TimeSlicing | MPS
      timeSlicingConfig: {interval: Default|Short|Medium|Long}   GpuConfig only -> time_slice
      mpsConfig:
        defaultActiveThreadPercentage: 50                    -> limits.cores
        defaultPinnedDeviceMemoryLimit: 10Gi                 -> limits.memory
        defaultPerDevicePinnedMemoryLimit: {"0": 4Gi}        -> that device's memory limit
        multiUser: false

Every field of the versions NVIDIA ships is known. The time-slice interval is honoured as
NVIDIA's driver honours it: the kubelet plugin sets the GPU's compute time slice at prepare
(``nvidia-smi compute-policy --set-timeslice``, NVML has no call for it) and puts it back to
``Default`` when the GPU's last such claim is unprepared (docs/nvidia-config.md). A field
gpuslice cannot honour is refused by name with the reason, never dropped: ``multiUser: true``
(the enforcer's MPS daemons are multi-user or not for the whole node), and MPS on a MIG device
(the enforcer shares whole GPUs; a MIG device is isolated by MIG).
This module knows only the shape of gpuslice's API (``Mapped.fields``), not its model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuslice_api.quantity import memory_quantity
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_core.untrusted import shown

API_VERSION = "resource.nvidia.com/v1beta1"
KINDS = ("GpuConfig", "MigDeviceConfig")
MPS = "sharing.mpsConfig"

ALLOWED: dict[str, str] = {
    "sharing.strategy": "TimeSlicing, MPS",
    "sharing.timeSlicingConfig.interval": "Default, Short, Medium, Long",
    f"{MPS}.defaultActiveThreadPercentage": "an integer 1..100 (percent of the GPU's SMs)",
    f"{MPS}.defaultPinnedDeviceMemoryLimit": "a quantity of at least 1Mi, e.g. 10Gi",
    f"{MPS}.defaultPerDevicePinnedMemoryLimit": "device index or UUID: a quantity, e.g. 4Gi",
    f"{MPS}.multiUser": "false",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=False)


class MpsConfig(_Strict):
    default_active_thread_percentage: int | None = Field(
        default=None, alias="defaultActiveThreadPercentage", ge=1, le=100
    )
    default_pinned_device_memory_limit: int | None = Field(
        default=None, alias="defaultPinnedDeviceMemoryLimit"
    )
    default_per_device_pinned_memory_limit: dict[str, int] = Field(
        default_factory=dict, alias="defaultPerDevicePinnedMemoryLimit"
    )
    multi_user: bool | None = Field(default=None, alias="multiUser")

    @field_validator("default_pinned_device_memory_limit", mode="plain")
    @classmethod
    def _default_limit(cls, value: Any) -> int | None:
        return None if value is None else memory_quantity(value, floor_mib=True)

    @field_validator("default_per_device_pinned_memory_limit", mode="plain")
    @classmethod
    def _per_device(cls, value: Any) -> dict[str, int]:
        if not isinstance(value, dict):
            raise ValueError("must be a map of device index or UUID to a quantity")
        out = {}
        for key, quantity in value.items():
            try:
                out[str(key)] = memory_quantity(quantity, floor_mib=True)
            except ValueError as exc:
                raise ValueError(f"device {shown(key)}: {shown(quantity)}: {exc}") from exc
        return out


TimeSlice = Literal["Default", "Short", "Medium", "Long"]
TIME_SLICE = "sharing.timeSlicingConfig.interval"


class TimeSlicingConfig(_Strict):
    interval: TimeSlice | None = None


class GpuSharing(_Strict):
    strategy: Literal["TimeSlicing", "MPS"]
    time_slicing_config: TimeSlicingConfig | None = Field(default=None, alias="timeSlicingConfig")
    mps_config: MpsConfig | None = Field(default=None, alias="mpsConfig")


class MigDeviceSharing(_Strict):
    strategy: Literal["TimeSlicing", "MPS"]
    mps_config: MpsConfig | None = Field(default=None, alias="mpsConfig")


class NvidiaGpuConfig(_Strict):
    api_version: Literal["resource.nvidia.com/v1beta1"] = Field(alias="apiVersion")
    kind: Literal["GpuConfig"]
    sharing: GpuSharing | None = None


class NvidiaMigDeviceConfig(_Strict):
    api_version: Literal["resource.nvidia.com/v1beta1"] = Field(alias="apiVersion")
    kind: Literal["MigDeviceConfig"]
    sharing: MigDeviceSharing | None = None


@dataclass(frozen=True)
class Mapped:
    """An NVIDIA config in gpuslice's terms."""

    fields: dict[str, Any]  # gpuslice GpuConfig fields (sharing, limits), as a user writes them
    targets: Literal["gpu", "mig"]
    device_memory: Mapping[str, int] = field(default_factory=dict)
    time_slice: TimeSlice | None = None  # timeSlicingConfig.interval: the GPU's time slice
    field_names: Mapping[str, str] = field(
        default_factory=lambda: {
            "cores": f"{MPS}.defaultActiveThreadPercentage",
            "memory": f"{MPS}.defaultPinnedDeviceMemoryLimit",
        }
    )


def _refuse(path: str, value: str, why: str, allowed: str = "") -> InvalidArgumentError:
    allowed = allowed or ALLOWED[path]
    return InvalidArgumentError(f"{path}: {value} cannot be honoured: {why}; allowed: {allowed}")


def _mismatch(path: str, strategy: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{path} is not allowed with sharing.strategy {strategy}")


def _mps(mps: MpsConfig | None) -> tuple[dict[str, Any], dict[str, int]]:
    """(gpuslice limits, per-device memory) of an MPS config."""
    if mps is None:
        return {}, {}
    if mps.multi_user:
        raise _refuse(
            f"{MPS}.multiUser",
            "true",
            "the enforcer's MPS daemons are multi-user or not for the whole node "
            "(its --mps-multiuser flag), not per claim",
        )
    limits: dict[str, Any] = {}
    if mps.default_active_thread_percentage is not None:
        limits["cores"] = mps.default_active_thread_percentage
    if mps.default_pinned_device_memory_limit is not None:
        limits["memory"] = mps.default_pinned_device_memory_limit
    return limits, dict(mps.default_per_device_pinned_memory_limit)


def _gpu(config: NvidiaGpuConfig) -> Mapped:
    sharing = config.sharing
    if sharing is None:
        return Mapped(fields={}, targets="gpu")
    if sharing.strategy == "TimeSlicing":
        if sharing.mps_config is not None:
            raise _mismatch("sharing.mpsConfig", "TimeSlicing")
        interval = sharing.time_slicing_config.interval if sharing.time_slicing_config else None
        return Mapped(
            fields={"sharing": {"strategy": "TimeSlicing"}}, targets="gpu", time_slice=interval
        )
    if sharing.time_slicing_config is not None:
        raise _mismatch("sharing.timeSlicingConfig", "MPS")
    limits, per_device = _mps(sharing.mps_config)
    fields = {"sharing": {"strategy": "MPS"}, **({"limits": limits} if limits else {})}
    return Mapped(fields=fields, targets="gpu", device_memory=per_device)


def _mig(config: NvidiaMigDeviceConfig) -> Mapped:
    sharing = config.sharing
    if sharing is not None and sharing.strategy == "MPS":
        raise _refuse(
            "sharing.strategy",
            "'MPS'",
            "the gpuslice enforcer does not run MPS inside MIG devices (a MIG device is "
            "isolated by MIG, and its size is its profile)",
            allowed="TimeSlicing (or no sharing)",
        )
    # TimeSlicing on a MIG device: the processes of the claim's containers time-slice it, which
    # is what a MIG device does anyway; NVIDIA's driver sets nothing for it either.
    fields = {"sharing": {"strategy": "TimeSlicing"}} if sharing is not None else {}
    return Mapped(fields=fields, targets="mig")


def translate(parameters: dict[str, Any]) -> Mapped:
    """Decode NVIDIA's config strictly (pydantic ``ValidationError`` on a bad or unknown field,
    ``InvalidArgumentError`` on a field gpuslice cannot honour) and map it."""
    if parameters.get("kind") == "MigDeviceConfig":
        return _mig(NvidiaMigDeviceConfig.model_validate(parameters, by_alias=True, by_name=False))
    return _gpu(NvidiaGpuConfig.model_validate(parameters, by_alias=True, by_name=False))
