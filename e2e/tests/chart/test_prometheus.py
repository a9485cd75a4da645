"""A real Prometheus over the chart's monitors (``gpuslice_testkit.prometheus``, docs/real-node.md,
"A real Prometheus"): the scrape configuration generated from the rendered ServiceMonitors and
PodMonitors as Prometheus Operator writes it, judged by promtool; every PromQL expression of
the shipped dashboard and alert rules run by Prometheus; and targets discovered in the
sandbox's API server through the monitors' selectors and relabellings.

Needs Debian's ``prometheus`` package (hack/node-packages.sh); without it the tests that run
it skip, saying so.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent.testing import temporary_namespace, unique
from e2e.support.chart import daemonset, find, render, sets
from e2e.support.prometheus import RULES, dashboard, monitors, rules_of
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import RawApi, resource_path
from gpuslice_testkit.core import wait_for
from gpuslice_testkit.kube_sd import KubernetesDiscovery
from gpuslice_testkit.prometheus import (
    MonitorError,
    Prometheus,
    PrometheusError,
    dashboard_queries,
    prometheus_binary,
    prometheus_config,
    rule_queries,
    scrape_configs,
)

Obj = dict[str, Any]
pytestmark = pytest.mark.timeout(90)
TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
ON = sets("metrics.serviceMonitor.enabled=true")
PROMETHEUS = prometheus_binary()
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus is not installed (Debian's prometheus package: hack/node-packages.sh)",
)


class Files:
    """The Secret keys a monitor names, as files on this machine (all the same CA here)."""

    def __init__(self, ca: Path) -> None:
        self.ca = ca
        self.asked: list[tuple[str, str, str]] = []

    def __call__(self, namespace: str, name: str, key: str) -> Path:
        self.asked.append((namespace, name, key))
        return self.ca


def by_job(configs: list[Obj]) -> dict[str, Obj]:
    return {c["job_name"]: c for c in configs}


def test_scrape_configs_are_the_operators_for_every_monitor(helm_bin: Path, tmp_path: Path) -> None:
    objs = render(helm_bin, *ON)
    files = Files(tmp_path / "ca.crt")
    token = tmp_path / "token"
    configs = by_job(
        scrape_configs(objs, discovery_url="http://sd", files=files, paths={TOKEN: token})
    )
    node = [
        e["port"] for e in find(objs, "ServiceMonitor", "gpuslice-node")[0]["spec"]["endpoints"]
    ]
    plugin = [
        e["port"]
        for e in find(objs, "PodMonitor", "gpuslice-device-plugin")[0]["spec"][
            "podMetricsEndpoints"
        ]
    ]
    assert set(configs) == {
        *(f"serviceMonitor/gpuslice/gpuslice-node/{i}" for i in range(len(node))),
        "serviceMonitor/gpuslice/gpuslice-controller/0",
        "serviceMonitor/gpuslice/gpuslice-controller/1",
        *(f"podMonitor/gpuslice/gpuslice-device-plugin/{i}" for i in range(len(plugin))),
    }

    first = configs["serviceMonitor/gpuslice/gpuslice-node/0"]
    assert first["http_sd_configs"] == [
        {"url": "http://sd/endpoints?namespaces=gpuslice", "refresh_interval": "1s"}
    ]
    assert not first["honor_labels"] and first["scheme"] == "http"
    relabels = first["relabel_configs"]
    keeps = {tuple(r["source_labels"]): r["regex"] for r in relabels if r.get("action") == "keep"}
    assert (
        keeps[
            (
                "__meta_kubernetes_service_label_app_kubernetes_io_component",
                "__meta_kubernetes_service_labelpresent_app_kubernetes_io_component",
            )
        ]
        == "(node);true"
    )
    assert keeps[("__meta_kubernetes_endpoint_port_name",)] == node[0]
    assert {
        "source_labels": ["__meta_kubernetes_service_name"],
        "replacement": "${1}",
        "target_label": "job",
    } in relabels
    assert {"target_label": "endpoint", "replacement": node[0]} in relabels
    # The monitor's own relabelling comes last, after the operator's labels: every endpoint of
    # every monitor names the node as dcgm-exporter does ("Hostname").
    hostname = {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "Hostname"}
    assert relabels[-1] == hostname
    view_job = "serviceMonitor/gpuslice/gpuslice-controller/1"  # tenants' claims, see below
    assert [
        job
        for job, c in configs.items()
        if c["relabel_configs"][-1] != hostname and job != view_job
    ] == []
    plain = configs["serviceMonitor/gpuslice/gpuslice-controller/0"]
    assert plain["honor_labels"] is True  # a GPU's series name the GPU's node, not ours

    view = configs["serviceMonitor/gpuslice/gpuslice-controller/1"]
    assert view["scheme"] == "https" and view["metrics_path"] == "/view/metrics"
    assert view["honor_labels"] is True
    assert view["relabel_configs"][-1] == {
        "action": "labeldrop",
        "regex": "(pod|container|namespace|service)",
    }
    assert view["tls_config"] == {
        "ca_file": str(files.ca),
        "server_name": "gpuslice-controller.gpuslice.svc",
    }
    assert files.asked and all(ns == "gpuslice" and key == "ca.crt" for ns, _, key in files.asked)
    assert view["authorization"] == {"credentials_file": str(token)}

    pods = configs["podMonitor/gpuslice/gpuslice-device-plugin/0"]
    assert pods["http_sd_configs"][0]["url"] == "http://sd/pod?namespaces=gpuslice"
    assert {"target_label": "job", "replacement": "gpuslice/gpuslice-device-plugin"} in pods[
        "relabel_configs"
    ]
    assert pods["honor_labels"] is True  # the workload's own namespace and pod stay


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_generated_configuration(helm_bin: Path, tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("")
    (tmp_path / "token").write_text("t")
    scrape = scrape_configs(
        render(helm_bin, *ON),
        discovery_url="http://127.0.0.1:1",
        files=Files(tmp_path / "ca.crt"),
        paths={TOKEN: tmp_path / "token"},
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(scrape, rule_files=[RULES])))
    out = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_monitor_the_generator_cannot_translate_is_refused_by_field() -> None:
    monitor = {
        "kind": "PodMonitor",
        "metadata": {"namespace": "ns", "name": "m"},
        "spec": {
            "selector": {"matchExpressions": [{"key": "a", "operator": "Near", "values": []}]},
            "podMetricsEndpoints": [{"port": "http"}],
        },
    }
    with pytest.raises(MonitorError) as err:
        scrape_configs([monitor], discovery_url="http://sd")
    assert "PodMonitor ns/m endpoint 0: spec.selector.matchExpressions operator 'Near'" in str(
        err.value
    )
    assert "allowed: In, NotIn, Exists, DoesNotExist" in str(err.value)
    monitor["spec"] = {"podMetricsEndpoints": [{"port": "http", "basicAuth": {}}]}
    with pytest.raises(MonitorError, match="endpoint 0: field 'basicAuth' is not translated"):
        scrape_configs([monitor], discovery_url="http://sd")


def test_every_dashboard_query_is_found_with_its_variables_filled_in() -> None:
    queries = dashboard_queries(dashboard())
    panels = [
        (panel["title"], target["refId"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets") or []
    ]
    assert len(panels) >= 10
    variables = [v for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    assert len(variables) >= 2
    assert {f"{title} [{ref}]" for title, ref in panels} | {
        f"${v['name']}" for v in variables
    } == set(queries)
    for v in variables:  # label_values(series, label): the series is the PromQL
        series = v["definition"].removeprefix("label_values(").rsplit(",", 1)[0]
        assert queries[f"${v['name']}"] == series
    assert not [q for q in queries.values() if "$" in q or "[[" in q]
    assert any('=~".*"}' in q for q in queries.values())  # "All" of a variable


@pytest.fixture(scope="module")
def empty_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus with the chart's rules loaded and nothing to scrape."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian's prometheus package)")
    workdir = tmp_path_factory.mktemp("prometheus")
    with Prometheus(workdir, prometheus_config([], rule_files=[RULES]), PROMETHEUS) as prom:
        yield prom


@needs_prometheus
def test_every_query_of_the_dashboard_and_the_rules_runs(empty_prometheus: Prometheus) -> None:
    queries = {**dashboard_queries(dashboard()), **rule_queries(yaml.safe_load(RULES.read_text()))}
    failed = {}
    for name, expr in queries.items():
        try:
            empty_prometheus.query(expr)
        except PrometheusError as exc:
            failed[name] = str(exc)
    assert failed == {}
    with pytest.raises(PrometheusError, match="bad_data"):  # the check can fail
        empty_prometheus.query("sum by (Hostname) (gpuslice_gpu_tainted")


@needs_prometheus
def test_the_rules_are_loaded_and_evaluate(empty_prometheus: Prometheus) -> None:
    def evaluated() -> dict[str, str] | None:
        found = {r["name"]: r["health"] for g in empty_prometheus.rules() for r in g["rules"]}
        return found if set(found.values()) == {"ok"} else None

    health = wait_for(evaluated, 20, "every rule evaluated once")
    assert set(health) == {r["alert"] for r in rules_of(RULES)}


# -- discovery in the sandbox's API server ------------------------------------------------------


def _pod(namespace: str, name: str, node: str, template: Obj) -> Obj:
    """A pod as the DaemonSet would make it (labels, container names and ports), bound to
    ``node``; nothing runs it."""
    containers = [
        {"name": c["name"], "image": "registry.invalid/gpuslice:test", "ports": c.get("ports", [])}
        for c in template["spec"]["containers"]
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": template["metadata"]["labels"],
        },
        "spec": {"nodeName": node, "containers": containers, "automountServiceAccountToken": False},
    }


def _running(kube: RawApi, namespace: str, name: str, ip: str) -> None:
    kube.patch(
        resource_path("v1", "pods", namespace=namespace, name=name) + "/status",
        {
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        },
    )


def _service_with_endpoints(
    kube: RawApi, service: Obj, pod: str | None, node: str, ip: str
) -> None:
    """The chart's Service without its selector, and the Endpoints the endpoints controller
    would write for a ready pod behind it."""
    ns = service["metadata"]["namespace"]
    spec = {k: v for k, v in service["spec"].items() if k != "selector"}
    kube.create(resource_path("v1", "services", namespace=ns), {**service, "spec": spec})
    ports = [{"name": p["name"], "port": p["port"], "protocol": "TCP"} for p in spec["ports"]]
    kube.create(
        resource_path("v1", "endpoints", namespace=ns),
        {
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {"name": service["metadata"]["name"], "namespace": ns},
            "subsets": [
                {
                    "addresses": [
                        {
                            "ip": ip,
                            "nodeName": node,
                            **(
                                {"targetRef": {"kind": "Pod", "name": pod, "namespace": ns}}
                                if pod
                                else {}
                            ),
                        }
                    ],
                    "ports": ports,
                }
            ],
        },
    )


@needs_prometheus
@pytest.mark.timeout(120)
def test_targets_are_discovered_through_the_chart_monitors(
    sandbox: ControlPlane, helm_bin: Path, tmp_path: Path
) -> None:
    kube = RawApi(new_api_client(sandbox.kubeconfig, user_agent="gpuslice-e2e-prometheus"))
    node = unique("prom-node")
    kube.create(
        resource_path("v1", "nodes"),
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}},
    )
    try:
        with temporary_namespace(kube, "prom") as ns:
            objs = render(helm_bin, *ON, namespace=ns)
            node_pod, plugin_pod = "gpuslice-node-p1", "gpuslice-device-plugin-p2"
            for name, component, ip in (
                (node_pod, "node", "192.0.2.10"),
                (plugin_pod, "device-plugin", "192.0.2.11"),
            ):
                template = daemonset(objs, component)["spec"]["template"]
                kube.create(
                    resource_path("v1", "pods", namespace=ns), _pod(ns, name, node, template)
                )
                _running(kube, ns, name, ip)
            services = {s["metadata"]["name"]: s for s in find(objs, "Service")}
            _service_with_endpoints(
                kube, services["gpuslice-node-metrics"], node_pod, node, "192.0.2.10"
            )
            _service_with_endpoints(kube, services["gpuslice-controller"], None, node, "192.0.2.12")
            stray = yaml.safe_load(yaml.safe_dump(services["gpuslice-node-metrics"]))
            stray["metadata"]["name"] = "stray"
            stray["metadata"]["labels"]["app.kubernetes.io/component"] = "other"
            _service_with_endpoints(kube, stray, node_pod, node, "192.0.2.13")

            (tmp_path / "token").write_text("not-a-token")
            with KubernetesDiscovery(lambda path: kube.list(path)["items"]) as sd:
                scrape = scrape_configs(
                    monitors(objs),
                    discovery_url=sd.url,
                    files=Files(sandbox.pki / "ca.crt"),
                    paths={TOKEN: tmp_path / "token"},
                )
                assert PROMETHEUS is not None
                with Prometheus(
                    tmp_path / "prom", prometheus_config(scrape, rule_files=[RULES]), PROMETHEUS
                ) as prom:
                    node_ports = [
                        e["port"]
                        for e in find(objs, "ServiceMonitor", "gpuslice-node")[0]["spec"][
                            "endpoints"
                        ]
                    ]
                    plugin_ports = [
                        e["port"]
                        for e in find(objs, "PodMonitor", "gpuslice-device-plugin")[0]["spec"][
                            "podMetricsEndpoints"
                        ]
                    ]

                    def discovered() -> list[Obj] | None:
                        found = [t["labels"] for t in prom.targets()]
                        want = len(node_ports) + 2 + len(plugin_ports)
                        return found if len(found) >= want else None

                    targets = wait_for(discovered, 30, "every monitor's targets")
                    rules = {r["name"] for g in prom.rules() for r in g["rules"]}
    finally:
        kube.delete(resource_path("v1", "nodes", name=node))

    def labels_of(job: str, endpoint: str) -> Obj:
        (found,) = [t for t in targets if t["job"] == job and t["endpoint"] == endpoint]
        return found

    assert not [t for t in targets if t.get("service") == "stray"]  # the selector keeps it out
    assert len(targets) == len(node_ports) + 2 + len(plugin_ports)
    for port in node_ports:
        t = labels_of("gpuslice-node-metrics", port)
        assert (t["namespace"], t["service"], t["pod"], t["Hostname"]) == (
            ns,
            "gpuslice-node-metrics",
            node_pod,
            node,
        )
    # The container behind the port, found by its number (sidecars, which are init containers,
    # are not looked at by Prometheus 2.42's endpoints discovery).
    assert labels_of("gpuslice-node-metrics", "plugin")["container"] == "kubelet-plugin"
    assert labels_of("gpuslice-controller", "metrics")["service"] == "gpuslice-controller"
    # the per-claim endpoint's series name tenants' claims: no target label of the controller
    # pod stands in for theirs
    view = labels_of("gpuslice-controller", "webhook")
    assert not {"pod", "container", "namespace", "service"} & set(view), view
    for port in plugin_ports:
        t = labels_of(f"{ns}/gpuslice-device-plugin", port)
        assert (t["namespace"], t["pod"], t["Hostname"]) == (ns, plugin_pod, node)
    assert rules == {r["alert"] for r in rules_of(RULES)}
