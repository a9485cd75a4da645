"""Prometheus metrics of the device plugin.

- ``gpuslice_device_plugin_allocate_total{result}`` and ``..._duration_seconds``;
- ``gpuslice_device_plugin_preferred_allocation_total{result}`` and ``..._duration_seconds``;
- ``gpuslice_device_plugin_register_total{result}``: Register calls to the kubelet;
- ``gpuslice_device_plugin_devices{resource,health}``: devices advertised, by health;
- ``gpuslice_device_plugin_health_events_total{kind}``: NVML health events seen;
- ``gpuslice_device_plugin_container_metrics_errors_total{source}``: scrapes of the
  per-container metrics (:mod:`gpuslice_device_plugin.usage`) in which a source failed
  (``podresources``, ``nvml``, ``apiserver``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuslice_core.metrics import OperationMetrics, Subsystem, metric_name, standard_series
from gpuslice_device_plugin import __version__

COMPONENT = Subsystem.DEVICE_PLUGIN


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        standard_series(self.registry, component=COMPONENT, version=__version__)
        self.allocate = OperationMetrics(COMPONENT, "allocate", "Allocate calls", self.registry)
        self.preferred = OperationMetrics(
            COMPONENT, "preferred_allocation", "GetPreferredAllocation calls", self.registry
        )
        self.register = Counter(
            metric_name(COMPONENT, "register_total"),
            "Register calls to the kubelet, by result.",
            ["result"],
            registry=self.registry,
        )
        self.devices = Gauge(
            metric_name(COMPONENT, "devices"),
            "Devices advertised to the kubelet, by resource and health.",
            ["resource", "health"],
            registry=self.registry,
        )
        self.health_events = Counter(
            metric_name(COMPONENT, "health_events_total"),
            "NVML health events seen, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.container_errors = Counter(
            metric_name(COMPONENT, "container_metrics_errors_total"),
            "Scrapes of the per-container metrics in which a source failed, by source.",
            ["source"],
            registry=self.registry,
        )
