"""The plugin's sockets: the kubelet's registration, DRA v1 and v1beta1 and health services,
all served by the DRA helper (``gpuslice_draplugin``, the counterpart of upstream's
``kubeletplugin``), which also publishes the ResourceSlices."""

from __future__ import annotations

from gpuslice_api.names import DRIVER
from gpuslice_draplugin import ClaimCache, HealthSource, Helper, HelperMetrics, ResourceApi
from gpuslice_kubelet_plugin.cli import Settings
from gpuslice_kubelet_plugin.servicer import DraServicer


def kubelet_server(
    settings: Settings,
    servicer: DraServicer,
    *,
    api: ResourceApi,
    claims: ClaimCache,
    health: HealthSource | None,
    metrics: HelperMetrics,
) -> Helper:
    """The helper serving ``servicer`` on the settings' sockets, not started."""
    return Helper(
        servicer,
        driver=DRIVER,
        node=settings.node_name,
        api=api,
        claims=claims,
        sockets=settings.sockets,
        health=health if settings.health_streaming else None,
        claim_cache=settings.claim_cache,
        metrics=metrics,
        workers=settings.workers,
    )
