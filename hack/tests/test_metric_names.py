"""Every metric name comes from one place: ``gpuslice_core.metrics`` (``NAMESPACE``, the
``Subsystem`` of each component, ``metric_name``), never from a literal in a service.

Each service's metrics are built here as the service builds them (its registries, its collectors
with no data), and every family must be ``gpuslice_<subsystem>_…`` with a subsystem that
``SERVICE_SUBSYSTEMS`` gives that service. Their labels follow one scheme (docs/metrics.md): a
GPU as dcgm-exporter labels it (``gpu``, ``UUID``, ``Hostname``, ``GPU_I_PROFILE``,
``GPU_I_ID``), never ``device`` (dcgm-exporter's ``nvidia0``) or ``device_index``, and ratios
0..1 named ``_ratio``, never ``_percent``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

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


class _ViewSource:
    """The view before its first list: events counted, not synced."""

    def __init__(self) -> None:
        self.events = {"ResourceSlice": 1}
        self.synced = threading.Event()


def exported() -> dict[str, set[str]]:
    """The metric families each service exports, by its directory under services/."""
    return {service: set(found) for service, found in labelled().items()}


def _label_names(collectors: Iterable[object]) -> dict[str, tuple[str, ...]]:
    """Family name -> label names, without a scrape: a client metric's declared labels, a
    custom family's (``*MetricFamily(labels=…)`` keeps them even with no sample)."""
    found: dict[str, tuple[str, ...]] = {}
    for collector in collectors:
        if isinstance(collector, MetricWrapperBase):
            found |= {f.name: tuple(collector._labelnames) for f in collector.describe()}
        elif isinstance(collector, Metric):
            found[collector.name] = tuple(getattr(collector, "_labelnames", ()))
        else:
            found |= _label_names(collector.collect())  # type: ignore[attr-defined]
    return found


def _registry(build: type) -> dict[str, tuple[str, ...]]:
    registry = CollectorRegistry()
    build(registry)
    return _label_names(list(registry._collector_to_names))  # no public list of collectors


def labelled() -> dict[str, dict[str, tuple[str, ...]]]:
    """Family name -> label names, of each service's metrics, by its directory."""
    device_plugin = _registry(DevicePluginMetrics)
    device_plugin |= _label_names(ContainerCollector(None, {}).describe())  # type: ignore[arg-type]
    module_level: list[MetricWrapperBase] = [
        connections.OPEN,
        connections.CLOSED,
        review.REVIEWS,
        review.DURATION,
    ]
    controller = _label_names(module_level)
    controller |= _label_names(view_metrics.ViewCollector(_ViewSource()).collect())  # type: ignore[arg-type]
    snapshot = view_metrics.Snapshot((), {})
    controller |= _label_names(view_metrics.gpu_families(snapshot))
    controller |= _label_names(view_metrics.claim_families(snapshot))
    return {
        "controller": controller,
        "device-plugin": device_plugin,
        "enforcer": _registry(EnforcerMetrics),
        "kubelet-plugin": _registry(PluginMetrics),
        "mig-manager": _registry(MigManagerMetrics),
    }


#: Labels of the scheme's that mean something else elsewhere: dcgm-exporter's ``device`` is
#: the device node (``nvidia0``); a GPU is ``gpu`` (index) and ``UUID``.
FORBIDDEN_LABELS = {"device", "device_index", "device_uuid", "node", "uuid", "index"}


def scheme_breaches(families: dict[str, tuple[str, ...]]) -> list[str]:
    """What in ``families`` breaks the label scheme: a forbidden label, a ``_percent`` name."""
    found = [f"{n}: _percent (a ratio 0..1 is _ratio)" for n in families if "_percent" in n]
    found += [
        f"{n}: label {label}"
        for n, labels in families.items()
        for label in labels
        if label in FORBIDDEN_LABELS
    ]
    return sorted(found)


@pytest.mark.parametrize("service", sorted(SERVICE_SUBSYSTEMS))
def test_each_series_follows_the_label_scheme(service: str) -> None:
    assert scheme_breaches(labelled()[service]) == []


def test_the_scheme_check_catches_a_breach() -> None:
    registry = CollectorRegistry()
    Gauge("gpuslice_enforcer_x_percent", "x", ["claim_uid"], registry=registry)
    Gauge("gpuslice_enforcer_y", "y", ["claim_uid", "device"], registry=registry)
    Gauge("gpuslice_container_z", "z", ["device_index"], registry=registry)
    assert scheme_breaches(_label_names(list(registry._collector_to_names))) == [
        "gpuslice_container_z: label device_index",
        "gpuslice_enforcer_x_percent: _percent (a ratio 0..1 is _ratio)",
        "gpuslice_enforcer_y: label device",
    ]


def test_a_gpu_is_labelled_as_dcgm_exporter_labels_it() -> None:
    """The per-GPU series join dcgm-exporter's on (gpu, UUID); MIG ones carry its profile."""
    families = {**labelled()["controller"], **labelled()["enforcer"]}
    for name in ("gpuslice_gpu_tainted", "gpuslice_gpu_memory_used_bytes"):
        assert {"Hostname", "gpu", "UUID", "GPU_I_PROFILE", "dra_device"} <= set(families[name])
    for name in ("gpuslice_enforcer_share_memory_used_bytes", "gpuslice_enforcer_share_bypasses"):
        assert {"claim_uid", "gpu", "UUID"} <= set(families[name])
    containers = labelled()["device-plugin"]["gpuslice_container_gpu_memory_used_bytes"]
    assert {"namespace", "pod", "container", "gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID"} <= set(
        containers
    )
    # what adds GPU_I_ID to the controller's series: on (Hostname, dra_device)
    instance = {"gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID"}
    plugin = labelled()["kubelet-plugin"]["gpuslice_kubelet_plugin_device_info"]
    assert {*instance, "dra_device"} <= set(plugin)
    assert instance <= set(labelled()["mig-manager"]["gpuslice_mig_manager_instance_info"])


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
        "gpuslice_mig_manager_instance_info",
        "gpuslice_kubelet_plugin_device_info",
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
