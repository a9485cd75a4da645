"""A real Prometheus for tests: the scrape configuration Prometheus Operator would generate from
the chart's ServiceMonitors and PodMonitors, a ``prometheus`` process on loopback that discovers
targets in a Kubernetes API server, and the PromQL of the shipped dashboard and alert rules.

* ``scrape_configs(monitors, ...)``: pure; one scrape config per monitor endpoint, as the
  operator writes them (``pkg/prometheus/promcfg.go``): role ``endpoints`` (ServiceMonitor) or
  ``pod`` (PodMonitor) in the monitor's namespaces, the selector as ``keep`` relabellings on
  the discovered object's labels, the port kept by name, the operator's target labels
  (``namespace``, ``service``, ``pod``, ``container``, ``job``, ``endpoint``), then the
  endpoint's own ``relabelings``; ``honorLabels``, scheme, path, interval, TLS and bearer
  token file. File paths the operator would mount into its pod (a Secret's key, a token) are
  handed to ``files``/``paths`` to place on this machine.
* ``KubernetesDiscovery``: Debian's ``prometheus`` (2.42+ds) is built without
  ``kubernetes_sd_configs``, so the targets come through ``http_sd_configs`` from this
  loopback server, which lists Endpoints, Services and Pods and labels each target with the
  ``__meta_kubernetes_*`` labels Prometheus's own Kubernetes discovery gives (the subset the
  operator's relabellings and ours read). The relabelling itself is Prometheus's.
* ``prometheus_config(...)``: the whole ``prometheus.yml`` with ``rule_files``.
* ``Prometheus``: the process, ready once ``/-/ready`` says so, with ``query``, ``targets``,
  ``alerts``, ``rules`` and ``stop``.
* ``dashboard_queries``/``rule_queries``: every PromQL expression of a Grafana dashboard (its
  template variables replaced by values that match anything) and of a rule file.

docs/real-node.md, "A real Prometheus", says why the configuration is generated here rather
than by a running operator.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuslice_testkit.core import ServiceProcess, http_probe

Obj = dict[str, Any]
SecretFile = Callable[[str, str, str], Path]
"""(namespace, Secret name, key) -> a file on this machine holding that key's value."""

MONITOR_KINDS = {"ServiceMonitor": "endpoints", "PodMonitor": "pod"}
_LABEL = re.compile(r"[^a-zA-Z0-9_]")


class MonitorError(ValueError):
    """A monitor this generator cannot translate; the message names the monitor and field."""


def sanitize(name: str) -> str:
    """A Kubernetes label name as Prometheus's discovery spells it in meta labels."""
    return _LABEL.sub("_", name)


def _selector_relabels(selector: Obj, meta: str, where: str) -> list[Obj]:
    """``keep``/``drop`` rules equal to a label selector on ``__meta_kubernetes_<meta>_*``."""
    rules: list[Obj] = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        rules.append(
            {
                "action": "keep",
                "source_labels": [
                    f"__meta_kubernetes_{meta}_label_{sanitize(key)}",
                    f"__meta_kubernetes_{meta}_labelpresent_{sanitize(key)}",
                ],
                "regex": f"({value});true",
            }
        )
    for expr in selector.get("matchExpressions") or []:
        key, op = sanitize(str(expr.get("key", ""))), expr.get("operator")
        values = "|".join(expr.get("values") or [])
        label = f"__meta_kubernetes_{meta}_label_{key}"
        present = f"__meta_kubernetes_{meta}_labelpresent_{key}"
        if op == "In":
            rules.append(
                {"action": "keep", "source_labels": [label, present], "regex": f"({values});true"}
            )
        elif op == "NotIn":
            rules.append(
                {"action": "drop", "source_labels": [label, present], "regex": f"({values});true"}
            )
        elif op == "Exists":
            rules.append({"action": "keep", "source_labels": [present], "regex": "true"})
        elif op == "DoesNotExist":
            rules.append({"action": "drop", "source_labels": [present], "regex": "true"})
        else:
            raise MonitorError(
                f"{where}: spec.selector.matchExpressions operator {op!r}; allowed: In, NotIn, "
                "Exists, DoesNotExist"
            )
    return rules


ENDPOINT_FIELDS = (
    "port",
    "path",
    "scheme",
    "interval",
    "scrapeTimeout",
    "params",
    "honorLabels",
    "tlsConfig",
    "bearerTokenFile",
    "relabelings",
    "metricRelabelings",
)


def _relabel(rule: Obj, where: str) -> Obj:
    """A monitor's RelabelConfig (camelCase) as Prometheus's relabel_config (snake_case)."""
    names = {
        "sourceLabels": "source_labels",
        "targetLabel": "target_label",
        "separator": "separator",
        "regex": "regex",
        "replacement": "replacement",
        "modulus": "modulus",
        "action": "action",
    }
    out: Obj = {}
    for key, value in rule.items():
        if key not in names:
            raise MonitorError(f"{where}: relabeling field {key!r}; allowed: {', '.join(names)}")
        out[names[key]] = value.lower() if key == "action" else value
    return out


def _tls(tls: Obj, namespace: str, files: SecretFile | None, where: str) -> Obj:
    out: Obj = {}
    for field, name in (("ca", "ca_file"), ("cert", "cert_file")):
        source = tls.get(field)
        if not source:
            continue
        secret = source.get("secret")
        if not secret:
            raise MonitorError(
                f"{where}: tlsConfig.{field} needs a secret (configMap not supported)"
            )
        if files is None:
            raise MonitorError(
                f"{where}: tlsConfig.{field} names a Secret; pass files= to fetch it"
            )
        out[name] = str(files(namespace, secret["name"], secret["key"]))
    if tls.get("keySecret"):
        if files is None:
            raise MonitorError(f"{where}: tlsConfig.keySecret names a Secret; pass files=")
        key = tls["keySecret"]
        out["key_file"] = str(files(namespace, key["name"], key["key"]))
    for field, name in (
        ("caFile", "ca_file"),
        ("certFile", "cert_file"),
        ("keyFile", "key_file"),
        ("serverName", "server_name"),
        ("insecureSkipVerify", "insecure_skip_verify"),
    ):
        if field in tls:
            out[name] = tls[field]
    return out


def _namespaces(monitor: Obj) -> list[str] | None:
    """The namespaces to discover in; None = all (``namespaceSelector.any``)."""
    selector = monitor["spec"].get("namespaceSelector") or {}
    if selector.get("any"):
        return None
    return list(selector.get("matchNames") or [monitor["metadata"]["namespace"]])


def _endpoint_config(
    monitor: Obj,
    index: int,
    endpoint: Obj,
    *,
    discovery_url: str,
    files: SecretFile | None,
    paths: Mapping[str, Path],
) -> Obj:
    kind, meta = monitor["kind"], monitor["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    where = f"{kind} {namespace}/{name} endpoint {index}"
    unknown = sorted(set(endpoint) - set(ENDPOINT_FIELDS))
    if unknown:
        raise MonitorError(
            f"{where}: field {unknown[0]!r} is not translated; "
            f"allowed: {', '.join(ENDPOINT_FIELDS)}"
        )
    role = MONITOR_KINDS[kind]
    lowered = kind[0].lower() + kind[1:]
    namespaces = _namespaces(monitor)
    query = (
        ""
        if namespaces is None
        else "?" + urllib.parse.urlencode({"namespaces": ",".join(namespaces)})
    )
    sd: Obj = {"url": f"{discovery_url}/{role}{query}", "refresh_interval": "1s"}
    config: Obj = {
        "job_name": f"{lowered}/{namespace}/{name}/{index}",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "http_sd_configs": [sd],
        "metrics_path": endpoint.get("path", "/metrics"),
        "scheme": endpoint.get("scheme", "http"),
    }
    for field, key in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout")):
        if endpoint.get(field):
            config[key] = endpoint[field]
    if endpoint.get("params"):
        config["params"] = endpoint["params"]
    if endpoint.get("tlsConfig"):
        config["tls_config"] = _tls(endpoint["tlsConfig"], namespace, files, where)
    if endpoint.get("bearerTokenFile"):
        given = endpoint["bearerTokenFile"]
        config["authorization"] = {"credentials_file": str(paths.get(given, given))}
    for field in ("ca_file", "cert_file", "key_file"):
        tls_config = config.get("tls_config") or {}
        if tls_config.get(field) in paths:
            tls_config[field] = str(paths[tls_config[field]])

    selector = monitor["spec"].get("selector") or {}
    port = endpoint.get("port")
    relabels: list[Obj] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    if role == "endpoints":
        relabels += _selector_relabels(selector, "service", where)
        if port:
            relabels.append(
                {
                    "action": "keep",
                    "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                    "regex": port,
                }
            )
        for target_kind, label in (("Node", "node"), ("Pod", "pod")):
            relabels.append(
                {
                    "source_labels": [
                        "__meta_kubernetes_endpoint_address_target_kind",
                        "__meta_kubernetes_endpoint_address_target_name",
                    ],
                    "separator": ";",
                    "regex": f"{target_kind};(.*)",
                    "replacement": "${1}",
                    "target_label": label,
                }
            )
    else:
        relabels += _selector_relabels(selector, "pod", where)
        if port:
            relabels.append(
                {
                    "action": "keep",
                    "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                    "regex": port,
                }
            )
    relabels.append(
        {
            "action": "drop",
            "source_labels": ["__meta_kubernetes_pod_phase"],
            "regex": "(Failed|Succeeded)",
        }
    )
    relabels.append({"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"})
    if role == "endpoints":
        relabels.append(
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"}
        )
    relabels += [
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
    ]
    job_label = monitor["spec"].get("jobLabel")
    if job_label:
        source = f"__meta_kubernetes_{'service' if role == 'endpoints' else 'pod'}_label_"
        relabels.append(
            {
                "source_labels": [source + sanitize(job_label)],
                "regex": "(.+)",
                "replacement": "${1}",
                "target_label": "job",
            }
        )
    elif role == "endpoints":
        relabels.append(
            {
                "source_labels": ["__meta_kubernetes_service_name"],
                "replacement": "${1}",
                "target_label": "job",
            }
        )
    else:
        relabels.append({"target_label": "job", "replacement": f"{namespace}/{name}"})
    if port:
        relabels.append({"target_label": "endpoint", "replacement": port})
    relabels += [_relabel(r, where) for r in endpoint.get("relabelings") or []]
    config["relabel_configs"] = relabels
    if endpoint.get("metricRelabelings"):
        config["metric_relabel_configs"] = [
            _relabel(r, where) for r in endpoint["metricRelabelings"]
        ]
    return config


def scrape_configs(
    monitors: Iterable[Obj],
    *,
    discovery_url: str,
    files: SecretFile | None = None,
    paths: Mapping[str, Path] | None = None,
) -> list[Obj]:
    """One scrape config per endpoint of every ServiceMonitor and PodMonitor in ``monitors``
    (other objects are skipped, so a whole rendered chart may be given). ``discovery_url`` is
    a ``KubernetesDiscovery``'s; ``paths`` maps an in-cluster file a monitor names
    (``bearerTokenFile``) to one on this machine."""
    configs = []
    for obj in monitors:
        if obj.get("kind") not in MONITOR_KINDS:
            continue
        field = "endpoints" if obj["kind"] == "ServiceMonitor" else "podMetricsEndpoints"
        for index, endpoint in enumerate(obj["spec"].get(field) or []):
            configs.append(
                _endpoint_config(
                    obj,
                    index,
                    endpoint,
                    discovery_url=discovery_url,
                    files=files,
                    paths=paths or {},
                )
            )
    return configs


def prometheus_config(
    scrape: Sequence[Obj], *, rule_files: Sequence[Path] = (), evaluation_interval: str = "1s"
) -> Obj:
    """A whole prometheus.yml."""
    return {
        "global": {"evaluation_interval": evaluation_interval, "scrape_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": list(scrape),
    }


# -- the PromQL of the shipped dashboard and rules ----------------------------------------------


def _variable_value(variable: Obj) -> str:
    """What a template variable becomes in a query: its "All" value where it has one (".*" for
    ours), else a regex that matches anything."""
    if variable.get("type") == "datasource":
        return ""
    return str(variable.get("allValue") or ".*")


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``$var``, ``${var}`` and ``[[var]]`` replaced; Grafana's own ``$__interval``,
    ``$__rate_interval`` and ``$__range`` become durations Prometheus takes."""
    builtins = {"__interval": "1m", "__rate_interval": "5m", "__range": "1h"}
    every = {**builtins, **values}

    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in every:
            raise KeyError(f"the query uses ${name}, which the dashboard does not define: {expr}")
        return every[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", repl, expr)


def _panels(panels: Iterable[Obj]) -> Iterator[Obj]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def dashboard_queries(dashboard: Obj) -> dict[str, str]:
    """Every PromQL of a Grafana dashboard, ready to run: panel targets (keyed ``panel title
    [refId]``) and query variables (``$name``), the variables substituted."""
    variables = (dashboard.get("templating") or {}).get("list") or []
    values = {str(v["name"]): _variable_value(v) for v in variables}
    found: dict[str, str] = {}
    for v in variables:
        if v.get("type") != "query":
            continue
        query = v.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        match = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", str(text or ""))
        if match:  # label_values(expr, label) is Grafana's; the series expression is PromQL
            found[f"${v['name']}"] = substitute(match.group(1), values)
        elif text:
            found[f"${v['name']}"] = substitute(str(text), values)
    for panel in _panels(dashboard.get("panels") or []):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                key = f"{panel.get('title', '')} [{target.get('refId', '')}]"
                found[key] = substitute(str(target["expr"]), values)
    return found


def rule_queries(rules: Obj) -> dict[str, str]:
    """Every expression of a Prometheus rule file, keyed by alert or record name."""
    return {
        str(rule.get("alert") or rule.get("record")): str(rule["expr"])
        for group in rules.get("groups") or []
        for rule in group.get("rules") or []
    }


# -- the process --------------------------------------------------------------------------------


def prometheus_binary() -> str | None:
    """``prometheus`` on PATH (Debian's package), or None."""
    return shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusError(RuntimeError):
    """An API call failed; the message carries Prometheus's errorType and error."""


@dataclass
class Prometheus:
    """``prometheus`` on a free loopback port with its own storage in ``workdir``.

    ``with Prometheus(workdir, config) as prom: prom.query("up")``."""

    workdir: Path
    config: Obj
    binary: str = "prometheus"
    process: ServiceProcess | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.port = _free_port()
        self.process = ServiceProcess(
            "prometheus",
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            log=self.workdir / "prometheus.log",
            ready=self._ready,
        ).start(timeout)
        return self

    def _ready(self) -> bool:
        try:
            return http_probe(self.port, "/-/ready") == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data``; PrometheusError with its error otherwise."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - http://127.0.0.1
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[Obj]:
        """An instant query's result: ``[{"metric": {...}, "value": [ts, "v"]}, ...]``."""
        data = self.api("query", query=expr)
        result = data["result"]
        return list(result) if data["resultType"] in ("vector", "matrix") else [{"value": result}]

    def targets(self) -> list[Obj]:
        """The active targets (``labels``, ``discoveredLabels``, ``scrapePool``, ``health``)."""
        return list(self.api("targets", state="active")["activeTargets"])

    def rules(self) -> list[Obj]:
        """The loaded rule groups, each with its ``rules``."""
        return list(self.api("rules")["groups"])

    def alerts(self) -> list[Obj]:
        """The pending and firing alerts."""
        return list(self.api("alerts")["alerts"])
