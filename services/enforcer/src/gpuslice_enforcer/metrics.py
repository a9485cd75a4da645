"""Prometheus metrics of the enforcer (one registry per enforcer instance).

Per share and GPU (labels ``claim_uid``, ``gpu``, ``UUID``): memory used and limit, SM use and
limit (``_ratio``, 0..1 of the GPU's SMs), throttled time, kills, processes caught bypassing MPS;
violations by resource and action; the mechanism in force per resource and the share's level
(info-style gauges set to 1). Per GPU (``gpu``, and ``UUID`` where known): failed watchdog samples,
MPS daemon restarts. ``gpu`` is the GPU's index and ``UUID`` its UUID, as dcgm-exporter writes
them, so a share's series join dcgm-exporter's on ``(Hostname, gpu, UUID)``; the node
(``Hostname``) is not written here but by the chart's monitors from the pod's node
(docs/metrics.md).

A share is named by its claim's UID only. The endpoint needs no credentials (node pods, port
9402), and a claim's namespace and name are tenant data: who runs what where. A UID says nothing
until it is looked up in the API with the right to read claims, which is what the cluster view
does (``gpuslice_view.live``) and what a dashboard joins on.
Operations: create/release share, attach container, watchdog sample.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuslice_core.metrics import OperationMetrics, Subsystem, metric_name, standard_series
from gpuslice_enforcer import __version__

COMPONENT = Subsystem.ENFORCER
_SHARE = ["claim_uid", "gpu", "UUID"]


def _share(name: str) -> str:
    """``gpuslice_enforcer_share_<name>``: a per-share series."""
    return metric_name(COMPONENT, f"share_{name}")


class EnforcerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        standard_series(r, component=COMPONENT, version=__version__)
        self.create_share = OperationMetrics(COMPONENT, "create_share", "CreateShare calls", r)
        self.release_share = OperationMetrics(COMPONENT, "release_share", "ReleaseShare calls", r)
        self.attach = OperationMetrics(COMPONENT, "attach_container", "AttachContainer calls", r)
        self.sample = OperationMetrics(COMPONENT, "watchdog_sample", "Watchdog samples", r)
        self.memory_used = Gauge(_share("memory_used_bytes"), "Memory used.", _SHARE, registry=r)
        self.memory_limit = Gauge(_share("memory_limit_bytes"), "Memory limit.", _SHARE, registry=r)
        self.sm_used = Gauge(
            _share("sm_ratio"),
            "SM use over the last sample, 0..1 of the GPU's SMs.",
            _SHARE,
            registry=r,
        )
        self.sm_limit = Gauge(
            _share("sm_limit_ratio"), "SM limit (cores), 0..1 of the GPU's SMs.", _SHARE, registry=r
        )
        self.throttled = Counter(
            _share("throttled_seconds"), "Time the share's cgroups were frozen.", _SHARE, registry=r
        )
        self.kills = Counter(
            _share("kills"), "Processes killed over the memory limit.", _SHARE, registry=r
        )
        self.bypasses = Counter(
            _share("bypasses"),
            "Processes of the share caught running beside its MPS server instead of through it "
            "(each counted once, whether killed or only reported).",
            _SHARE,
            registry=r,
        )
        self.violations = Counter(
            _share("violations"),
            "Limit breaches observed, by resource and action.",
            [*_SHARE, "resource", "action"],
            registry=r,
        )
        self.mechanism = Gauge(
            _share("mechanism"),
            "1 for the mechanism enforcing each resource of the share.",
            ["claim_uid", "resource", "mechanism"],
            registry=r,
        )
        self.level = Gauge(
            _share("level"),
            "1 for the share's enforcement level: hard (every process held), soft or none.",
            ["claim_uid", "level"],
            registry=r,
        )
        self.sample_errors = Counter(
            metric_name(COMPONENT, "watchdog_errors"),
            "Samples that failed (nothing is killed or frozen on a failed sample).",
            ["gpu"],
            registry=r,
        )
        self.mps_restarts = Counter(
            metric_name(COMPONENT, "mps_daemon_restarts"),
            "MPS control daemons restarted after they died.",
            ["gpu", "UUID"],
            registry=r,
        )

    def forget_share(self, claim_uid: str) -> None:
        """Drop a released share's series (every series whose first label is its claim UID)."""
        for labelled in (
            self.memory_used,
            self.memory_limit,
            self.sm_used,
            self.sm_limit,
            self.throttled,
            self.kills,
            self.bypasses,
            self.violations,
            self.mechanism,
            self.level,
        ):
            for values in list(labelled._metrics):  # prometheus_client offers no query for them
                if values[0] == claim_uid:
                    with contextlib.suppress(KeyError):
                        labelled.remove(*values)
