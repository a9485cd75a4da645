"""Stand-in servers for the enforcer and the MIG manager, real gRPC on unix sockets.

They implement the ``gpuslice.v1`` contracts the plugin relies on (idempotent CreateShare per
claim, ReleaseShare of an unknown claim succeeds, instances owned by a claim), record every call
and can be slowed down or made to fail, so tests can put a crash between two steps. Failures are
raised as gpuslice errors, which the server's interceptor maps to status codes
(``context.abort`` inside a ``UnixGrpcServer`` would be rewritten to INTERNAL by it).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from gpuslice_core.errors import FailedPreconditionError, NotFoundError, UnsupportedError
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_nvml import Nvml, Placement
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as epb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as epb_grpc
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as mpb
from gpuslice_protos.gpuslice.v1 import migmanager_pb2_grpc as mpb_grpc


class StandinEnforcer(epb_grpc.EnforcerServicer):
    def __init__(
        self,
        *,
        gpus: tuple[str, ...] = (),
        level: epb.EnforcementLevel.ValueType = epb.ENFORCEMENT_LEVEL_HARD,
        delay: float = 0.0,
    ) -> None:
        self.gpus = gpus
        self.level = level
        self.delay = delay
        self.fail: Callable[[epb.CreateShareRequest], str] | None = None
        self.shares: dict[str, tuple[str, epb.CreateShareRequest]] = {}
        self.created: Counter[str] = Counter()
        self.released: Counter[str] = Counter()
        self.entered = threading.Event()  # set when a CreateShare call arrives
        self.arrivals = 0  # CreateShare calls that arrived (before the delay)
        self.watchers = 0  # WatchViolations streams open now
        self._violations: list[queue.Queue[epb.Violation]] = []
        self._lock = threading.Lock()
        self.server: UnixGrpcServer | None = None

    def violate(self, violation: epb.Violation) -> None:
        """Send ``violation`` on every open WatchViolations stream (as the enforcer's bus)."""
        with self._lock:
            streams = list(self._violations)
        for stream in streams:
            stream.put(violation)

    def serve(self, socket: Path) -> StandinEnforcer:
        self.server = UnixGrpcServer([socket], name="standin-enforcer")
        self.server.add(epb_grpc.add_EnforcerServicer_to_server, self, "gpuslice.v1.Enforcer")
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0.5)

    def CreateShare(  # noqa: N802
        self, request: epb.CreateShareRequest, context: grpc.ServicerContext
    ) -> epb.CreateShareResponse:
        with self._lock:
            self.arrivals += 1
        self.entered.set()
        if self.delay:
            time.sleep(self.delay)
        if self.fail is not None and (error := self.fail(request)):
            raise FailedPreconditionError(error)
        with self._lock:
            existing = self.shares.get(request.claim_uid)
            if existing is not None and existing[1] != request:
                raise FailedPreconditionError(
                    f"claim {request.claim_uid} has a share with other parameters"
                )
            created = existing is None
            share_id = existing[0] if existing else uuid.uuid4().hex[:12]
            if created:
                self.shares[request.claim_uid] = (share_id, request)
                self.created[request.claim_uid] += 1
        level = (
            epb.ENFORCEMENT_LEVEL_NONE if request.mode == epb.ENFORCEMENT_MODE_OFF else self.level
        )
        mechanism = (
            epb.MECHANISM_MPS_PROTOCOL3
            if level == epb.ENFORCEMENT_LEVEL_HARD
            else (
                epb.MECHANISM_WATCHDOG
                if level == epb.ENFORCEMENT_LEVEL_SOFT
                else epb.MECHANISM_NONE
            )
        )
        return epb.CreateShareResponse(
            share_id=share_id,
            created=created,
            container_edits=epb.ContainerEdits(
                env=[f"CUDA_MPS_PIPE_DIRECTORY=/run/gpuslice/mps/{share_id}"],
                mounts=[
                    epb.Mount(
                        host_path=f"/run/gpuslice/mps/{share_id}",
                        container_path=f"/run/gpuslice/mps/{share_id}",
                        options=["bind"],
                    )
                ],
            ),
            limits=[
                epb.LimitEnforcement(resource=epb.RESOURCE_MEMORY, mechanism=mechanism),
                epb.LimitEnforcement(resource=epb.RESOURCE_CORES, mechanism=mechanism),
            ],
            level=level,
        )

    def ReleaseShare(  # noqa: N802
        self, request: epb.ReleaseShareRequest, context: grpc.ServicerContext
    ) -> epb.ReleaseShareResponse:
        with self._lock:
            share = self.shares.pop(request.claim_uid, None)
            if share is not None:
                self.released[request.claim_uid] += 1
        if share is None:
            return epb.ReleaseShareResponse(released=False)
        return epb.ReleaseShareResponse(released=True, share_id=share[0])

    def GetUsage(  # noqa: N802
        self, request: epb.GetUsageRequest, context: grpc.ServicerContext
    ) -> epb.GetUsageResponse:
        with self._lock:
            shares = sorted(self.shares.items())
        return epb.GetUsageResponse(
            shares=[
                epb.ShareUsage(
                    claim_uid=uid,
                    claim_namespace=r.claim_namespace,
                    claim_name=r.claim_name,
                    share_id=sid,
                )
                for uid, (sid, r) in shares
            ]
        )

    def WatchViolations(  # noqa: N802
        self, request: epb.WatchViolationsRequest, context: grpc.ServicerContext
    ) -> Iterator[epb.Violation]:
        stream: queue.Queue[epb.Violation] = queue.Queue()
        with self._lock:
            self._violations.append(stream)
            self.watchers += 1
        try:
            while context.is_active():
                try:
                    yield stream.get(timeout=0.1)
                except queue.Empty:
                    continue
        finally:
            with self._lock:
                self._violations.remove(stream)
                self.watchers -= 1

    def GetCapabilities(  # noqa: N802
        self, request: epb.GetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> epb.GetCapabilitiesResponse:
        return epb.GetCapabilitiesResponse(
            gpus=[epb.GpuCapabilities(uuid=u, level=self.level) for u in self.gpus]
        )


class StandinMigManager(mpb_grpc.MigManagerServicer):
    """On-demand MIG instances on a (fake) NVML, with owners kept in memory."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self.owners: dict[tuple[str, int], str] = {}
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self.server: UnixGrpcServer | None = None

    def serve(self, socket: Path) -> StandinMigManager:
        self.server = UnixGrpcServer([socket], name="standin-mig-manager")
        self.server.add(mpb_grpc.add_MigManagerServicer_to_server, self, "gpuslice.v1.MigManager")
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0.5)

    def _index(self, gpu_uuid: str) -> int:
        for i in range(self.nvml.device_count()):
            if self.nvml.gpu(i).uuid == gpu_uuid:
                return i
        raise NotFoundError(f"no GPU {gpu_uuid}")

    def _instances(self, index: int) -> list[mpb.MigInstance]:
        gpu = self.nvml.gpu(index)
        out = []
        for m in self.nvml.mig_devices(index):
            out.append(
                mpb.MigInstance(
                    gpu_instance_id=m.gpu_instance_id,
                    compute_instance_id=m.compute_instance_id,
                    profile_name=m.profile,
                    placement=mpb.MigPlacement(start=m.placement.start, size=m.placement.size),
                    mig_uuid=m.uuid,
                    owner=self.owners.get((gpu.uuid, m.gpu_instance_id), ""),
                    gpu_uuid=gpu.uuid,
                )
            )
        return out

    def ListGpus(  # noqa: N802
        self, request: mpb.ListGpusRequest, context: grpc.ServicerContext
    ) -> mpb.ListGpusResponse:
        gpus = []
        for i in range(self.nvml.device_count()):
            gpu = self.nvml.gpu(i)
            gpus.append(mpb.MigGpu(uuid=gpu.uuid, index=i, instances=self._instances(i)))
        return mpb.ListGpusResponse(gpus=gpus)

    def CreateInstance(  # noqa: N802
        self, request: mpb.CreateInstanceRequest, context: grpc.ServicerContext
    ) -> mpb.CreateInstanceResponse:
        self.calls.append(("create", request))
        with self._lock:
            index = self._index(request.gpu_uuid)
            for inst in self._instances(index):
                if (
                    inst.profile_name == request.profile_name
                    and inst.placement.start == request.placement_start
                    and inst.owner in ("", request.owner)
                ):
                    return mpb.CreateInstanceResponse(instance=inst, changed=False)
            profiles = {p.name: p for p in self.nvml.gpu_instance_profiles(index)}
            profile = profiles.get(request.profile_name)
            if profile is None:
                raise NotFoundError(f"no profile {request.profile_name}")
            # NVML errors carry their gRPC code; the server's interceptor maps them
            gi = self.nvml.create_gpu_instance(
                index, profile.id, Placement(request.placement_start, profile.memory_slices)
            )
            cis = self.nvml.compute_instance_profiles(index, gi.id)
            full = max(cis, key=lambda c: c.slice_count)
            self.nvml.create_compute_instance(index, gi.id, full.id)
            self.owners[(request.gpu_uuid, gi.id)] = request.owner
            created = [i for i in self._instances(index) if i.gpu_instance_id == gi.id]
            return mpb.CreateInstanceResponse(instance=created[0], changed=True)

    def DestroyInstance(  # noqa: N802
        self, request: mpb.DestroyInstanceRequest, context: grpc.ServicerContext
    ) -> mpb.DestroyInstanceResponse:
        self.calls.append(("destroy", request))
        with self._lock:
            index = self._index(request.gpu_uuid)
            found = [
                i for i in self._instances(index) if i.gpu_instance_id == request.gpu_instance_id
            ]
            if not found:
                return mpb.DestroyInstanceResponse(changed=False)
            if request.owner and found[0].owner != request.owner:
                raise FailedPreconditionError(
                    f"instance {request.gpu_instance_id} is held by {found[0].owner!r}, "
                    f"not {request.owner!r}"
                )
            for ci in self.nvml.compute_instances(index, request.gpu_instance_id):
                self.nvml.destroy_compute_instance(index, request.gpu_instance_id, ci.id)
            self.nvml.destroy_gpu_instance(index, request.gpu_instance_id)
            self.owners.pop((request.gpu_uuid, request.gpu_instance_id), None)
            return mpb.DestroyInstanceResponse(changed=True, destroyed=found[0])

    def ReleaseInstance(  # noqa: N802
        self, request: mpb.ReleaseInstanceRequest, context: grpc.ServicerContext
    ) -> mpb.ReleaseInstanceResponse:
        with self._lock:
            key = (request.gpu_uuid, request.gpu_instance_id)
            changed = self.owners.pop(key, None) is not None
            return mpb.ReleaseInstanceResponse(changed=changed)

    def ApplyLayout(  # noqa: N802
        self, request: mpb.ApplyLayoutRequest, context: grpc.ServicerContext
    ) -> mpb.ApplyLayoutResponse:
        raise UnsupportedError("the stand-in applies no layouts")
