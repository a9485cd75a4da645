"""Prometheus metrics of the kubelet plugin (served on ``--metrics-addr``), all prefixed
``gpuslice_kubelet_plugin_``:

- ``prepare_total`` / ``prepare_duration_seconds`` {result}: claims prepared (per claim, not
  per call); result ``success`` or the failure reason. ``unprepare_*`` likewise.
- ``claim_errors_total`` {op, reason}: per-claim failures (NotAllocated, BadConfig, ...).
- ``prepared_claims``; ``prepared_devices`` {type: gpu, mig}; ``prepared_shares``
  {enforcement: exclusive, mig, hard, soft, none}: what is prepared now.
- ``health_events_total`` {kind}; ``tainted_devices`` {effect}.
- ``recovered_total`` {action}: recovery after a crash (rolled_back, unprepared, orphan_spec,
  orphan_share, orphan_mig, spec_rewritten); ``gc_unprepared_total``.
- ``device_info`` {gpu, UUID, GPU_I_PROFILE, GPU_I_ID, dra_device} (1): each device of the
  node that exists now, as dcgm-exporter labels it and by its ResourceSlice name: every whole
  GPU (no GPU_I_PROFILE, GPU_I_ID), every static MIG device, and every dynamic MIG device while
  a prepared claim holds its instance. Read at scrape time (``DeviceRow``), so a destroyed
  instance has no series. It is how the controller's series, which carry ``dra_device`` and no
  GPU instance id, join dcgm-exporter's per-instance ones (docs/metrics.md).

The helper's metrics go into the same registry under the same prefix (``helper``,
``gpuslice_draplugin.HelperMetrics``): ``rpc_total`` / ``rpc_duration_seconds`` {result} (DRA
calls as a whole), ``publish_total`` / ``publish_duration_seconds`` {result} (pool publications
that wrote), ``published_devices`` and ``published_slices`` (what the pool holds).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuslice_core.metrics import OperationMetrics, Subsystem, metric_name, standard_series
from gpuslice_draplugin import HelperMetrics
from gpuslice_kubelet_plugin import __version__

COMPONENT = Subsystem.KUBELET_PLUGIN
DEVICE_INFO_LABELS = ("gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID", "dra_device")


class DeviceRow(NamedTuple):
    """One ``device_info`` series: ``DEVICE_INFO_LABELS``, in order; a whole GPU's
    ``profile`` and ``gpu_instance_id`` are empty (Prometheus drops an empty label)."""

    gpu: str
    uuid: str  # the GPU's; a MIG device's parent GPU's, as dcgm-exporter's UUID
    profile: str
    gpu_instance_id: str
    dra_device: str


class DeviceInfo(Collector):
    """``device_info``, built from ``rows()`` at every scrape: nothing to keep in step."""

    def __init__(self, rows: Callable[[], Iterable[DeviceRow]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            metric_name(COMPONENT, "device_info"),
            "Each device of the node that exists now (value 1): its GPU and MIG GPU instance "
            "as dcgm-exporter labels them, and its name in the ResourceSlice.",
            labels=DEVICE_INFO_LABELS,
        )
        for row in sorted(set(self.rows())):
            family.add_metric(list(row), 1)
        yield family


class PluginMetrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        devices: Callable[[], Iterable[DeviceRow]] = lambda: (),
    ) -> None:
        """``devices`` gives the ``device_info`` rows; it is called at scrape time only."""
        self.registry = registry or CollectorRegistry()
        r = self.registry
        standard_series(r, component=COMPONENT, version=__version__)
        r.register(DeviceInfo(devices))
        self.prepare = OperationMetrics(COMPONENT, "prepare", "Claims prepared", r)
        self.unprepare = OperationMetrics(COMPONENT, "unprepare", "Claims unprepared", r)
        self.helper = HelperMetrics(COMPONENT, r)
        self.claim_errors = Counter(
            metric_name(COMPONENT, "claim_errors_total"),
            "Per-claim failures of prepare and unprepare, by reason.",
            ["op", "reason"],
            registry=r,
        )
        self.prepared_claims = Gauge(
            metric_name(COMPONENT, "prepared_claims"), "Claims prepared on this node.", registry=r
        )
        self.prepared_devices = Gauge(
            metric_name(COMPONENT, "prepared_devices"),
            "Prepared devices, by type.",
            ["type"],
            registry=r,
        )
        self.prepared_shares = Gauge(
            metric_name(COMPONENT, "prepared_shares"),
            "Prepared claims, by what their limits rest on.",
            ["enforcement"],
            registry=r,
        )
        self.health_events = Counter(
            metric_name(COMPONENT, "health_events_total"),
            "NVML health events, by kind.",
            ["kind"],
            registry=r,
        )
        self.tainted_devices = Gauge(
            metric_name(COMPONENT, "tainted_devices"),
            "Devices with a taint, by effect.",
            ["effect"],
            registry=r,
        )
        self.observe_taints(())  # 0 from the start: an alert tells "none" from "not scraped"
        self.recovered = Counter(
            metric_name(COMPONENT, "recovered_total"),
            "Recovery actions after a crash.",
            ["action"],
            registry=r,
        )
        self.gc_unprepared = Counter(
            metric_name(COMPONENT, "gc_unprepared_total"),
            "Claims unprepared because they no longer exist in the API.",
            registry=r,
        )
        for op in ("prepare", "unprepare"):  # show the series before the first failure
            self.claim_errors.labels(op=op, reason="NotAllocated")
        for kind in ("gpu", "mig"):
            self.prepared_devices.labels(type=kind)

    def _op(self, op: str) -> OperationMetrics:
        return self.prepare if op == "prepare" else self.unprepare

    def claim_done(self, op: str, seconds: float) -> None:
        metric = self._op(op)
        metric.total.labels(result="success").inc()
        metric.duration.labels(result="success").observe(seconds)

    def claim_failed(self, op: str, reason: str, seconds: float) -> None:
        metric = self._op(op)
        metric.total.labels(result=reason).inc()
        metric.duration.labels(result=reason).observe(seconds)
        self.claim_errors.labels(op=op, reason=reason).inc()

    def observe_state(self, records: Iterable[Any]) -> None:
        """Gauges from the prepared claims (``ClaimRecord``s) after every change."""
        completed = [r for r in records if r.state == "PrepareCompleted"]
        self.prepared_claims.set(len(completed))
        kinds = Tally(d.kind for r in completed for d in r.devices)
        for kind in ("gpu", "mig"):
            self.prepared_devices.labels(type=kind).set(kinds.get(kind, 0))
        levels = Tally(r.enforcement for r in completed)
        for level in ("exclusive", "mig", "hard", "soft", "none"):
            self.prepared_shares.labels(enforcement=level).set(levels.get(level, 0))

    def observe_taints(self, effects: Iterable[str]) -> None:
        counts = Tally(effects)
        for effect in ("NoSchedule", "None"):
            self.tainted_devices.labels(effect=effect).set(counts.get(effect, 0))
