"""Client of the enforcer sidecar (``gpuslice.v1.Enforcer``), behind a small interface.

With ``--enforcer-socket`` the plugin asks the enforcer for a share per claim whose GPUs are
shared; without it (``NoEnforcer``) shares are accounting only: the scheduler keeps the cores
and memory apart, nothing on the node holds a process to them, and a claim that insists on
enforcement (``enforcement.strict: true`` with mode Hard or Soft) is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gpuslice_api.enforcer import cdi_edits, level_name, mechanism_name
from gpuslice_core import cdi
from gpuslice_core.errors import (
    FailedPreconditionError,
)
from gpuslice_core.grpcclient import UnixClient
from gpuslice_kubelet_plugin.claims import PodRef
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc

MODES = {
    "Auto": pb.ENFORCEMENT_MODE_AUTO,
    "Hard": pb.ENFORCEMENT_MODE_HARD,
    "Soft": pb.ENFORCEMENT_MODE_SOFT,
    "Off": pb.ENFORCEMENT_MODE_OFF,
}
NO_ENFORCER = "no enforcer on this node (--enforcer-socket is not set)"


@dataclass(frozen=True)
class ShareRequest:
    claim_uid: str
    namespace: str
    name: str
    pods: tuple[PodRef, ...]
    device_uuids: tuple[str, ...]
    cores: int
    memory_bytes: int
    mode: str  # Auto | Hard | Soft | Off
    strict: bool
    work_conserving: bool


@dataclass(frozen=True)
class ShareGrant:
    share_id: str
    level: str  # hard | soft | none
    edits: cdi.ContainerEdits = field(default_factory=cdi.ContainerEdits)
    reason: str = ""
    memory_mechanism: str = ""  # gpuslice_api.enforcer.MECHANISMS' words; "" without an enforcer
    cores_mechanism: str = ""


@dataclass(frozen=True)
class GpuEnforcement:
    """What a share in mode Auto gets on one GPU: published as device attributes, so a claim
    can demand hard limits (or a mechanism) with a CEL selector."""

    level: str  # hard | soft | none
    memory: str  # the memory limit's mechanism, e.g. memory-partition or watchdog
    cores: str  # the SM limit's mechanism, e.g. mps-protocol3 or watchdog


class Enforcer(Protocol):
    @property
    def present(self) -> bool: ...

    def create_share(self, request: ShareRequest) -> ShareGrant: ...

    def release_share(self, claim_uid: str) -> bool: ...

    def share_claims(self) -> list[str]:
        """Claim UIDs that have a share (for recovery after a crash)."""
        ...

    def capabilities(self) -> dict[str, GpuEnforcement]:
        """GPU UUID → what a share gets there in mode Auto (the ``enforcement`` attributes)."""
        ...

    def close(self) -> None: ...


class NoEnforcer:
    """Accounting only."""

    present = False

    def create_share(self, request: ShareRequest) -> ShareGrant:
        if request.strict and request.mode in ("Hard", "Soft"):
            raise FailedPreconditionError(
                f"enforcement mode {request.mode} with strict: true needs the gpuslice enforcer, "
                f"and there is {NO_ENFORCER}; use strict: false to accept accounting only"
            )
        reason = "enforcement mode Off" if request.mode == "Off" else NO_ENFORCER
        return ShareGrant(share_id="", level="none", reason=f"{reason}: accounting only")

    def release_share(self, claim_uid: str) -> bool:
        return False

    def share_claims(self) -> list[str]:
        return []

    def capabilities(self) -> dict[str, GpuEnforcement]:
        return {}

    def close(self) -> None:
        pass


class GrpcEnforcer:
    """The enforcer sidecar over its unix socket."""

    present = True

    def __init__(self, socket: Path, *, timeout: float = 10.0) -> None:
        self.socket = socket
        self.timeout = timeout
        self._client = UnixClient(socket, "enforcer", pb_grpc.EnforcerStub, timeout=timeout)

    def create_share(self, request: ShareRequest) -> ShareGrant:
        reply = self._client.call(
            "CreateShare",
            pb.CreateShareRequest(
                claim_uid=request.claim_uid,
                claim_namespace=request.namespace,
                claim_name=request.name,
                pods=[
                    pb.PodReference(uid=p.uid, namespace=p.namespace, name=p.name)
                    for p in request.pods
                ],
                device_uuids=list(request.device_uuids),
                cores_percent=request.cores,
                memory_bytes=request.memory_bytes,
                mode=MODES[request.mode],
                strict=request.strict,
                work_conserving=request.work_conserving,
            ),
        )
        reasons = "; ".join(limit.reason for limit in reply.limits if limit.reason)
        mechanisms = {limit.resource: mechanism_name(limit.mechanism) for limit in reply.limits}
        return ShareGrant(
            share_id=reply.share_id,
            level=level_name(reply.level),
            edits=cdi_edits(reply.container_edits),
            reason=reasons,
            memory_mechanism=mechanisms.get(pb.RESOURCE_MEMORY, ""),
            cores_mechanism=mechanisms.get(pb.RESOURCE_CORES, ""),
        )

    def release_share(self, claim_uid: str) -> bool:
        reply = self._client.call("ReleaseShare", pb.ReleaseShareRequest(claim_uid=claim_uid))
        return bool(reply.released)

    def share_claims(self) -> list[str]:
        reply = self._client.call("GetUsage", pb.GetUsageRequest())
        return [share.claim_uid for share in reply.shares]

    def capabilities(self) -> dict[str, GpuEnforcement]:
        reply = self._client.call("GetCapabilities", pb.GetCapabilitiesRequest())
        return {
            gpu.uuid: GpuEnforcement(
                level=level_name(gpu.level),
                memory=mechanism_name(gpu.memory_mechanism),
                cores=mechanism_name(gpu.cores_mechanism),
            )
            for gpu in reply.gpus
        }

    def violations(self) -> Any:
        """The enforcer's stream of every share's violations (``violationevents``)."""
        return self._client.stream("WatchViolations", pb.WatchViolationsRequest())

    def close(self) -> None:
        self._client.close()
