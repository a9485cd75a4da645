"""``sharing.mps``: every replica of a GPU is an equal share that the enforcer sidecar holds.

At start, for each GPU of an MPS resource and each replica ``n`` of ``N``, the plugin asks the
enforcer (``gpuslice.v1.Enforcer/CreateShare``, mode AUTO: the strongest mechanism the GPU has)
for a share of ``100 // N`` percent of the SMs and ``total memory / N`` (whole MiB). The share's
"claim" is the replica: UID ``dp-<GPU UUID>-<n>``, namespace ``gpuslice-device-plugin``, name
the replica's device ID. CreateShare is idempotent, so a restarted plugin gets the same shares;
shares of an earlier configuration (another replica count, a GPU no longer shared) are released
first.

The enforcer's container edits (the MPS pipe directory, the ``createContainer`` hook that binds a
container's cgroup to the share) must reach exactly the container that got the replica, and the
device plugin API has no hooks. So each replica is one CDI device (vendor/class
``k8s.gpu.gpuslice.dev/device-plugin``, one spec file per resource in the CDI root) whose edits
hold *everything* the container gets for it: the enforcer's edits, the visibility that the
``deviceListStrategy`` would otherwise put into the Allocate response (``NVIDIA_VISIBLE_DEVICES``,
the volume mounts, the device nodes) and variables that state the limits. Allocate returns only
that CDI device (``cdi_devices``, which kubelets have passed to the runtime since 1.31): a
runtime that cannot inject CDI devices fails the container instead of starting it with the GPU
and without its limits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuslice_api.enforcer import cdi_edits, level_name, mechanism_name
from gpuslice_api.names import CDI_VENDOR
from gpuslice_core import cdi
from gpuslice_core.errors import FailedPreconditionError, GpusliceError
from gpuslice_core.grpcclient import UnixClient
from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.devices import Device, Resource
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as dp

log = get_logger(__name__)

CDI_CLASS = "device-plugin"
SHARE_PREFIX = "dp-"
SHARE_NAMESPACE = "gpuslice-device-plugin"
MIB = 1024 * 1024


class EnforcerError(FailedPreconditionError):
    """The enforcer refused a share or cannot be reached; the message says which and why."""


@dataclass(frozen=True)
class ReplicaShare:
    """What one MPS replica gets, as the enforcer granted it."""

    device_id: str
    share_id: str
    cores: int
    memory_bytes: int
    level: str
    memory_mechanism: str
    cores_mechanism: str
    reason: str
    cdi_id: str


def share_uid(device: Device) -> str:
    return f"{SHARE_PREFIX}{device.uuid}-{device.replica}"


def split(replicas: int, memory_total: int) -> tuple[int, int]:
    """Cores (percent) and memory (bytes, whole MiB) of one of ``replicas`` equal shares."""
    return 100 // replicas, memory_total // replicas // MIB * MIB


def edits_from_response(response: dp.ContainerAllocateResponse) -> cdi.ContainerEdits:
    """The visibility part of an Allocate response as CDI edits (annotations and CDI names
    stay in the response: they are not container edits)."""
    return cdi.ContainerEdits(
        env=[f"{k}={v}" for k, v in sorted(response.envs.items())],
        mounts=[
            cdi.Mount(
                host_path=m.host_path,
                container_path=m.container_path,
                options=["bind", "ro"] if m.read_only else ["bind"],
            )
            for m in response.mounts
        ],
        device_nodes=[
            cdi.DeviceNode(path=d.container_path, host_path=d.host_path, permissions=d.permissions)
            for d in response.devices
        ],
    )


def limit_env(device_name: str, share: ReplicaShare, uuid: str) -> list[str]:
    """``GPUSLICE_<KEY>_<FIELD>`` variables (docs/cdi.md), KEY = the CDI device name."""
    key = "".join(c if c.isalnum() else "_" for c in device_name).upper()
    fields = {
        "UUID": uuid,
        "DEVICE": share.device_id,
        "CORES": str(share.cores),
        "MEMORY": str(share.memory_bytes),
        "ENFORCEMENT": share.level,
        "SHARE_ID": share.share_id,
        "MEMORY_MECHANISM": share.memory_mechanism,
        "CORES_MECHANISM": share.cores_mechanism,
    }
    return [f"GPUSLICE_{key}_{field}={value}" for field, value in fields.items()]


class EnforcerClient:
    """``gpuslice.v1.Enforcer`` over its unix socket, for the shares of the MPS replicas."""

    def __init__(self, socket: Path, *, timeout: float = 30.0) -> None:
        self.socket = socket
        self.timeout = timeout
        self._client = UnixClient(
            socket, "enforcer", pb_grpc.EnforcerStub, timeout=timeout, wait_for_ready=True
        )

    def _call(self, what: str, method: str, request: object) -> object:
        return self._client.call(method, request, what=what)

    def ours(self) -> dict[str, tuple[int, int]]:
        """The enforcer's shares of device-plugin replicas: claim UID → (cores, memory)."""
        reply = self._call("all shares", "GetUsage", pb.GetUsageRequest())
        assert isinstance(reply, pb.GetUsageResponse)
        out: dict[str, tuple[int, int]] = {}
        for share in reply.shares:
            if share.claim_uid.startswith(SHARE_PREFIX) and share.devices:
                d = share.devices[0]
                out[share.claim_uid] = (d.sm_limit_percent, d.memory_limit_bytes)
        return out

    def release(self, claim_uid: str) -> None:
        self._call(claim_uid, "ReleaseShare", pb.ReleaseShareRequest(claim_uid=claim_uid))

    def create(self, device: Device, cores: int, memory: int) -> pb.CreateShareResponse:
        request = pb.CreateShareRequest(
            claim_uid=share_uid(device),
            claim_namespace=SHARE_NAMESPACE,
            claim_name=device.id,
            device_uuids=[device.uuid],
            cores_percent=cores,
            memory_bytes=memory,
            mode=pb.ENFORCEMENT_MODE_AUTO,
        )
        reply = self._call(device.id, "CreateShare", request)
        assert isinstance(reply, pb.CreateShareResponse)
        return reply


def _limit(reply: pb.CreateShareResponse, resource: int) -> pb.LimitEnforcement:
    return next((lim for lim in reply.limits if lim.resource == resource), pb.LimitEnforcement())


def setup_shares(
    client: EnforcerClient,
    resources: Sequence[Resource],
    memory_total: dict[int, int],
    cdi_root: Path,
    visibility: dict[str, dp.ContainerAllocateResponse],
) -> dict[str, ReplicaShare]:
    """Create (or find again) the share of every MPS replica and write one CDI spec per MPS
    resource; returns replica device ID → its share. ``memory_total`` is per GPU index;
    ``visibility`` holds, per replica ID, what the device list strategy would hand out."""
    mps = [r for r in resources if r.sharing == "mps"]
    wanted = {
        share_uid(d): split(r.replicas, memory_total[d.gpu_index]) for r in mps for d in r.devices
    }
    specs = cdi.ClaimSpecs(cdi_root, vendor=CDI_VENDOR, cdi_class=CDI_CLASS)
    for uid, limits in client.ours().items():
        if wanted.get(uid) != limits:
            log.info("releasing the share of an earlier MPS configuration", share=uid)
            client.release(uid)
    shares: dict[str, ReplicaShare] = {}
    for resource in mps:
        key = resource.socket_name.removeprefix("gpuslice-").removesuffix(".sock")
        devices: list[cdi.Device] = []
        for d in resource.devices:
            cores, memory = wanted[share_uid(d)]
            reply = client.create(d, cores, memory)
            mem, sm = _limit(reply, pb.RESOURCE_MEMORY), _limit(reply, pb.RESOURCE_CORES)
            name = specs.device_name(key, f"{d.gpu_index}-{d.replica}")
            share = ReplicaShare(
                device_id=d.id,
                share_id=reply.share_id,
                cores=cores,
                memory_bytes=memory,
                level=level_name(reply.level),
                memory_mechanism=mechanism_name(mem.mechanism),
                cores_mechanism=mechanism_name(sm.mechanism),
                reason="; ".join(r for r in (mem.reason, sm.reason) if r),
                cdi_id=specs.qualified_id(name),
            )
            edits = cdi.merge_edits(
                [
                    edits_from_response(visibility[d.id]),
                    cdi_edits(reply.container_edits),
                    cdi.ContainerEdits(env=limit_env(name, share, d.uuid)),
                ]
            )
            devices.append(cdi.Device(name=name, container_edits=edits))
            shares[d.id] = share
        try:
            specs.write(key, devices)
        except (GpusliceError, OSError) as exc:
            raise EnforcerError(f"cannot write the CDI spec of {resource.name}: {exc}") from exc
        first = shares[resource.devices[0].id]
        log.info(
            "MPS replicas enforced",
            resource=resource.name,
            replicas=resource.replicas,
            cores=first.cores,
            memory=first.memory_bytes,
            level=first.level,
            memory_mechanism=first.memory_mechanism,
            cores_mechanism=first.cores_mechanism,
            spec=str(specs.spec_path(key)),
        )
    current = {r.socket_name.removeprefix("gpuslice-").removesuffix(".sock") for r in mps}
    for key in specs.claim_uids():
        if key not in current:
            specs.delete(key)  # a resource that is no longer MPS-shared
    return shares
