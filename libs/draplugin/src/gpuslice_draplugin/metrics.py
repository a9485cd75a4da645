"""The helper's Prometheus metrics, named after the driver's component
(``gpuslice_<component>_…``, ``kubelet_plugin`` for gpuslice's kubelet plugin) and registered in
the driver's registry, so they are served with the driver's own:

- ``rpc_total`` / ``rpc_duration_seconds`` {result}: DRA calls as a whole;
- ``publish_total`` / ``publish_duration_seconds`` {result}: pool publications that wrote;
- ``published_devices``, ``published_slices``: what this node's pools hold.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from gpuslice_core.metrics import OperationMetrics, metric_name


class HelperMetrics:
    def __init__(self, component: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rpc = OperationMetrics(component, "rpc", "DRA calls served", r)
        self.publish = OperationMetrics(component, "publish", "ResourceSlice publications", r)
        self.published_devices = Gauge(
            metric_name(component, "published_devices"), "Devices in the node's pool.", registry=r
        )
        self.published_slices = Gauge(
            metric_name(component, "published_slices"),
            "ResourceSlices of the node's pool.",
            registry=r,
        )
