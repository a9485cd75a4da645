"""The fake node's fixed facts, resolved from the config and the catalog.

Everything here is static and computed the same way in every process that reads the config:
GPU UUIDs (derived from the node name unless given), PCI addresses, NUMA nodes, NVLink wiring
and the initial MIG layout. Whatever changes at run time lives in the state file instead.
"""

from __future__ import annotations

import hashlib
import tempfile
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from gpuslice_nvml.errors import NvmlError
from gpuslice_nvml.fake import mig
from gpuslice_nvml.fake.catalog import GpuModel, describe_catalog, find_model
from gpuslice_nvml.fake.config import (
    FakeConfigError,
    FakeNodeConfig,
    GpuConfig,
    MigInstanceConfig,
    load_config_file,
)
from gpuslice_nvml.fake.state import GpuState, NodeState
from gpuslice_nvml.types import (
    ComputeInstanceProfile,
    GpuInstanceProfile,
    GpuLink,
    Placement,
    TopologyLevel,
)

_UUID_NAMESPACE = uuid.UUID("5d7f6c2e-0b1a-4e55-9a35-3f1b8c2a7d10")


@dataclass(frozen=True)
class FakeGpu:
    """One simulated GPU's fixed facts."""

    index: int
    model: GpuModel
    uuid: str
    pci_bus_id: str
    pcie_root: str
    numa_node: int
    #: The index of the config's ``gpus`` entry the GPU comes from.
    entry: int
    #: ``nvmlDeviceGetAddressingMode``'s answer; None: not supported.
    addressing_mode: str | None = None

    @property
    def source(self) -> str:
        """The config key of the GPU's entry, for error messages ("gpus[1]")."""
        return f"gpus[{self.entry}]"

    @cached_property
    def gi_profiles(self) -> tuple[GpuInstanceProfile, ...]:
        return self.model.gpu_instance_profiles()

    def gi_profile(self, profile_id: int) -> GpuInstanceProfile | None:
        return next((p for p in self.gi_profiles if p.id == profile_id), None)

    def ci_profiles(self, gi_profile: GpuInstanceProfile) -> tuple[ComputeInstanceProfile, ...]:
        return self.model.compute_instance_profiles(gi_profile)

    def mig_uuid(self, gi_id: int, ci_id: int) -> str:
        """Deterministic MIG device UUID for (this GPU, GPU instance, compute instance)."""
        return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{self.uuid}/{gi_id}/{ci_id}')}"


@dataclass(frozen=True)
class FakeNode:
    """The whole simulated node."""

    name: str
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[FakeGpu, ...]
    #: NVLinks per GPU pair (unordered pairs).
    nvlinks: dict[frozenset[int], int]
    state_path: Path
    #: Identifies the config; a state file made from another config is discarded.
    digest: str
    config: FakeNodeConfig = field(repr=False)

    def link(self, a: int, b: int) -> GpuLink:
        if a == b:
            return GpuLink(TopologyLevel.INTERNAL, 0)
        ga, gb = self.gpus[a], self.gpus[b]
        if ga.pcie_root == gb.pcie_root:
            level = TopologyLevel.HOSTBRIDGE
        elif ga.numa_node == gb.numa_node:
            level = TopologyLevel.NODE
        else:
            level = TopologyLevel.SYSTEM
        return GpuLink(level, self.nvlinks.get(frozenset((a, b)), 0))

    def initial_state(self) -> NodeState:
        """The state the node starts in: MIG modes and instances from the config."""
        state = NodeState(config_digest=self.digest, gpus=[])
        for gpu in self.gpus:
            cfg = self.config.gpus[gpu.entry]
            gs = GpuState(mig_current=cfg.mig_enabled, mig_pending=cfg.mig_enabled)
            for j, inst in enumerate(cfg.mig_instances):
                _create_initial(gpu, gs, inst, f"{gpu.source}.migInstances[{j}]")
            state.gpus.append(gs)
        return state


def load_node(path: str | Path) -> FakeNode:
    """Read a config file and resolve it into a :class:`FakeNode` (``FakeConfigError``)."""
    file = Path(path)
    return build_node(load_config_file(file), config_path=file)


def build_node(config: FakeNodeConfig, *, config_path: Path | None = None) -> FakeNode:
    """Resolve ``config`` against the catalog; every semantic error names its key."""
    source = str(config_path) if config_path else "<config>"
    gpus: list[FakeGpu] = []
    for i, entry in enumerate(config.gpus):
        gpus.extend(_expand(config, entry, i, first_index=len(gpus), source=source))
    if len(gpus) > 16:
        raise FakeConfigError(f"{source}: gpus: {len(gpus)} GPUs; a fake node has at most 16")
    _check_unique(gpus, source)
    node = FakeNode(
        name=config.name,
        driver_version=config.driver_version,
        cuda_driver_version=config.cuda_driver_version_int,
        gpus=tuple(gpus),
        nvlinks=_nvlinks(config, gpus, source),
        state_path=_state_path(config, config_path),
        digest=hashlib.sha256(config.model_dump_json().encode()).hexdigest(),
        config=config,
    )
    try:
        node.initial_state()
    except FakeConfigError as exc:
        raise FakeConfigError(f"{source}: {exc}") from exc
    return node


def _expand(
    config: FakeNodeConfig, entry: GpuConfig, entry_index: int, *, first_index: int, source: str
) -> list[FakeGpu]:
    where = f"gpus[{entry_index}]"
    model = find_model(entry.model)
    if model is None:
        raise FakeConfigError(
            f"{source}: {where}.model: unknown GPU model {entry.model!r}; "
            f"the catalog has {describe_catalog()}"
        )
    if entry.count > 1 and (entry.uuid or entry.pci_bus_id or entry.pcie_root):
        raise FakeConfigError(
            f"{source}: {where}: uuid, pciBusId and pcieRoot name one GPU; use count: 1"
        )
    if (entry.mig_enabled or entry.mig_instances) and not model.mig_capable:
        raise FakeConfigError(f"{source}: {where}: {model.product_name} does not support MIG")
    if entry.mig_instances and not entry.mig_enabled:
        raise FakeConfigError(f"{source}: {where}.migInstances: needs migEnabled: true")
    gpus = []
    for index in range(first_index, first_index + entry.count):
        bus_id = entry.pci_bus_id or f"0000:{0x18 + 0x0E * index:02x}:00.0"
        domain, bus = bus_id.split(":")[:2]
        gpus.append(
            FakeGpu(
                index=index,
                model=model,
                uuid=entry.uuid or f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{config.name}/{index}')}",
                pci_bus_id=bus_id,
                pcie_root=entry.pcie_root or f"pci{domain}:{int(bus, 16) - 1:02x}",
                numa_node=entry.numa_node if entry.numa_node is not None else 0,
                entry=entry_index,
                addressing_mode=entry.addressing_mode,
            )
        )
    return gpus


def _check_unique(gpus: list[FakeGpu], source: str) -> None:
    for attr in ("uuid", "pci_bus_id"):
        seen: dict[str, FakeGpu] = {}
        for gpu in gpus:
            value = getattr(gpu, attr)
            if value in seen:
                raise FakeConfigError(
                    f"{source}: {gpu.source}: GPU {gpu.index} has the same {attr} as GPU "
                    f"{seen[value].index} ({value})"
                )
            seen[value] = gpu


def _nvlinks(config: FakeNodeConfig, gpus: list[FakeGpu], source: str) -> dict[frozenset[int], int]:
    links: dict[frozenset[int], int] = {}
    grouped: dict[int, int] = {}
    for g, group in enumerate(config.topology.nvlink):
        where = f"{source}: topology.nvlink[{g}]"
        members = (
            group.gpus
            if group.gpus is not None
            else [gpu.index for gpu in gpus if gpu.model.max_nvlinks]
        )
        if len(set(members)) < 2:
            raise FakeConfigError(f"{where}.gpus: an NVLink group needs at least two GPUs")
        for index in members:
            if index >= len(gpus):
                raise FakeConfigError(f"{where}.gpus: no GPU {index} (the node has {len(gpus)})")
            model = gpus[index].model
            if group.links > model.max_nvlinks:
                raise FakeConfigError(
                    f"{where}.links: GPU {index} ({model.product_name}) has "
                    f"{model.max_nvlinks} NVLinks, not {group.links}"
                )
            if index in grouped and grouped[index] != g:
                raise FakeConfigError(
                    f"{where}.gpus: GPU {index} is already in topology.nvlink[{grouped[index]}]"
                )
            grouped[index] = g
        for a in members:
            for b in members:
                if a != b:
                    links[frozenset((a, b))] = group.links
    return links


def _state_path(config: FakeNodeConfig, config_path: Path | None) -> Path:
    if config.state_path:
        path = Path(config.state_path).expanduser()
        if not path.is_absolute():
            if config_path is None:
                raise FakeConfigError("statePath: must be absolute when the config has no file")
            path = config_path.resolve().parent / path
        return path
    if config_path is None:
        raise FakeConfigError("statePath: required when the config is not read from a file")
    key = hashlib.sha256(str(config_path.resolve()).encode()).hexdigest()[:12]
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in config.name)
    return Path(tempfile.gettempdir()) / "gpuslice-fake-nvml" / f"{safe_name}-{key}.json"


def _create_initial(gpu: FakeGpu, gs: GpuState, inst: MigInstanceConfig, where: str) -> None:
    profile = next((p for p in gpu.gi_profiles if p.name == inst.profile), None)
    if profile is None:
        names = ", ".join(p.name for p in gpu.gi_profiles)
        raise FakeConfigError(
            f"{where}.profile: {inst.profile!r} is not a GPU instance profile of "
            f"{gpu.model.product_name}; it has {names}"
        )
    if inst.placement is not None and inst.count > 1:
        raise FakeConfigError(f"{where}: placement names one instance; use count: 1")
    placement = None
    if inst.placement is not None:
        placement = Placement(inst.placement, profile.memory_slices)
    ci_names = inst.compute_instances if inst.compute_instances is not None else [profile.name]
    offered = {p.name: p for p in gpu.ci_profiles(profile)}
    for k, name in enumerate(ci_names):
        if name not in offered:
            raise FakeConfigError(
                f"{where}.computeInstances[{k}]: {name!r} is not a compute instance profile of "
                f"{profile.name}; it has {', '.join(offered)}"
            )
    try:
        for _ in range(inst.count):
            gi = mig.create_gi(gpu, gs, profile.id, placement)
            for name in ci_names:
                mig.create_ci(gpu, gs, gi.id, offered[name].id)
    except NvmlError as exc:
        raise FakeConfigError(f"{where}: the layout does not fit: {exc}") from exc
