"""The fake node's YAML config, decoded strictly.

Unknown keys, duplicate keys and wrongly typed values are errors that name the key
(``gpus[1].migEnabld: unknown key; allowed: ...``). This module checks the shape of the file;
``gpuslice_nvml.fake.node`` checks what needs the catalog (models, MIG profiles, layouts).
See docs/nvml.md for the format.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from gpuslice_core import strict
from gpuslice_core.errors import InvalidArgumentError

DEFAULT_DRIVER_VERSION = "570.158.01"
DEFAULT_CUDA_DRIVER_VERSION = "12.8"
MAX_GPUS = 16


class FakeConfigError(InvalidArgumentError):
    """The fake NVML config file is malformed; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=False,
        frozen=True,
        strict=True,
    )


class MigInstanceConfig(_Strict):
    """A GPU instance that exists when the fake node starts."""

    #: GPU-instance profile name of the GPU's model, e.g. "3g.40gb".
    profile: str
    #: Start of the placement in memory slices; the driver's choice when omitted.
    placement: Annotated[int, Field(ge=0)] | None = None
    #: Instances of this profile to create (must be 1 with ``placement``).
    count: Annotated[int, Field(ge=1, le=8)] = 1
    #: Compute-instance profiles to create inside; default: one spanning the instance.
    compute_instances: list[str] | None = None


class GpuConfig(_Strict):
    """One GPU, or ``count`` identical ones."""

    model: str
    count: Annotated[int, Field(ge=1, le=MAX_GPUS)] = 1
    uuid: (
        Annotated[str, Field(pattern=r"^GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")] | None
    ) = None
    pci_bus_id: (
        Annotated[str, Field(pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")] | None
    ) = None
    pcie_root: Annotated[str, Field(pattern=r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")] | None = None
    numa_node: Annotated[int, Field(ge=0, le=63)] | None = None
    #: What ``nvmlDeviceGetAddressingMode`` answers on a coherent-memory system (Grace Hopper:
    #: ATS); unset: not supported, as on every PCIe system.
    addressing_mode: Literal["ATS", "HMM", "None"] | None = None
    mig_enabled: bool = False
    mig_instances: list[MigInstanceConfig] = []


class NvlinkGroupConfig(_Strict):
    """GPUs connected all-to-all (through NVSwitch or direct links), ``links`` per pair."""

    #: GPU indices; all NVLink-capable GPUs when omitted.
    gpus: list[Annotated[int, Field(ge=0)]] | None = None
    links: Annotated[int, Field(ge=1, le=18)]


class TopologyConfig(_Strict):
    #: NVLink domains; none means every GPU pair talks over PCIe.
    nvlink: list[NvlinkGroupConfig] = []


class FakeNodeConfig(_Strict):
    """The whole file."""

    #: Seeds the GPU UUIDs: give every fake node its own name.
    name: Annotated[str, Field(min_length=1, max_length=253)] = "fake-node"
    driver_version: str = DEFAULT_DRIVER_VERSION
    cuda_driver_version: str = DEFAULT_CUDA_DRIVER_VERSION
    #: The shared state file; relative paths are relative to the config file.
    state_path: str | None = None
    #: How often the "driver" takes per-process utilization samples, in ms; 0: at every call.
    #: A real driver samples on its own cadence, so a reader polling faster gets no sample in
    #: some polls and one covering several polls in others (the GPU stage measures it).
    utilization_sample_ms: Annotated[int, Field(ge=0, le=10_000)] = 0
    gpus: Annotated[list[GpuConfig], Field(min_length=1)]
    topology: TopologyConfig = TopologyConfig()

    @field_validator("driver_version", "cuda_driver_version", mode="before")
    @classmethod
    def _version_is_string(cls, value: object) -> object:
        if isinstance(value, int | float):
            raise ValueError(f'quote the version ("{value}"); YAML read it as a number')
        return value

    @field_validator("driver_version")
    @classmethod
    def _driver_version(cls, value: str) -> str:
        if not re.fullmatch(r"\d+\.\d+(\.\d+)?", value):
            raise ValueError(f"{value!r} is not a driver version like 570.158.01")
        return value

    @field_validator("cuda_driver_version")
    @classmethod
    def _cuda_version(cls, value: str) -> str:
        if not re.fullmatch(r"\d+\.\d+", value):
            raise ValueError(f"{value!r} is not a CUDA version like 12.8")
        return value

    @property
    def cuda_driver_version_int(self) -> int:
        """NVML's encoding: 12.8 -> 12080."""
        major, minor = (int(x) for x in self.cuda_driver_version.split("."))
        return major * 1000 + minor * 10


def parse_config(text: str, *, source: str = "<config>") -> FakeNodeConfig:
    """Decode YAML text into a :class:`FakeNodeConfig` or raise :class:`FakeConfigError`."""
    data = strict.load_yaml(text, source=source, error=FakeConfigError)
    if not isinstance(data, dict):
        raise FakeConfigError(f"{source}: the top level must be a mapping with a 'gpus' key")
    return strict.decode(FakeNodeConfig, data, source=source, error=FakeConfigError)


def load_config_file(path: str | Path) -> FakeNodeConfig:
    """Read and decode a config file (``FakeConfigError`` if it is missing or malformed)."""
    text = strict.read_text(path, what="fake NVML config", error=FakeConfigError)
    return parse_config(text, source=str(path))
