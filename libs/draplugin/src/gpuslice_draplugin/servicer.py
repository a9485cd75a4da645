"""The kubelet-facing gRPC servicers: RPC in, domain call, RPC out — nothing else.

- ``RegistrationServicer`` (``pluginregistration.Registration``) on the registration socket;
- ``DraV1Servicer`` and ``DraV1beta1Servicer`` (``v1.DRAPlugin`` / ``v1beta1.DRAPlugin``) on the
  DRA socket: every claim of a call gets its own entry in the answer, with an error string when
  it failed, so one bad claim never fails the call (a gRPC error would discard every claim) —
  not even a plugin that raises or leaves a claim out of its answer;
- ``HealthStreamServicer`` (``v1alpha1.DRAResourceHealth``): the health of every device at once,
  then again after every change (and every 10 s without one, so the kubelet's 30 s health
  timeout never reads a quiet device as Unknown), until the kubelet goes away.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from gpuslice_core.logging import get_logger
from gpuslice_draplugin.metrics import HelperMetrics
from gpuslice_draplugin.plugin import ClaimRef, DeviceHealth, HealthSource, Plugin
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as v1
from gpuslice_protos.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2 as hpb
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2_grpc as hpb_grpc
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2 as reg
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = get_logger(__name__)

V1 = "v1.DRAPlugin"
V1BETA1 = "v1beta1.DRAPlugin"
HEALTH = "v1alpha1.DRAResourceHealth"


class RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(
        self,
        *,
        driver: str,
        endpoint: str,
        versions: list[str],
        on_status: Callable[[bool, str], None],
        plugin_type: str = "DRAPlugin",
    ) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.versions = versions
        self.on_status = on_status
        self.plugin_type = plugin_type

    def GetInfo(  # noqa: N802
        self, request: reg.InfoRequest, context: grpc.ServicerContext
    ) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=self.plugin_type,
            name=self.driver,
            endpoint=self.endpoint,
            supported_versions=self.versions,
        )

    def NotifyRegistrationStatus(  # noqa: N802
        self, request: reg.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        self.on_status(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


def _refs(claims: Any) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


def _answers(
    call: Callable[[list[ClaimRef]], Mapping[str, Any]], op: str, refs: list[ClaimRef]
) -> Mapping[str, Any]:
    """The plugin's answers, or its failure as every claim's answer: the call never fails."""
    if not refs:
        return {}
    try:
        return call(refs)
    except Exception as exc:
        log.exception("the driver raised; every claim of the call gets its error", op=op)
        return dict.fromkeys((r.uid for r in refs), exc)


def _missing(op: str, ref: ClaimRef) -> Exception:
    return RuntimeError(f"the driver's {op} gave no answer for ResourceClaim {ref}")


class _Dra:
    """Both API versions have the same messages; ``pb`` is the version's module."""

    def __init__(self, plugin: Plugin, metrics: HelperMetrics, pb: Any, share_ids: bool) -> None:
        self.plugin = plugin
        self.metrics = metrics
        self.pb = pb
        self.share_ids = share_ids

    def prepare(self, request: Any) -> Any:
        with self.metrics.rpc.time():
            refs = _refs(request.claims)
            outcomes = _answers(self.plugin.prepare, "prepare", refs)
            response = self.pb.NodePrepareResourcesResponse()
            for ref in refs:
                entry = response.claims[ref.uid]
                outcome = outcomes[ref.uid] if ref.uid in outcomes else _missing("prepare", ref)
                if isinstance(outcome, Exception):
                    entry.error = str(outcome) or type(outcome).__name__
                    continue
                for d in outcome:
                    device = self.pb.Device(
                        request_names=list(d.request_names),
                        pool_name=d.pool,
                        device_name=d.device,
                        cdi_device_ids=list(d.cdi_device_ids),
                    )
                    if self.share_ids and d.share_id:
                        device.share_id = d.share_id
                    entry.devices.append(device)
            return response

    def unprepare(self, request: Any) -> Any:
        with self.metrics.rpc.time():
            refs = _refs(request.claims)
            outcomes = _answers(self.plugin.unprepare, "unprepare", refs)
            response = self.pb.NodeUnprepareResourcesResponse()
            for ref in refs:
                error = outcomes[ref.uid] if ref.uid in outcomes else _missing("unprepare", ref)
                response.claims[ref.uid].error = (
                    (str(error) or type(error).__name__) if error else ""
                )
            return response


class DraV1Servicer(v1_grpc.DRAPluginServicer):
    def __init__(self, plugin: Plugin, metrics: HelperMetrics) -> None:
        self._dra = _Dra(plugin, metrics, v1, share_ids=True)

    def NodePrepareResources(  # noqa: N802
        self, request: v1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodePrepareResourcesResponse:
        response: v1.NodePrepareResourcesResponse = self._dra.prepare(request)
        return response

    def NodeUnprepareResources(  # noqa: N802
        self, request: v1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodeUnprepareResourcesResponse:
        response: v1.NodeUnprepareResourcesResponse = self._dra.unprepare(request)
        return response


class DraV1beta1Servicer(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, plugin: Plugin, metrics: HelperMetrics) -> None:
        self._dra = _Dra(plugin, metrics, v1beta1, share_ids=False)

    def NodePrepareResources(  # noqa: N802
        self, request: v1beta1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodePrepareResourcesResponse:
        response: v1beta1.NodePrepareResourcesResponse = self._dra.prepare(request)
        return response

    def NodeUnprepareResources(  # noqa: N802
        self, request: v1beta1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        response: v1beta1.NodeUnprepareResourcesResponse = self._dra.unprepare(request)
        return response


class HealthStreamServicer(hpb_grpc.DRAResourceHealthServicer):
    def __init__(
        self, source: HealthSource, pool: str, *, poll: float = 0.5, resend: float = 10.0
    ) -> None:
        self.source = source
        self.pool = pool
        self.poll = poll
        # The kubelet stamps each device with its own receive time and reads a device not
        # refreshed within its timeout (default 30 s) as Unknown: the last snapshot is sent
        # again every ``resend`` seconds even without a change.
        self.resend = resend

    def _message(self, snapshot: list[DeviceHealth]) -> hpb.NodeWatchResourcesResponse:
        return hpb.NodeWatchResourcesResponse(
            devices=[
                hpb.DeviceHealth(
                    device=hpb.DeviceIdentifier(
                        pool_name=h.pool or self.pool, device_name=h.device
                    ),
                    health=hpb.HEALTHY if h.healthy else hpb.UNHEALTHY,
                    last_updated_time=int(h.updated),
                    message=h.message,
                )
                for h in snapshot
            ]
        )

    def NodeWatchResources(  # noqa: N802
        self, request: hpb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[hpb.NodeWatchResourcesResponse]:
        q = self.source.subscribe()
        log.info("health stream opened")
        last: list[DeviceHealth] | None = None
        sent = time.monotonic()
        try:
            while context.is_active():
                try:
                    snapshot = q.get(timeout=self.poll)
                except queue.Empty:
                    if last is None or time.monotonic() - sent < self.resend:
                        continue
                    snapshot = last
                last, sent = snapshot, time.monotonic()
                yield self._message(snapshot)
        finally:
            self.source.unsubscribe(q)
            log.info("health stream closed")
