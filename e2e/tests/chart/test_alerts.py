"""The chart's alert rules (charts/gpuslice/files/alerts.yaml, docs/alerts.md): judged by
Prometheus's own promtool (`check rules`, and `test rules` with the series of alerts-test.yaml
beside this module), every alert tested there and carrying what an operator needs, and the
PrometheusRule the chart renders holding the same rules.

promtool comes with Debian's ``prometheus`` package (hack/node-packages.sh installs it); without
it the promtool tests skip, saying so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.support.chart import CHART, helm, one, render, sets
from e2e.support.prometheus import RULES, rules_of

pytestmark = pytest.mark.timeout(60)
HERE = Path(__file__).resolve().parent
UNIT_TESTS = HERE / "alerts-test.yaml"
TROUBLESHOOTING = CHART.parents[1] / "docs" / "troubleshooting.md"
SEVERITIES = {"critical", "warning", "info"}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian's prometheus package: hack/node-packages.sh)",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    found = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return found


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules_of(RULES))} rules found" in out.stdout


@needs_promtool
def test_each_alert_fires_on_trouble_and_names_what_is_affected() -> None:
    out = promtool("test", "rules", str(UNIT_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_is_unit_tested_firing() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    firing = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert {rule["alert"] for rule in rules_of(RULES)} == firing


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section() -> None:
    sections = anchors(TROUBLESHOOTING.read_text())
    for rule in rules_of(RULES):
        name = rule["alert"]
        assert name.startswith("Gpuslice"), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/troubleshooting.md" and anchor in sections, (name, anchor)
        # The same page names the alert, so a reader who follows the link finds it.
        assert name in TROUBLESHOOTING.read_text(), name


def test_the_prometheus_rule_wraps_the_same_rules(helm_bin: Path) -> None:
    assert not [o for o in render(helm_bin) if o["kind"] == "PrometheusRule"]  # off by default
    base = "https://docs.example.org/gpuslice/v0.1.0/"
    objs = render(
        helm_bin,
        *sets(
            "metrics.prometheusRule.enabled=true",
            f"metrics.prometheusRule.runbookBaseURL={base}",
            "metrics.prometheusRule.labels.release=kube-prometheus",
        ),
    )
    rule = one(objs, "PrometheusRule", "gpuslice")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    expected: dict[str, Any] = yaml.safe_load(RULES.read_text())
    for group in expected["groups"]:
        for r in group["rules"]:
            r["annotations"]["runbook_url"] = base + r["annotations"]["runbook_url"]
    assert rule["spec"] == expected
    plain = one(render(helm_bin, *sets("metrics.prometheusRule.enabled=true")), "PrometheusRule")
    assert plain["spec"] == yaml.safe_load(RULES.read_text())


def test_a_runbook_base_that_is_no_prefix_is_refused(helm_bin: Path) -> None:
    out = helm(
        helm_bin,
        "template",
        "gpuslice",
        str(CHART),
        *sets("metrics.prometheusRule.runbookBaseURL=https://docs.example.org"),
        check=False,
    )
    assert out.returncode != 0
    assert "/metrics/prometheusRule/runbookBaseURL" in out.stderr
