"""The plugin's sockets: the kubelet's registration, DRA v1 and v1beta1 and health services,
all served by the DRA helper (``gpuslice_draplugin``, the counterpart of upstream's
``kubeletplugin``), which also publishes the ResourceSlices."""

from __future__ import annotations

from gpuslice_api.names import DRIVER
from gpuslice_draplugin import (
    ClaimCache,
    HealthSource,
    Helper,
    HelperMetrics,
    ResourceApi,
    Sockets,
)
from gpuslice_kubelet_plugin.servicer import DraServicer


def kubelet_server(
    servicer: DraServicer,
    *,
    node: str,
    sockets: Sockets,
    api: ResourceApi,
    claims: ClaimCache,
    claim_cache: bool,
    health: HealthSource | None,
    metrics: HelperMetrics,
    workers: int,
) -> Helper:
    """The helper serving ``servicer`` on ``sockets``, not started; it watches ``claims`` when
    ``claim_cache`` is on and serves the health stream from ``health`` when there is one."""
    return Helper(
        servicer,
        driver=DRIVER,
        node=node,
        api=api,
        claims=claims,
        sockets=sockets,
        health=health,
        claim_cache=claim_cache,
        metrics=metrics,
        workers=workers,
    )
