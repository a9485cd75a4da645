"""The chart's monitoring files, for the tests of the alert rules and of the Prometheus harness
(``gpuslice_testkit.prometheus``): where they are, and the rules as data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from e2e.support.chart import CHART

Obj = dict[str, Any]

RULES = CHART / "files" / "alerts.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"


def rules_of(path: Path) -> list[Obj]:
    """Every rule of a Prometheus rule file, groups flattened."""
    data: Obj = yaml.safe_load(path.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def dashboard() -> Obj:
    loaded: Obj = json.loads(DASHBOARD.read_text())
    return loaded


def monitors(objs: list[Obj]) -> list[Obj]:
    """The ServiceMonitors and PodMonitors of a rendered chart."""
    return [o for o in objs if o["kind"] in ("ServiceMonitor", "PodMonitor")]


def _crd(kind: str, plural: str) -> Obj:
    """A Prometheus Operator CRD as far as the API server needs it to store the chart's objects:
    the group, names and version, with the schema left open (the operator's own CRDs validate
    every field; the harness refuses what it cannot translate, by field)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


#: ServiceMonitor, PodMonitor and PrometheusRule: what a cluster with Prometheus Operator
#: serves, so the chart installs its monitors and rules there as it would for a user.
MONITORING_CRDS = [
    _crd("ServiceMonitor", "servicemonitors"),
    _crd("PodMonitor", "podmonitors"),
    _crd("PrometheusRule", "prometheusrules"),
]
