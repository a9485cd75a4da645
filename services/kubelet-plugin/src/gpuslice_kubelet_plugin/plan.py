"""From an allocated claim to what prepare will do: the devices with their granted cores and
memory, the share to ask the enforcer for, and the overlap check against other claims.

Limits of a whole GPU come from the result's ``consumedCapacity`` (the scheduler's accounting,
always present with consumable capacity), else from ``GpuConfig.limits`` (clusters without
consumable capacity), else the whole GPU. Capacity wins over config.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord, PluginState
from gpuslice_kubelet_plugin.claims import AllocatedClaim, ClaimError, Result
from gpuslice_kubelet_plugin.config import GpuConfig
from gpuslice_kubelet_plugin.discovery import CORES, MEMORY, Device, Inventory
from gpuslice_kubelet_plugin.enforcer import ShareRequest
from gpuslice_kubelet_plugin.quantity import MIB, human_bytes, quantity_int


@dataclass(frozen=True)
class Planned:
    result: Result
    device: Device
    cores: int | None
    memory: int

    @property
    def is_share(self) -> bool:
        if self.device.kind != "gpu":
            return False
        whole = self.cores == 100 and self.memory >= self.device.memory_bytes
        return not whole or self.result.config.sharing.strategy is not None

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
    def dynamic_mig(self) -> bool:
        """A MIG instance is created for the claim."""
        return any(p.device.mig is not None and p.device.mig.dynamic for p in self.devices)


def _grant(result: Result, device: Device) -> tuple[int | None, int]:
    config, total = result.config, device.memory_bytes
    if device.kind != "gpu":
        if config.limits.cores is not None or config.limits.memory is not None:
            raise ClaimError(
                "BadConfig",
                f"GpuConfig limits apply to whole GPUs; {device.name} is a MIG device "
                "(its size is its profile)",
            )
        return None, total
    what = f"consumedCapacity of {device.name}"
    if CORES in result.consumed:
        cores = quantity_int(result.consumed[CORES], what=f"{what}.cores")
    else:
        cores = config.limits.cores if config.limits.cores is not None else 100
    if MEMORY in result.consumed:
        memory = quantity_int(result.consumed[MEMORY], what=f"{what}.memory")
    else:
        memory = config.limits.memory if config.limits.memory is not None else total
    if not 1 <= cores <= 100:
        raise ClaimError(
            "BadConfig", f"{device.name}: cores {cores} is not allowed; allowed 1..100"
        )
    if not MIB <= memory <= total:
        raise ClaimError(
            "BadConfig",
            f"limits.memory: {human_bytes(memory)} is not allowed for {device.name}; "
            f"allowed 1Mi..{human_bytes(total)}",
        )
    return cores, memory


def _share(claim: AllocatedClaim, shares: list[Planned]) -> ShareRequest | None:
    if not shares:
        return None
    first = shares[0]
    limits = {(p.cores, p.memory) for p in shares}
    configs = {p.result.config.enforcement for p in shares}
    if len(limits) > 1 or len(configs) > 1:
        names = ", ".join(
            f"{p.device.name} ({p.cores} cores, {human_bytes(p.memory)})" for p in shares
        )
        raise ClaimError(
            "BadConfig",
            f"the enforcer applies one cores/memory limit and one enforcement config per claim; "
            f"the shared devices of ResourceClaim {claim.ref} differ: {names}",
        )
    config: GpuConfig = first.result.config
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


def make_plan(claim: AllocatedClaim, inventory: Inventory, pool: str) -> Plan:
    planned = []
    for result in claim.results:
        device = inventory.get(result.device)
        if device is None:
            raise ClaimError(
                "UnknownDevice",
                f"ResourceClaim {claim.ref}: device {result.device} of request {result.request} "
                f"is not published by this node (pool {pool})",
            )
        cores, memory = _grant(result, device)
        planned.append(Planned(result=result, device=device, cores=cores, memory=memory))
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
