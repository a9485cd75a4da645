"""From an allocated claim to what prepare will do: the devices with their granted cores and
memory, the share to ask the enforcer for, and the overlap check against other claims.

Limits of a whole GPU: a capacity the request asks for by name is the limit, and a config that
sets that limit to something else is refused as a contradiction; a limit the config sets (ours,
or NVIDIA's MPS fields) applies where the request names no capacity — within what the scheduler
granted, the whole GPU by default; otherwise the ``consumedCapacity`` of the result, else the
whole GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice_api.gpuconfig import GpuConfig, effective_config
from gpuslice_api.nvconfig import MPS
from gpuslice_api.quantity import MIB, human_bytes, quantity_int
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord, PluginState
from gpuslice_kubelet_plugin.claims import AllocatedClaim, ClaimError, Result
from gpuslice_kubelet_plugin.discovery import CORES, MEMORY, Device, Inventory
from gpuslice_kubelet_plugin.enforcer import ShareRequest

PER_DEVICE = f"{MPS}.defaultPerDevicePinnedMemoryLimit"


@dataclass(frozen=True)
class Selected:
    """A result, its device and the config that applies to it; ``index``: the device's
    position among the devices that config applies to (NVIDIA's per-device keys)."""

    result: Result
    device: Device
    config: GpuConfig
    index: int


@dataclass(frozen=True)
class Planned:
    result: Result
    device: Device
    config: GpuConfig
    cores: int | None
    memory: int

    @property
    def is_share(self) -> bool:
        """Limits to enforce, or MPS asked for. A whole GPU that is time-sliced needs nothing
        from the enforcer: time-slicing is what a GPU does with several processes."""
        if self.device.kind != "gpu":
            return False
        whole = self.cores == 100 and self.memory >= self.device.memory_bytes
        return not whole or self.config.sharing.strategy == "MPS"

    @property
    def time_slice(self) -> str | None:
        """The GPU's compute time slice the config asks for (NVIDIA's ``timeSlicingConfig.
        interval``; whole GPUs only), set at prepare (``timeslice``)."""
        return self.config.time_slice if self.device.kind == "gpu" else None

    def record(self) -> DeviceRecord:
        return DeviceRecord(
            request=self.result.request,
            pool=self.result.pool,
            device=self.device.name,
            kind=self.device.kind,
            share_id=self.result.share_id,
            gpu_uuid=self.device.gpu_uuid,
            uuid=self.device.uuid,
            cores=self.cores,
            memory_bytes=self.memory,
            total_memory_bytes=self.device.memory_bytes,
            admin_access=self.result.admin_access,
            shared=self.is_share and not self.result.admin_access,
            time_slice=self.time_slice,
        )


@dataclass(frozen=True)
class Plan:
    claim: AllocatedClaim
    devices: tuple[Planned, ...]
    share: ShareRequest | None

    @property
    def uid(self) -> str:
        return self.claim.ref.uid

    @property
    def sets_time_slice(self) -> bool:
        """A GPU's time slice is set for the claim (a side effect outside this node's files)."""
        return any(p.time_slice for p in self.devices)

    @property
    def dynamic_mig(self) -> bool:
        """A MIG instance is created for the claim."""
        return any(p.device.mig is not None and p.device.mig.dynamic for p in self.devices)


def _limit(
    result: Result, config: GpuConfig, name: str, field: str, setting: int | None
) -> int | None:
    """The limit ``name`` (cores or memory) of a whole GPU: see the module docstring."""
    consumed = result.consumed.get(name)
    what = f"consumedCapacity.{name} of {result.device}"
    granted = quantity_int(consumed, what=what) if consumed is not None else None
    if setting is None or granted is None:
        return setting if setting is not None else granted
    shown = human_bytes(setting) if name == MEMORY else str(setting)
    if name in result.requested and setting != granted:
        raise ClaimError(
            "BadConfig",
            f"request {result.request} asks for {name} {consumed} (capacity) and its "
            f"{config.origin} sets {field} to {shown}: capacity requests win, so the two "
            f"contradict; drop {field} or make it match",
        )
    if setting > granted:
        raise ClaimError(
            "BadConfig",
            f"{config.origin} sets {field} to {shown}, more than the {consumed} of {name} the "
            f"scheduler granted request {result.request} on {result.device}",
        )
    return setting


def _device_memory(config: GpuConfig, index: int, device: Device) -> tuple[int, str] | None:
    """NVIDIA's per-device memory limit of the ``index``-th device of the config, if set."""
    per_device = config.device_memory
    for key in (str(index), device.uuid):
        if key in per_device:
            return per_device[key], f"{PER_DEVICE}[{key}]"
    return None


def _grant(p: Selected) -> tuple[int | None, int]:
    result, device, config = p.result, p.device, p.config
    total = device.memory_bytes
    if device.kind != "gpu":
        if config.limits.cores is not None or config.limits.memory is not None:
            raise ClaimError(
                "BadConfig",
                f"{config.origin} limits apply to whole GPUs; {device.name} is a MIG device "
                "(its size is its profile)",
            )
        return None, total
    per_device = _device_memory(config, p.index, device)
    memory_setting, memory_field = per_device or (config.limits.memory, config.field_name(MEMORY))
    cores = _limit(result, config, CORES, config.field_name(CORES), config.limits.cores)
    memory = _limit(result, config, MEMORY, memory_field, memory_setting)
    cores = 100 if cores is None else cores
    memory = total if memory is None else memory
    if not 1 <= cores <= 100:
        raise ClaimError(
            "BadConfig", f"{device.name}: cores {cores} is not allowed; allowed 1..100"
        )
    if not MIB <= memory <= total:
        raise ClaimError(
            "BadConfig",
            f"{memory_field}: {human_bytes(memory)} is not allowed for {device.name}; "
            f"allowed 1Mi..{human_bytes(total)}",
        )
    return cores, memory


def _share(claim: AllocatedClaim, shares: list[Planned]) -> ShareRequest | None:
    if not shares:
        return None
    first = shares[0]
    limits = {(p.cores, p.memory) for p in shares}
    configs = {p.config.enforcement for p in shares}
    if len(limits) > 1 or len(configs) > 1:
        names = ", ".join(
            f"{p.device.name} ({p.cores} cores, {human_bytes(p.memory)})" for p in shares
        )
        raise ClaimError(
            "BadConfig",
            f"the enforcer applies one cores/memory limit and one enforcement config per claim; "
            f"the shared devices of ResourceClaim {claim.ref} differ: {names}",
        )
    config: GpuConfig = first.config
    mode = config.enforcement.mode
    if mode == "Auto" and config.sharing.strategy == "MPS":
        mode = "Hard"
    return ShareRequest(
        claim_uid=claim.ref.uid,
        namespace=claim.ref.namespace,
        name=claim.ref.name,
        pods=claim.pods,
        device_uuids=tuple(p.device.uuid for p in shares),
        cores=first.cores or 100,
        memory_bytes=first.memory,
        mode=mode,
        strict=config.enforcement.strict,
        work_conserving=config.enforcement.work_conserving,
    )


def _select(claim: AllocatedClaim, inventory: Inventory, pool: str) -> list[Selected]:
    selected: list[Selected] = []
    for result in claim.results:
        device = inventory.get(result.device)
        if device is None:
            raise ClaimError(
                "UnknownDevice",
                f"ResourceClaim {claim.ref}: device {result.device} of request {result.request} "
                f"is not published by this node (pool {pool})",
            )
        try:
            config = effective_config(result.configs, device.kind, device.name)
        except InvalidArgumentError as exc:
            raise ClaimError("BadConfig", f"ResourceClaim {claim.ref}: {exc}") from exc
        index = sum(1 for s in selected if s.config is config)
        selected.append(Selected(result, device, config, index))
    return selected


def _check_device_keys(claim: AllocatedClaim, selected: list[Selected]) -> None:
    """Every key of a per-device memory limit names a device its config applies to."""
    for config in {id(s.config): s.config for s in selected}.values():
        devices = [s.device for s in selected if s.config is config]
        for key in config.device_memory:
            if key not in {str(i) for i in range(len(devices))} | {d.uuid for d in devices}:
                raise ClaimError(
                    "BadConfig",
                    f"ResourceClaim {claim.ref}: {config.origin} {PER_DEVICE}: device {key!r} "
                    f"is neither an index (0..{len(devices) - 1}) nor the UUID of a device it "
                    f"applies to ({', '.join(d.name for d in devices)})",
                )


def make_plan(claim: AllocatedClaim, inventory: Inventory, pool: str) -> Plan:
    selected = _select(claim, inventory, pool)
    _check_device_keys(claim, selected)
    planned = []
    for s in selected:
        cores, memory = _grant(s)
        planned.append(Planned(s.result, s.device, s.config, cores, memory))
    shares = [p for p in planned if p.is_share and not p.result.admin_access]
    return Plan(claim=claim, devices=tuple(planned), share=_share(claim, shares))


def check_overlap(plan: Plan, state: PluginState) -> None:
    """The last line of defence: no device is handed out beyond what it has."""
    usage: dict[str, list[tuple[ClaimRecord, DeviceRecord]]] = {}
    for record in state.claims.values():
        if record.uid == plan.uid:
            continue
        for d in record.devices:
            if not d.admin_access:
                usage.setdefault(d.device, []).append((record, d))
    for p in plan.devices:
        others = usage.get(p.device.name)
        if p.result.admin_access or not others:
            continue
        holders = ", ".join(f"{r.ref} ({r.uid})" for r, _ in others)
        if p.device.kind != "gpu":
            raise ClaimError(
                "DeviceInUse",
                f"device {p.device.name} is already prepared for ResourceClaim {holders}",
            )
        cores = sum(d.cores or 100 for _, d in others)
        memory = sum(d.memory_bytes for _, d in others)
        if cores + (p.cores or 100) > 100 or memory + p.memory > p.device.memory_bytes:
            raise ClaimError(
                "DeviceInUse",
                f"device {p.device.name} is already prepared for ResourceClaim {holders} with "
                f"{cores} cores and {human_bytes(memory)}; this claim's {p.cores} cores and "
                f"{human_bytes(p.memory)} do not fit in 100 cores and "
                f"{human_bytes(p.device.memory_bytes)}",
            )
