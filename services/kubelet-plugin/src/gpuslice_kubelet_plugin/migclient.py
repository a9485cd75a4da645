"""Client of the MIG manager (``gpuslice.v1.MigManager``) for dynamic MIG, behind an interface.

With dynamic MIG every placement is published; the instance is created at prepare
(``CreateInstance`` with ``owner`` = ``gpuslice-kubelet-plugin/<claim UID>``) and destroyed at
unprepare. The owner is recorded by the MIG manager, so a plugin killed between creating an
instance and writing its checkpoint still finds (and destroys) the instance afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_core.grpcclient import UnixClient
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as pb
from gpuslice_protos.gpuslice.v1 import migmanager_pb2_grpc as pb_grpc

OWNER_PREFIX = "gpuslice-kubelet-plugin/"


def owner_for(claim_uid: str) -> str:
    return OWNER_PREFIX + claim_uid


@dataclass(frozen=True)
class MigInstance:
    gpu_uuid: str
    gpu_instance_id: int
    mig_uuid: str
    profile: str
    placement_start: int
    owner: str


class MigManager(Protocol):
    def create(
        self, gpu_uuid: str, profile: str, placement_start: int, claim_uid: str
    ) -> MigInstance: ...

    def destroy(self, gpu_uuid: str, gpu_instance_id: int, owner: str) -> bool:
        """Destroy the instance if ``owner`` still holds it (a reused id is never destroyed)."""
        ...

    def owned(self) -> list[MigInstance]:
        """Every instance this plugin created (owner with our prefix)."""
        ...

    def close(self) -> None: ...


class NoMigManager:
    def create(
        self, gpu_uuid: str, profile: str, placement_start: int, claim_uid: str
    ) -> MigInstance:
        raise FailedPreconditionError(
            "dynamic MIG devices need the MIG manager (--mig-manager-socket is not set)"
        )

    def destroy(self, gpu_uuid: str, gpu_instance_id: int, owner: str) -> bool:
        return False

    def owned(self) -> list[MigInstance]:
        return []

    def close(self) -> None:
        pass


def _instance(message: pb.MigInstance) -> MigInstance:
    return MigInstance(
        gpu_uuid=message.gpu_uuid,
        gpu_instance_id=message.gpu_instance_id,
        mig_uuid=message.mig_uuid,
        profile=message.profile_name,
        placement_start=message.placement.start,
        owner=message.owner,
    )


class GrpcMigManager:
    def __init__(self, socket: Path, *, timeout: float = 30.0) -> None:
        self.socket = socket
        self.timeout = timeout
        self._client = UnixClient(socket, "mig-manager", pb_grpc.MigManagerStub, timeout=timeout)

    def create(
        self, gpu_uuid: str, profile: str, placement_start: int, claim_uid: str
    ) -> MigInstance:
        reply = self._client.call(
            "CreateInstance",
            pb.CreateInstanceRequest(
                gpu_uuid=gpu_uuid,
                profile_name=profile,
                placement_start=placement_start,
                owner=owner_for(claim_uid),
            ),
        )
        return _instance(reply.instance)

    def destroy(self, gpu_uuid: str, gpu_instance_id: int, owner: str) -> bool:
        reply = self._client.call(
            "DestroyInstance",
            pb.DestroyInstanceRequest(
                gpu_uuid=gpu_uuid, gpu_instance_id=gpu_instance_id, owner=owner
            ),
        )
        return bool(reply.changed)

    def owned(self) -> list[MigInstance]:
        reply = self._client.call("ListGpus", pb.ListGpusRequest())
        return [
            _instance(i)
            for gpu in reply.gpus
            for i in gpu.instances
            if i.owner.startswith(OWNER_PREFIX)
        ]

    def close(self) -> None:
        self._client.close()
