"""Every metric name comes from one place: ``gpuslice_core.metrics`` (``NAMESPACE``, the
``Subsystem`` of each component, ``metric_name``), never from a literal in a service.

Each service's metrics are built here as the service builds them (its registries, its collectors
with no data), and every family must be ``gpuslice_<subsystem>_…`` with a subsystem that
``SERVICE_SUBSYSTEMS`` gives that service.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gpuslice_controller import connections
from gpuslice_controller.admission import review
from gpuslice_controller.view import metrics as view_metrics
from gpuslice_core.metrics import BUILD_INFO, NAMESPACE, SERVICE_SUBSYSTEMS, Subsystem, metric_name
from gpuslice_device_plugin.metrics import Metrics as DevicePluginMetrics
from gpuslice_device_plugin.usage import ContainerCollector
from gpuslice_enforcer.metrics import EnforcerMetrics
from gpuslice_kubelet_plugin.metrics import PluginMetrics
from gpuslice_mig_manager.metrics import Metrics as MigManagerMetrics

ROOT = Path(__file__).resolve().parents[2]


def families(collectors: Iterable[Collector]) -> set[str]:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return {family.name for family in registry.collect()}


class _ViewSource:
    """The view before its first list: events counted, not synced."""

    def __init__(self) -> None:
        self.events = {"ResourceSlice": 1}
        self.synced = threading.Event()


def exported() -> dict[str, set[str]]:
    """The metric families each service exports, by its directory under services/."""
    registry = CollectorRegistry()
    EnforcerMetrics(registry)
    enforcer = families([registry])
    registry = CollectorRegistry()
    PluginMetrics(registry)
    kubelet_plugin = families([registry])
    registry = CollectorRegistry()
    MigManagerMetrics(registry)
    mig_manager = families([registry])
    registry = CollectorRegistry()
    DevicePluginMetrics(registry)
    device_plugin = families([registry])
    device_plugin |= {f.name for f in ContainerCollector(None, {}).describe()}  # type: ignore[arg-type]
    module_level: list[MetricWrapperBase] = [
        connections.OPEN,
        connections.CLOSED,
        review.REVIEWS,
        review.DURATION,
    ]
    controller = {family.name for metric in module_level for family in metric.describe()}
    controller |= {f.name for f in view_metrics.ViewCollector(_ViewSource()).collect()}  # type: ignore[arg-type]
    snapshot = view_metrics.Snapshot((), {})
    controller |= {f.name for f in view_metrics.gpu_families(snapshot)}
    controller |= {f.name for f in view_metrics.claim_families(snapshot)}
    return {
        "controller": controller,
        "device-plugin": device_plugin,
        "enforcer": enforcer,
        "kubelet-plugin": kubelet_plugin,
        "mig-manager": mig_manager,
    }


def test_every_service_is_given_its_subsystems() -> None:
    services = sorted(p.parent.name for p in ROOT.glob("services/*/pyproject.toml"))
    assert sorted(SERVICE_SUBSYSTEMS) == services
    assert sorted(exported()) == services


def standard(name: str) -> bool:
    """The series every service carries besides its own (``standard_series``)."""
    return name == BUILD_INFO or name.startswith(("process_", "python_"))


NODE_METRICS = {
    "device-plugin": DevicePluginMetrics,
    "enforcer": EnforcerMetrics,
    "kubelet-plugin": PluginMetrics,
    "mig-manager": MigManagerMetrics,
}


@pytest.mark.parametrize("service", sorted(NODE_METRICS))
def test_a_node_service_exposes_build_info_and_process_series_and_no_created(
    service: str,
) -> None:
    registry = CollectorRegistry()
    NODE_METRICS[service](registry)
    text = generate_latest(registry).decode()
    component = next(s for s in SERVICE_SUBSYSTEMS[service]).value
    assert re.search(
        rf'^{BUILD_INFO}{{component="{component}",.*version="[^"]+"}} 1.0$', text, re.M
    )
    assert "\nprocess_cpu_seconds_total " in text and "\nprocess_open_fds " in text
    assert "_created" not in text  # counters are exposed without their creation time


@pytest.mark.parametrize("service", sorted(SERVICE_SUBSYSTEMS))
def test_each_name_starts_with_its_services_prefix(service: str) -> None:
    names = {n for n in exported()[service] if not standard(n)}
    prefixes = tuple(metric_name(sub, "") for sub in SERVICE_SUBSYSTEMS[service])
    assert names, f"{service} exports no metric"
    assert [n for n in sorted(names) if not n.startswith(prefixes)] == []
    # the service's own subsystem is the first, and it names something
    assert any(n.startswith(prefixes[0]) for n in names)


def test_the_names_are_the_ones_dashboards_know() -> None:
    """The shared parts spell the names the Grafana dashboard and the docs use."""
    assert NAMESPACE == "gpuslice"
    assert metric_name(Subsystem.ENFORCER, "share_sm_ratio") == "gpuslice_enforcer_share_sm_ratio"
    assert metric_name(Subsystem.KUBELET_PLUGIN, "prepare") == "gpuslice_kubelet_plugin_prepare"
    names = set().union(*exported().values())
    assert {
        "gpuslice_enforcer_share_memory_used_bytes",
        "gpuslice_kubelet_plugin_published_devices",
        "gpuslice_mig_manager_instances",
        "gpuslice_device_plugin_devices",
        "gpuslice_container_gpu_memory_used_bytes",
        "gpuslice_controller_admission",
        "gpuslice_view_synced",
        "gpuslice_gpu_cores_allocated_ratio",
        "gpuslice_claim_memory_bytes",
    } <= names


def test_every_series_the_grafana_dashboard_queries_is_exported_by_the_controller() -> None:
    dashboard = json.loads((ROOT / "charts/gpuslice/files/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"gpuslice_[a-z_]+", e)}
    exposed = exported()["controller"]
    exposed |= {f"{name}_total" for name in exposed}  # a counter's family gains _total
    assert used, "the dashboard queries no gpuslice series"
    assert used <= exposed, used - exposed


#: A metric name spelled out in code: a string literal (not a docstring's ``…``) that starts
#: with the namespace and a subsystem.
_SUBSYSTEMS = "|".join(s.value for s in Subsystem)
_LITERAL = re.compile(rf"""(?<![`\w])f?["']gpuslice_(?:{_SUBSYSTEMS})_""")


def test_no_shipped_module_spells_a_metric_name() -> None:
    found = []
    for path in sorted(ROOT.glob("*/*/src/**/*.py")):
        if "_pb2" in path.name or path.parts[len(ROOT.parts)] not in ("libs", "services", "tools"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _LITERAL.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "use gpuslice_core.metrics.metric_name"
