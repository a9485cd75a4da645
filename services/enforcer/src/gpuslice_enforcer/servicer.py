"""gRPC servicers: Enforcer (kubelet plugin, controller) and EnforcerContainers (CDI hook).

RPC -> domain call -> response, nothing else: errors are domain errors that
``gpuslice_core.grpcserver.ErrorInterceptor`` turns into status codes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from gpuslice_core.cdi import ContainerEdits
from gpuslice_core.errors import NotFoundError
from gpuslice_enforcer.capabilities import Capability, GpuCapabilities
from gpuslice_enforcer.metrics import EnforcerMetrics
from gpuslice_enforcer.shares import AttachRequest, ShareManager, ShareRequest
from gpuslice_enforcer.state import Level, Mechanism, Mode, PodRef, ShareRecord
from gpuslice_enforcer.violations import Violation, ViolationBus
from gpuslice_enforcer.watchdog import DeviceUsage, Watchdog
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc

_MODES = {
    pb.ENFORCEMENT_MODE_UNSPECIFIED: Mode.AUTO,
    pb.ENFORCEMENT_MODE_AUTO: Mode.AUTO,
    pb.ENFORCEMENT_MODE_HARD: Mode.HARD,
    pb.ENFORCEMENT_MODE_SOFT: Mode.SOFT,
    pb.ENFORCEMENT_MODE_OFF: Mode.OFF,
}
_MECHANISMS = {
    Mechanism.MEMORY_PARTITION: pb.MECHANISM_MEMORY_PARTITION,
    Mechanism.MPS_PROTOCOL3: pb.MECHANISM_MPS_PROTOCOL3,
    Mechanism.MPS_LEGACY: pb.MECHANISM_MPS_LEGACY,
    Mechanism.WATCHDOG: pb.MECHANISM_WATCHDOG,
    Mechanism.NONE: pb.MECHANISM_NONE,
}
_LEVELS = {
    Level.HARD: pb.ENFORCEMENT_LEVEL_HARD,
    Level.SOFT: pb.ENFORCEMENT_LEVEL_SOFT,
    Level.NONE: pb.ENFORCEMENT_LEVEL_NONE,
}
_ACTIONS = {
    "reported": pb.ACTION_REPORTED,
    "throttled": pb.ACTION_THROTTLED,
    "killed": pb.ACTION_KILLED,
    "denied": pb.ACTION_DENIED,
}


def rpc_context(**values: str) -> contextlib.AbstractContextManager[object]:
    """Bind the call's identity (claim, container) to every log line of one RPC, and only to
    that RPC's lines (worker threads are reused)."""
    return structlog.contextvars.bound_contextvars(**values)


def mechanism_pb(mechanism: Mechanism) -> pb.Mechanism.ValueType:
    return _MECHANISMS[mechanism]


def edits_pb(edits: ContainerEdits) -> pb.ContainerEdits:
    return pb.ContainerEdits(
        env=list(edits.env),
        mounts=[
            pb.Mount(host_path=m.host_path, container_path=m.container_path, options=m.options)
            for m in edits.mounts
        ],
        device_nodes=[
            pb.DeviceNode(path=d.path, host_path=d.host_path, permissions=d.permissions)
            for d in edits.device_nodes
        ],
        hooks=[
            pb.Hook(
                hook_name=h.hook_name,
                path=h.path,
                args=h.args,
                env=h.env,
                timeout_seconds=h.timeout,
            )
            for h in edits.hooks
        ],
    )


def limits_pb(share: ShareRecord) -> list[pb.LimitEnforcement]:
    return [
        pb.LimitEnforcement(
            resource=pb.RESOURCE_MEMORY,
            mechanism=mechanism_pb(share.memory_mechanism),
            reason=share.memory_reason,
        ),
        pb.LimitEnforcement(
            resource=pb.RESOURCE_CORES,
            mechanism=mechanism_pb(share.cores_mechanism),
            reason=share.cores_reason,
        ),
    ]


def _pod_pb(pod: PodRef) -> pb.PodReference:
    return pb.PodReference(uid=pod.uid, namespace=pod.namespace, name=pod.name)


def _capability_pb(cap: Capability) -> pb.Capability:
    return pb.Capability(available=cap.available, reason=cap.reason)


def capabilities_pb(gpu: GpuCapabilities) -> pb.GpuCapabilities:
    return pb.GpuCapabilities(
        uuid=gpu.uuid,
        driver_version=gpu.driver_version,
        memory_partitioning=_capability_pb(gpu.memory_partitioning),
        mps_protocol3=_capability_pb(gpu.mps_protocol3),
        mps_legacy=_capability_pb(gpu.mps_legacy),
        mig=_capability_pb(gpu.mig),
        exclusive_compute=_capability_pb(gpu.exclusive),
        level=_LEVELS[gpu.level],
        memory_mechanism=mechanism_pb(gpu.memory_mechanism),
        cores_mechanism=mechanism_pb(gpu.cores_mechanism),
    )


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _usage_pb(usage: DeviceUsage) -> pb.DeviceUsage:
    return pb.DeviceUsage(
        device_uuid=usage.device_uuid,
        memory_used_bytes=usage.memory_used,
        memory_limit_bytes=usage.memory_limit,
        sm_percent=usage.sm_percent,
        sm_limit_percent=usage.sm_limit,
        throttled_seconds=usage.throttled_s,
        kills=usage.kills,
        violations=usage.violations,
        memory_mechanism=mechanism_pb(usage.memory_mechanism),
        cores_mechanism=mechanism_pb(usage.cores_mechanism),
    )


def violation_pb(v: Violation) -> pb.Violation:
    return pb.Violation(
        claim_uid=v.claim_uid,
        share_id=v.share_id,
        device_uuid=v.device_uuid,
        pod=_pod_pb(v.pod) if v.pod else None,
        pid=v.pid,
        resource=pb.RESOURCE_MEMORY if v.resource == "memory" else pb.RESOURCE_CORES,
        observed=v.observed,
        limit=v.limit,
        action=_ACTIONS[v.action],
        mechanism=mechanism_pb(v.mechanism),
        time=_timestamp(v.time),
        message=v.message,
    )


class EnforcerServicer(pb_grpc.EnforcerServicer):
    def __init__(
        self,
        shares: ShareManager,
        watchdog: Watchdog,
        bus: ViolationBus,
        metrics: EnforcerMetrics,
    ) -> None:
        self.shares = shares
        self.watchdog = watchdog
        self.bus = bus
        self.metrics = metrics

    def CreateShare(  # noqa: N802
        self, request: pb.CreateShareRequest, context: grpc.ServicerContext
    ) -> pb.CreateShareResponse:
        with rpc_context(claim_uid=request.claim_uid), self.metrics.create_share.time():
            result = self.shares.create(
                ShareRequest(
                    claim_uid=request.claim_uid,
                    claim_namespace=request.claim_namespace,
                    claim_name=request.claim_name,
                    device_uuids=list(request.device_uuids),
                    cores_percent=request.cores_percent,
                    memory_bytes=request.memory_bytes,
                    mode=_MODES.get(request.mode, Mode.AUTO),
                    strict=request.strict,
                    work_conserving=request.work_conserving,
                    pods=[
                        PodRef(uid=p.uid, namespace=p.namespace, name=p.name) for p in request.pods
                    ],
                )
            )
        share = result.share
        for resource, mechanism in (
            ("memory", share.memory_mechanism),
            ("cores", share.cores_mechanism),
        ):
            self.metrics.mechanism.labels(share.claim_uid, resource, mechanism.value).set(1)
        self.metrics.level.labels(share.claim_uid, share.level.value).set(1)
        return pb.CreateShareResponse(
            share_id=share.share_id,
            created=result.created,
            container_edits=edits_pb(result.edits),
            limits=limits_pb(share),
            level=_LEVELS[share.level],
        )

    def ReleaseShare(  # noqa: N802
        self, request: pb.ReleaseShareRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseShareResponse:
        with rpc_context(claim_uid=request.claim_uid), self.metrics.release_share.time():
            share = self.shares.release(request.claim_uid)
        if share is None:
            return pb.ReleaseShareResponse(released=False)
        self.metrics.forget_share(share.claim_uid)
        return pb.ReleaseShareResponse(released=True, share_id=share.share_id)

    def GetUsage(  # noqa: N802
        self, request: pb.GetUsageRequest, context: grpc.ServicerContext
    ) -> pb.GetUsageResponse:
        _, shares = self.shares.snapshot()
        if request.HasField("claim_uid"):
            shares = [s for s in shares if s.claim_uid == request.claim_uid]
            if not shares:
                raise NotFoundError(f"claim {request.claim_uid} has no share")
        return pb.GetUsageResponse(
            shares=[
                pb.ShareUsage(
                    claim_uid=s.claim_uid,
                    claim_namespace=s.claim_namespace,
                    claim_name=s.claim_name,
                    share_id=s.share_id,
                    pods=[_pod_pb(p) for p in s.pods],
                    devices=[_usage_pb(u) for u in self.watchdog.usage(s)],
                    sampled_at=_timestamp(self.watchdog.last_sample_wall),
                )
                for s in sorted(shares, key=lambda s: s.claim_uid)
            ]
        )

    def WatchViolations(  # noqa: N802
        self, request: pb.WatchViolationsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Violation]:
        claim = request.claim_uid if request.HasField("claim_uid") else None
        for violation in self.bus.stream(claim, context.is_active):
            yield violation_pb(violation)

    def GetCapabilities(  # noqa: N802
        self, request: pb.GetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.GetCapabilitiesResponse:
        return pb.GetCapabilitiesResponse(
            gpus=[capabilities_pb(g) for g in self.shares.capabilities()]
        )


class ContainersServicer(pb_grpc.EnforcerContainersServicer):
    def __init__(self, shares: ShareManager, metrics: EnforcerMetrics) -> None:
        self.shares = shares
        self.metrics = metrics

    def AttachContainer(  # noqa: N802
        self, request: pb.AttachContainerRequest, context: grpc.ServicerContext
    ) -> pb.AttachContainerResponse:
        return self.attach(request)

    def DetachContainer(  # noqa: N802
        self, request: pb.DetachContainerRequest, context: grpc.ServicerContext
    ) -> pb.DetachContainerResponse:
        return self.detach(request)

    # The same calls for the attach socket (gpuslice_enforcer.server), which has no
    # gRPC context.
    def attach(self, request: pb.AttachContainerRequest) -> pb.AttachContainerResponse:
        with (
            rpc_context(claim_uid=request.claim_uid, container=request.container_id),
            self.metrics.attach.time(),
        ):
            result = self.shares.attach(
                AttachRequest(
                    claim_uid=request.claim_uid,
                    share_id=request.share_id,
                    container_id=request.container_id,
                    pid=request.pid,
                    cgroup_lines=list(request.cgroup_lines),
                )
            )
        return pb.AttachContainerResponse(
            attached=result.attached,
            cgroup_paths=result.cgroup_paths,
            limits=limits_pb(result.share),
        )

    def detach(self, request: pb.DetachContainerRequest) -> pb.DetachContainerResponse:
        return pb.DetachContainerResponse(
            detached=self.shares.detach(request.claim_uid, request.container_id)
        )
