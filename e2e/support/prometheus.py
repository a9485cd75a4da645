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
