"""The pure parts of the Prometheus harness: the discovery's targets and meta labels, and the
dashboard's template variables filled in (the chart-facing tests are in
e2e/tests/chart/test_prometheus.py)."""

from __future__ import annotations

import pytest

from gpuslice_testkit.kube_sd import endpoints_targets, pod_targets
from gpuslice_testkit.prometheus import dashboard_queries, substitute

pytestmark = pytest.mark.timeout(10)


def pod(ip: str | None, *, init_ports: bool = False) -> dict[str, object]:
    sidecar = {"name": "enforcer", "ports": [{"name": "enforcer", "containerPort": 9402}]}
    return {
        "metadata": {
            "namespace": "ns",
            "name": "p",
            "uid": "u",
            "labels": {"app.kubernetes.io/name": "x"},
        },
        "spec": {
            "nodeName": "n1",
            "containers": [
                {"name": "plugin", "ports": [{"name": "plugin", "containerPort": 9400}]},
                {"name": "idle"},
            ],
            "initContainers": [sidecar] if init_ports else [],
        },
        "status": {"phase": "Running", "podIP": ip} if ip else {"phase": "Pending"},
    }


def test_a_pod_without_an_ip_has_no_target() -> None:
    assert pod_targets(pod(None)) == []


def test_a_pod_gives_one_target_per_port_and_one_per_container_without() -> None:
    groups = pod_targets(pod("10.1.0.5", init_ports=True))
    assert [g["targets"] for g in groups] == [["10.1.0.5:9400"], ["10.1.0.5"], ["10.1.0.5:9402"]]
    plugin = groups[0]["labels"]
    assert plugin["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == "x"
    assert plugin["__meta_kubernetes_pod_labelpresent_app_kubernetes_io_name"] == "true"
    assert plugin["__meta_kubernetes_pod_node_name"] == "n1"
    assert plugin["__meta_kubernetes_pod_container_port_name"] == "plugin"
    assert plugin["__meta_kubernetes_pod_container_init"] == "false"
    assert groups[2]["labels"]["__meta_kubernetes_pod_container_init"] == "true"


def test_endpoints_carry_the_service_the_pod_and_the_container_behind_the_port() -> None:
    endpoints = {
        "metadata": {"namespace": "ns", "name": "svc"},
        "subsets": [
            {
                "addresses": [{"ip": "10.1.0.5", "targetRef": {"kind": "Pod", "name": "p"}}],
                "notReadyAddresses": [{"ip": "10.1.0.6", "nodeName": "n2"}],
                "ports": [{"name": "plugin", "port": 9400}],
            }
        ],
    }
    service = {"metadata": {"name": "svc", "labels": {"app.kubernetes.io/component": "node"}}}
    ready, unready = endpoints_targets(endpoints, {"svc": service}, {"p": pod("10.1.0.5")})
    assert ready["targets"] == ["10.1.0.5:9400"] and unready["targets"] == ["10.1.0.6:9400"]
    labels = ready["labels"]
    assert labels["__meta_kubernetes_service_label_app_kubernetes_io_component"] == "node"
    assert labels["__meta_kubernetes_endpoint_port_name"] == "plugin"
    assert labels["__meta_kubernetes_endpoint_address_target_kind"] == "Pod"
    assert labels["__meta_kubernetes_pod_node_name"] == "n1"
    assert labels["__meta_kubernetes_pod_container_name"] == "plugin"
    assert labels["__meta_kubernetes_endpoint_ready"] == "true"
    assert unready["labels"]["__meta_kubernetes_endpoint_ready"] == "false"
    assert "__meta_kubernetes_pod_name" not in unready["labels"]  # no pod behind it


def test_every_spelling_of_a_variable_is_filled_in() -> None:
    values = {"node": ".*", "ns": "a|b"}
    assert substitute('x{node=~"$node",n=~"${ns}",m=~"${ns:regex}",o=~"[[node]]"}', values) == (
        'x{node=~".*",n=~"a|b",m=~"a|b",o=~".*"}'
    )
    assert substitute("rate(x[$__rate_interval])", {}) == "rate(x[5m])"
    with pytest.raises(KeyError, match=r"\$zone, which the dashboard does not define"):
        substitute('x{zone="$zone"}', values)


def test_a_variable_without_an_all_value_matches_anything() -> None:
    dashboard = {
        "templating": {"list": [{"name": "gpu", "type": "custom"}]},
        "panels": [{"title": "t", "targets": [{"refId": "A", "expr": 'x{gpu=~"$gpu"}'}]}],
    }
    assert dashboard_queries(dashboard) == {"t [A]": 'x{gpu=~".*"}'}
