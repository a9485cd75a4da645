"""What a prepared claim puts into its containers: the claim's CDI spec (DESIGN.md section 2).

One transient spec per claim (``gpuslice_core.cdi.ClaimSpecs``), vendor ``k8s.gpu.gpuslice.dev``,
class ``claim``, devices ``<claimUID>-<device>[-<shareID>]``. The spec's own edits, applied once
per container, state the claim and its limits::

    CUDA_VISIBLE_DEVICES=GPU-…[,MIG-…]     what CUDA may use (UUIDs work for GPUs and MIG)
    GPUSLICE_CLAIM=<namespace>/<name>      GPUSLICE_CLAIM_UID=<uid>
    GPUSLICE_DEVICES=gpu-0,…               GPUSLICE_DEVICE_UUIDS=GPU-…,…
    GPUSLICE_CORES=30,…                    percent of the SMs per device (MIG: the instance's)
    GPUSLICE_MEMORY=21474836480,…          bytes per device
    GPUSLICE_ENFORCEMENT=hard|soft|none    what the limits rest on

plus the enforcer's edits (MPS pipe directory, hooks). Each device's own edits carry
``GPUSLICE_<DEVICE>_UUID/_CORES/_MEMORY`` and the device nodes that exist under the driver root.
The spec is rebuilt from the checkpoint record alone, so recovery can rewrite a lost spec.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Device, DeviceNode, merge_edits
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def env_key(device: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", device.upper())


class CdiWriter:
    """Renders and writes claim specs; device nodes only where they exist on this host."""

    def __init__(self, specs: ClaimSpecs, *, dev_root: Path, nvidia_cdi_kind: str = "") -> None:
        self.specs = specs
        self.dev_root = dev_root
        self.nvidia_cdi_kind = nvidia_cdi_kind

    def _node(self, name: str) -> list[DeviceNode]:
        host = self.dev_root / "dev" / name
        if not host.exists():
            return []
        return [DeviceNode(path=f"/dev/{name}", host_path=str(host))]

    def device_name(self, uid: str, device: DeviceRecord) -> str:
        return self.specs.device_name(uid, device.device, device.share_id)

    def _device(self, uid: str, device: DeviceRecord, minor: int | None) -> Device:
        key = f"GPUSLICE_{env_key(device.device)}"
        env = [f"{key}_UUID={device.uuid}", f"{key}_MEMORY={device.memory_bytes}"]
        if device.cores is not None:
            env.append(f"{key}_CORES={device.cores}")
        nodes = self._node(f"nvidia{minor}") if minor is not None else []
        return Device(
            name=self.device_name(uid, device),
            container_edits=ContainerEdits(env=env, device_nodes=nodes),
        )

    def render(
        self, record: ClaimRecord, minors: dict[str, int]
    ) -> tuple[list[Device], ContainerEdits]:
        """The spec's devices and its claim-wide edits (``minors``: GPU UUID → minor)."""
        devices = [self._device(record.uid, d, minors.get(d.gpu_uuid)) for d in record.devices]
        uuids = [d.uuid for d in record.devices]
        cores = [str(d.cores if d.cores is not None else 100) for d in record.devices]
        env = [
            f"CUDA_VISIBLE_DEVICES={','.join(uuids)}",
            f"GPUSLICE_CLAIM={record.namespace}/{record.name}",
            f"GPUSLICE_CLAIM_UID={record.uid}",
            f"GPUSLICE_DEVICES={','.join(d.device for d in record.devices)}",
            f"GPUSLICE_DEVICE_UUIDS={','.join(uuids)}",
            f"GPUSLICE_CORES={','.join(cores)}",
            f"GPUSLICE_MEMORY={','.join(str(d.memory_bytes) for d in record.devices)}",
            f"GPUSLICE_ENFORCEMENT={record.enforcement}",
        ]
        if any(d.admin_access for d in record.devices):
            env.append("GPUSLICE_ADMIN_ACCESS=true")
        nodes = [n for name in CONTROL_NODES for n in self._node(name)]
        claim_edits = ContainerEdits(env=env, device_nodes=nodes)
        if record.enforcer_edits:
            enforcer = ContainerEdits.model_validate(record.enforcer_edits)
            claim_edits = merge_edits([claim_edits, enforcer])
        return devices, claim_edits

    def write(self, record: ClaimRecord, minors: dict[str, int]) -> dict[str, list[str]]:
        """Write the claim's spec; returns device name (+share) → its CDI ids."""
        devices, claim_edits = self.render(record, minors)
        ids = self.specs.write(record.uid, devices, container_edits=claim_edits)
        out: dict[str, list[str]] = {}
        for device, qualified in zip(record.devices, ids, strict=True):
            extra = []
            if self.nvidia_cdi_kind and device.uuid:
                extra.append(f"{self.nvidia_cdi_kind}={device.uuid}")
            out[self.device_name(record.uid, device)] = [qualified, *extra]
        return out

    def delete(self, uid: str) -> bool:
        return self.specs.delete(uid)

    def exists(self, uid: str) -> bool:
        return self.specs.spec_path(uid).exists()

    def written_at(self, uid: str) -> float:
        """When the claim's spec was written (0 when there is none)."""
        try:
            return self.specs.spec_path(uid).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def claim_uids(self) -> list[str]:
        return self.specs.claim_uids()
