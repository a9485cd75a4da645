"""Declarative MIG layouts in NVIDIA's mig-parted config format (``version: v1``).

    version: v1
    mig-configs:
      all-balanced:
        - device-filter: ["0x20B010DE"]    # optional: PCI device ids (device << 16 | vendor)
          devices: all                     # or a list of GPU indices
          mig-enabled: true
          mig-devices: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}

Decoding is strict: unknown or duplicate keys, wrong types and malformed profile names are
errors that name the key (``mig-configs.all-1g.5gb[0].mig-devics: unknown key; allowed keys
here: device-filter, devices, mig-devices, mig-enabled``). Which profiles a GPU offers is not
known here; :mod:`gpuslice_mig_manager.apply` checks names against NVML.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuslice_core import strict
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_nvml import GpuInfo

#: ``<g>g.<gb>gb`` or ``<c>c.<g>g.<gb>gb`` with an optional attribute suffix.
PROFILE_RE = re.compile(
    r"^(?:(?P<c>[1-9]\d*)c\.)?(?P<g>[1-9]\d*)g\.(?P<gb>\d+)gb(?P<attr>\+me\.all|\+me|\+gfx|-me)?$"
)
_FILTER_RE = re.compile(r"^0x[0-9a-fA-F]{8}$")


class LayoutError(InvalidArgumentError):
    """A layout file is malformed, names an unknown layout, or does not fit the node."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_by_alias=True)


def gpu_instance_profile_of(device_profile: str) -> str:
    """``1c.3g.20gb`` -> ``3g.20gb``; a GPU-instance name is returned unchanged."""
    match = PROFILE_RE.match(device_profile)
    if match is None or match["c"] is None:
        return device_profile
    return device_profile[len(match["c"]) + 2 :]


class DeviceSpec(_Strict):
    """One entry of a mig-config: which GPUs, MIG on or off, and the MIG devices to make."""

    #: PCI device ids; quoted ("0x20B010DE") as NVIDIA writes them, or a YAML integer.
    device_filter: str | int | list[str | int] | None = Field(default=None, alias="device-filter")
    devices: Literal["all"] | list[Annotated[int, Field(ge=0)]]
    mig_enabled: bool = Field(alias="mig-enabled")
    mig_devices: dict[str, Annotated[int, Field(ge=0, le=8)]] | None = Field(
        default=None, alias="mig-devices"
    )

    @field_validator("device_filter")
    @classmethod
    def _filter(
        cls, value: str | int | list[str | int] | None
    ) -> str | int | list[str | int] | None:
        values = value if isinstance(value, list) else ([] if value is None else [value])
        for v in values:
            if isinstance(v, str) and not _FILTER_RE.match(v):
                raise ValueError(f"{v!r} is not a PCI device id like 0x20B010DE")
            if isinstance(v, int) and not 0 < v <= 0xFFFFFFFF:
                raise ValueError(f"{v} is not a PCI device id like 0x20B010DE")
        return value

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: Literal["all"] | list[int]) -> Literal["all"] | list[int]:
        if isinstance(value, list) and len(set(value)) != len(value):
            raise ValueError("GPU indices must not repeat")
        return value

    @field_validator("mig_devices")
    @classmethod
    def _profiles(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        for name in value or {}:
            match = PROFILE_RE.match(name)
            if match is None:
                raise ValueError(
                    f"{name!r} is not a MIG profile name like 1g.10gb, 1c.3g.40gb or 1g.10gb+me"
                )
            if match["c"] is not None and int(match["c"]) >= int(match["g"]):
                raise ValueError(
                    f"{name!r}: a compute instance must be smaller than its GPU instance"
                )
        return value

    @model_validator(mode="after")
    def _enabled_needs_devices(self) -> DeviceSpec:
        if self.mig_enabled and self.mig_devices is None:
            raise ValueError("mig-devices is required when mig-enabled is true ({} allowed)")
        if not self.mig_enabled and self.mig_devices:
            raise ValueError("mig-devices must be empty or absent when mig-enabled is false")
        return self

    @property
    def filters(self) -> list[int]:
        value = self.device_filter
        values = value if isinstance(value, list) else ([] if value is None else [value])
        return [v if isinstance(v, int) else int(v, 16) for v in values]

    def wanted(self) -> dict[str, int]:
        """The requested MIG devices without zero counts."""
        return {k: v for k, v in (self.mig_devices or {}).items() if v > 0}


class LayoutConfig(_Strict):
    """A whole mig-parted config file."""

    version: Literal["v1"]
    mig_configs: dict[str, Annotated[list[DeviceSpec], Field(min_length=1)]] = Field(
        alias="mig-configs"
    )

    def names(self) -> list[str]:
        return sorted(self.mig_configs)

    def get(self, name: str) -> list[DeviceSpec]:
        try:
            return self.mig_configs[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise LayoutError(f"no layout named {name!r}; layouts: {known}") from None


@dataclass(frozen=True)
class GpuTarget:
    """What a layout asks of one GPU."""

    gpu_index: int
    #: The entry of the layout that selected the GPU (``<layout>[<i>]``).
    entry: str
    mig_enabled: bool
    #: Device profile -> count (zero counts dropped).
    devices: dict[str, int]
    #: True when the GPU was named by index or device filter rather than ``devices: all``.
    explicit: bool


def select_targets(
    config: LayoutConfig, name: str, gpus: Sequence[GpuInfo]
) -> dict[int, GpuTarget]:
    """Map each GPU the layout ``name`` selects to what the layout wants of it.

    GPUs no entry selects are left alone. Two entries selecting one GPU is an error; so is an
    index the node does not have.
    """
    specs = config.get(name)
    by_index = {g.index: g for g in gpus}
    targets: dict[int, GpuTarget] = {}
    for i, spec in enumerate(specs):
        entry = f"{name}[{i}]"
        if spec.devices == "all":
            chosen = sorted(by_index)
        else:
            missing = sorted(set(spec.devices) - set(by_index))
            if missing:
                raise LayoutError(
                    f"{entry}: devices {missing} do not exist; the node has GPUs {sorted(by_index)}"
                )
            chosen = list(spec.devices)
        filters = spec.filters
        for index in chosen:
            gpu = by_index[index]
            if filters and gpu.pci_device_id not in filters:
                continue
            if index in targets:
                raise LayoutError(
                    f"{entry} and {targets[index].entry} both select GPU {index}; each GPU may be"
                    " selected by one entry of a layout"
                )
            targets[index] = GpuTarget(
                gpu_index=index,
                entry=entry,
                mig_enabled=spec.mig_enabled,
                devices=spec.wanted(),
                explicit=bool(filters) or spec.devices != "all",
            )
    return targets


# -- decoding ---------------------------------------------------------------------------------


def parse_layouts(text: str, *, source: str = "<layouts>") -> LayoutConfig:
    """Decode mig-parted YAML into a :class:`LayoutConfig` or raise :class:`LayoutError`."""
    data = strict.load_yaml(text, source=source, error=LayoutError)
    if not isinstance(data, dict):
        raise LayoutError(f"{source}: the top level must be a mapping with version and mig-configs")
    return strict.decode(LayoutConfig, data, source=source, error=LayoutError)


def load_layouts_file(path: str | Path) -> LayoutConfig:
    text = strict.read_text(path, what="MIG layout file", error=LayoutError)
    return parse_layouts(text, source=str(path))
