"""What a prepared claim puts into its containers: the claim's CDI spec (docs/cdi.md,
"Naming" and "One device, one set of edits").

One transient spec per claim (``gpuslice_core.cdi.ClaimSpecs``), vendor ``k8s.gpu.gpuslice.dev``,
class ``claim``, one CDI device per allocated device, ``<claimUID>-<device>[-<shareID>]``. The
kubelet hands a container only the ids of the devices whose requests it names, and a runtime
applies a spec's own edits to every container that gets any device of the spec, so the spec has
no edits of its own: everything that describes or exposes a device is in that device's edits.
A container that names several requests or claims gets the union of their devices, and no
device's value replaces another's, because every variable name is unique to its device::

    GPUSLICE_<KEY>_UUID=GPU-…|MIG-…         KEY: the device name (+ the allocation's share ID),
    GPUSLICE_<KEY>_DEVICE=gpu-0                  upper case, other characters as _
    GPUSLICE_<KEY>_CLAIM=<namespace>/<name>
    GPUSLICE_<KEY>_CLAIM_UID=<uid>          GPUSLICE_<KEY>_REQUEST=<request>
    GPUSLICE_<KEY>_CORES=30                 percent of the SMs (100 for whole GPUs and MIG)
    GPUSLICE_<KEY>_MEMORY=21474836480       bytes
    GPUSLICE_<KEY>_ENFORCEMENT=…            exclusive | mig | hard | soft | none
    GPUSLICE_<KEY>_SHARE_ID, _MEMORY_MECHANISM, _CORES_MECHANISM     devices of an enforcer share
    GPUSLICE_<KEY>_ADMIN_ACCESS=true        admin-access results

plus ``NVIDIA_VISIBLE_DEVICES=void`` (NVIDIA's legacy hook must not add GPUs of its own), the
device's node and the control nodes that exist under the driver root, a MIG device's capability
nodes, the driver's compute and utility libraries and binaries (``gpuslice_core.driverroot``),
and on the devices of an enforcer share the enforcer's edits (CDI hooks, MPS). Nothing sets
``CUDA_VISIBLE_DEVICES``: one variable cannot hold a union that several devices contribute to
(a runtime keeps the last value of a name), and CUDA sees exactly the GPUs whose device nodes
the container has, as with NVIDIA's own driver. The spec is rebuilt from the checkpoint record
alone, so recovery can rewrite a lost spec.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Device, Mount, merge_edits
from gpuslice_core.driverroot import VISIBLE_DEVICES_VOID, DriverRoot
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord

MigIds = Mapping[str, tuple[int, int | None]]
"""MIG device UUID → (GPU instance, compute instance; None: every compute instance of it)."""
ENV_PREFIX = "GPUSLICE_"
FIELDS = (
    "UUID",
    "DEVICE",
    "CLAIM",
    "CLAIM_UID",
    "REQUEST",
    "CORES",
    "MEMORY",
    "ENFORCEMENT",
    "SHARE_ID",
    "MEMORY_MECHANISM",
    "CORES_MECHANISM",
    "ADMIN_ACCESS",
)


def env_key(device: str, share_id: str | None = None) -> str:
    """The part of a device's variable names that is unique to it in any container."""
    name = f"{device}-{share_id}" if share_id else device
    return re.sub(r"[^A-Z0-9]", "_", name.upper())


def device_env(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """A container's gpuslice devices from its environment: key → {field: value}, one entry per
    ``GPUSLICE_<KEY>_UUID`` (the inverse of what ``CdiWriter`` writes; tests and tools read it)."""
    keys = [
        name[len(ENV_PREFIX) : -len("_UUID")]
        for name in env
        if name.startswith(ENV_PREFIX) and name.endswith("_UUID")
    ]
    return {
        key: {f: env[f"{ENV_PREFIX}{key}_{f}"] for f in FIELDS if f"{ENV_PREFIX}{key}_{f}" in env}
        for key in keys
    }


def shared_devices(record: ClaimRecord) -> list[DeviceRecord]:
    """The devices the claim's enforcer share covers. Records written before devices carried
    ``shared`` put the enforcer's edits on every GPU of the claim: so do they still."""
    marked = [d for d in record.devices if d.shared]
    if marked or not (record.enforcer_edits or record.enforcer_share_id):
        return marked
    return [d for d in record.devices if d.kind == "gpu" and not d.admin_access]


class CdiWriter:
    """Renders and writes claim specs; device nodes and driver files only where they exist on
    this host."""

    def __init__(self, specs: ClaimSpecs, *, driver: DriverRoot, nvidia_cdi_kind: str = "") -> None:
        self.specs = specs
        self.driver = driver
        self.nvidia_cdi_kind = nvidia_cdi_kind

    def device_name(self, uid: str, device: DeviceRecord) -> str:
        return self.specs.device_name(uid, device.device, device.share_id)

    def _env(self, record: ClaimRecord, device: DeviceRecord, shared: bool) -> list[str]:
        if shared:
            enforcement = record.enforcement
        else:
            enforcement = "mig" if device.kind == "mig" else "exclusive"
        values = {
            "UUID": device.uuid,
            "DEVICE": device.device,
            "CLAIM": record.ref,
            "CLAIM_UID": record.uid,
            "REQUEST": device.request,
            "CORES": str(device.cores if device.cores is not None else 100),
            "MEMORY": str(device.memory_bytes),
            "ENFORCEMENT": enforcement,
        }
        if shared and record.enforcer_share_id:
            values["SHARE_ID"] = record.enforcer_share_id
        if shared and record.memory_mechanism:
            values["MEMORY_MECHANISM"] = record.memory_mechanism
            values["CORES_MECHANISM"] = record.cores_mechanism
        if device.admin_access:
            values["ADMIN_ACCESS"] = "true"
        key = f"{ENV_PREFIX}{env_key(device.device, device.share_id)}"
        return [VISIBLE_DEVICES_VOID] + [f"{key}_{name}={value}" for name, value in values.items()]

    def _device(
        self,
        record: ClaimRecord,
        device: DeviceRecord,
        minor: int | None,
        shared: bool,
        migs: MigIds,
        driver_files: list[Mount],
    ) -> Device:
        nodes = self.driver.gpu_nodes(minor)
        if device.kind == "mig" and minor is not None:
            ids = migs.get(device.uuid)
            if ids is None and device.gpu_instance_id is not None:
                ids = (device.gpu_instance_id, None)  # made for this claim: all of it is ours
            if ids is not None:
                nodes += self.driver.mig_nodes(minor, *ids)
        edits = ContainerEdits(
            env=self._env(record, device, shared),
            device_nodes=nodes,
            mounts=driver_files,
        )
        if shared and record.enforcer_edits:
            edits = merge_edits([edits, ContainerEdits.model_validate(record.enforcer_edits)])
        return Device(name=self.device_name(record.uid, device), container_edits=edits)

    def render(
        self, record: ClaimRecord, minors: Mapping[str, int], migs: MigIds | None = None
    ) -> list[Device]:
        """The spec's devices, each with all of its edits (``minors``: GPU UUID → minor;
        ``migs``: the instances of the node's static MIG devices)."""
        shared = shared_devices(record)
        driver_files = self.driver.user_space()  # the same for every device: looked up once
        return [
            self._device(record, d, minors.get(d.gpu_uuid), d in shared, migs or {}, driver_files)
            for d in record.devices
        ]

    def write(
        self, record: ClaimRecord, minors: Mapping[str, int], migs: MigIds | None = None
    ) -> dict[str, list[str]]:
        """Write the claim's spec; returns device name (+share) → its CDI ids."""
        ids = self.specs.write(record.uid, self.render(record, minors, migs))
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
