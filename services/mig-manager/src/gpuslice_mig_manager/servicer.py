"""gpuslice.v1.MigManager: each RPC is one call into the domain; errors map in the interceptor.

Every call writes one canonical log line (``rpc``) with the method, the GPU, the owner (the claim),
whether it changed anything and how long it took; failures are logged the same way before the
interceptor turns them into a status.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import structlog

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_core.logging import get_logger
from gpuslice_mig_manager import convert
from gpuslice_mig_manager.apply import LayoutResult, apply_layout
from gpuslice_mig_manager.layouts import LayoutConfig, parse_layouts
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.sources import LayoutSource
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as pb
from gpuslice_protos.gpuslice.v1 import migmanager_pb2_grpc as pbgrpc

log = get_logger(__name__)

SERVICE_NAME = "gpuslice.v1.MigManager"
COMPONENT = "mig-manager"


@contextmanager
def _rpc(method: str, **fields: Any) -> Iterator[dict[str, Any]]:
    """Bind the call's fields to every line logged inside it and log the canonical line;
    the body adds outcome fields to the yielded dict."""
    outcome: dict[str, Any] = {}
    start = time.perf_counter()
    bound = {k: v for k, v in fields.items() if v not in ("", None)}
    with structlog.contextvars.bound_contextvars(component=COMPONENT, **bound):
        try:
            yield outcome
        except Exception as exc:
            ms = round((time.perf_counter() - start) * 1000, 2)
            log.info("rpc", method=method, ok=False, error=str(exc), duration_ms=ms)
            raise
        ms = round((time.perf_counter() - start) * 1000, 2)
        log.info("rpc", method=method, ok=True, duration_ms=ms, **outcome)


class MigManagerServicer(pbgrpc.MigManagerServicer):
    def __init__(self, manager: MigManager, layouts: LayoutSource | None) -> None:
        self.manager = manager
        self.layouts = layouts

    def ListGpus(  # noqa: N802 - gRPC method name
        self, request: pb.ListGpusRequest, context: grpc.ServicerContext
    ) -> pb.ListGpusResponse:
        with _rpc("ListGpus") as out:
            gpus = [convert.gpu(s) for s in self.manager.snapshots()]
            out["gpus"] = len(gpus)
        return pb.ListGpusResponse(gpus=gpus)

    def CreateInstance(  # noqa: N802 - gRPC method name
        self, request: pb.CreateInstanceRequest, context: grpc.ServicerContext
    ) -> pb.CreateInstanceResponse:
        start = request.placement_start if request.HasField("placement_start") else None
        with _rpc(
            "CreateInstance",
            gpu=request.gpu_uuid,
            owner=request.owner,
            profile=request.profile_name,
            placement_start=start,
        ) as out:
            result = self.manager.create_instance(
                request.gpu_uuid, request.profile_name, start, request.owner
            )
            out.update(
                changed=result.changed,
                gpu_instance=result.instance.gpu_instance_id,
                mig_uuid=result.instance.mig_uuid,
            )
        return pb.CreateInstanceResponse(
            instance=convert.instance(result.instance), changed=result.changed
        )

    def DestroyInstance(  # noqa: N802 - gRPC method name
        self, request: pb.DestroyInstanceRequest, context: grpc.ServicerContext
    ) -> pb.DestroyInstanceResponse:
        with _rpc(
            "DestroyInstance",
            gpu=request.gpu_uuid,
            owner=request.owner,
            gpu_instance=request.gpu_instance_id,
        ) as out:
            result = self.manager.destroy_instance(
                request.gpu_uuid, request.gpu_instance_id, request.owner
            )
            out["changed"] = result.changed
        reply = pb.DestroyInstanceResponse(changed=result.changed)
        if result.changed and result.instance is not None:
            reply.destroyed.CopyFrom(convert.instance(result.instance))
        return reply

    def ReleaseInstance(  # noqa: N802 - gRPC method name
        self, request: pb.ReleaseInstanceRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseInstanceResponse:
        with _rpc(
            "ReleaseInstance",
            gpu=request.gpu_uuid,
            owner=request.owner,
            gpu_instance=request.gpu_instance_id,
        ) as out:
            result = self.manager.release_instance(
                request.gpu_uuid, request.gpu_instance_id, request.owner
            )
            out["changed"] = result.changed
        reply = pb.ReleaseInstanceResponse(changed=result.changed)
        if result.instance is not None:
            reply.instance.CopyFrom(convert.instance(result.instance))
        return reply

    def ApplyLayout(  # noqa: N802 - gRPC method name
        self, request: pb.ApplyLayoutRequest, context: grpc.ServicerContext
    ) -> pb.ApplyLayoutResponse:
        with _rpc("ApplyLayout", layout=request.layout_name, dry_run=request.dry_run) as out:
            config = self._config(request.config_yaml)
            result: LayoutResult = apply_layout(
                self.manager, request.layout_name, config, dry_run=request.dry_run
            )
            out.update(state=result.state.value, changed=result.changed)
        return convert.layout_result(result)

    def _config(self, inline: str) -> LayoutConfig:
        if inline:
            return parse_layouts(inline, source="ApplyLayoutRequest.config_yaml")
        if self.layouts is None:
            raise FailedPreconditionError(
                "no layouts are configured (--config-file or --config-map); pass config_yaml"
            )
        return self.layouts.load()
