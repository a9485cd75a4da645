"""Prometheus metrics of the MIG manager.

- ``gpuslice_mig_manager_instances{gpu,UUID,GPU_I_PROFILE}``: live GPU instances per GPU (its
  index and UUID, as dcgm-exporter labels a GPU) and profile (dcgm-exporter's
  ``GPU_I_PROFILE``, e.g. ``1g.10gb``); the node comes from the monitor (``Hostname``);
- ``gpuslice_mig_manager_create_instance_total{result}`` and ``..._duration_seconds``;
- ``gpuslice_mig_manager_destroy_instance_total{result}`` and ``..._duration_seconds``;
- ``gpuslice_mig_manager_apply_layout_total{result}`` and ``..._duration_seconds`` (result:
  success, pending, rebooting, failed);
- ``gpuslice_mig_manager_drift_total{kind}``: differences between records and GPUs.

``result`` is ``success`` or the error type for creates and destroys, so failures are the
series whose result is not ``success``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from gpuslice_core.metrics import (
    DURATION_BUCKETS,
    OperationMetrics,
    Subsystem,
    metric_name,
    standard_series,
)
from gpuslice_mig_manager import __version__

if TYPE_CHECKING:
    from gpuslice_mig_manager.snapshot import InstanceView

COMPONENT = Subsystem.MIG_MANAGER


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        standard_series(self.registry, component=COMPONENT, version=__version__)
        self.create = OperationMetrics(
            COMPONENT, "create_instance", "MIG instance creations", self.registry
        )
        self.destroy = OperationMetrics(
            COMPONENT, "destroy_instance", "MIG instance destructions", self.registry
        )
        self.apply_total = PromCounter(
            metric_name(COMPONENT, "apply_layout_total"),
            "MIG layout applications, by result (success, pending, rebooting, failed).",
            ["result"],
            registry=self.registry,
        )
        self.apply_duration = Histogram(
            metric_name(COMPONENT, "apply_layout_duration_seconds"),
            "Time spent applying a MIG layout, by result.",
            ["result"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.drift = PromCounter(
            metric_name(COMPONENT, "drift_total"),
            "Differences between the MIG manager's records and the GPUs, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.instances = Gauge(
            metric_name(COMPONENT, "instances"),
            "Live MIG GPU instances, by GPU (index and UUID) and GPU instance profile.",
            ["gpu", "UUID", "GPU_I_PROFILE"],
            registry=self.registry,
        )
        self._instance_series: set[tuple[str, str, str]] = set()
        self.instance_info = Gauge(
            metric_name(COMPONENT, "instance_info"),
            "Each live MIG GPU instance (value 1): its GPU, profile and GPU instance id as "
            "dcgm-exporter labels them, and the layout that made or kept it (empty: on demand).",
            ["gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID", "layout"],
            registry=self.registry,
        )
        self._info_series: dict[tuple[str, str], set[tuple[str, str, str, str, str]]] = {}

    def observe_apply(self, result: str, seconds: float) -> None:
        self.apply_total.labels(result=result).inc()
        self.apply_duration.labels(result=result).observe(seconds)

    def set_instances(self, gpu: int, uuid: str, instances: Sequence[InstanceView]) -> None:
        """Replace GPU ``gpu``'s series with its live ``instances``: per-profile counts
        (profiles gone drop to 0) and one ``instance_info`` each (instances gone are removed,
        so a destroyed instance leaves no series behind)."""
        label = str(gpu)
        counts = Counter(i.profile_name for i in instances)
        for series in [s for s in self._instance_series if s[:2] == (label, uuid)]:
            if series[2] not in counts:
                self.instances.labels(*series).set(0)
        for profile, count in counts.items():
            self.instances.labels(label, uuid, profile).set(count)
            self._instance_series.add((label, uuid, profile))
        live = {(label, uuid, i.profile_name, str(i.gpu_instance_id), i.layout) for i in instances}
        for gone in self._info_series.get((label, uuid), set()) - live:
            self.instance_info.remove(*gone)
        for instance in live:
            self.instance_info.labels(*instance).set(1)
        self._info_series[(label, uuid)] = live
