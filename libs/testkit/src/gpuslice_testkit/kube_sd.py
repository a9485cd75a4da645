"""Kubernetes service discovery for a Prometheus that lacks it, over ``http_sd_configs``.

Debian's ``prometheus`` package (2.42+ds) is built without ``kubernetes_sd_configs``. This
loopback server answers Prometheus's HTTP discovery (``GET /<role>?namespaces=a,b``, role
``endpoints`` or ``pod``) by listing the API server's objects on each request, and gives every
target the ``__meta_kubernetes_*`` labels Prometheus's own Kubernetes discovery gives
(``discovery/kubernetes/{pod,endpoints}.go``), so the relabellings Prometheus Operator writes
select and label the same targets. Left out, because neither the operator's relabellings nor
the chart's read them: annotations, ``__meta_kubernetes_*_controller_*``, ``…_container_image``
and the extra targets the endpoints role adds for container ports that no Endpoints port
names.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Obj = dict[str, Any]
ListObjects = Callable[[str], list[Obj]]
"""An API path (``/api/v1/namespaces/<ns>/pods``) -> the items listed there."""

ROLES = ("endpoints", "pod")


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def _object_labels(prefix: str, meta: Obj) -> dict[str, str]:
    out = {f"{prefix}_name": str(meta.get("name", ""))}
    for key, value in (meta.get("labels") or {}).items():
        out[f"{prefix}_label_{_sanitize(key)}"] = str(value)
        out[f"{prefix}_labelpresent_{_sanitize(key)}"] = "true"
    return out


def _ready(pod: Obj) -> str:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return "true" if cond.get("status") == "True" else "false"
    return "false"


def pod_labels(pod: Obj) -> dict[str, str]:
    """The pod-wide meta labels (no container)."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    p = "__meta_kubernetes_pod"
    return {
        "__meta_kubernetes_namespace": str(meta.get("namespace", "")),
        **_object_labels(p, meta),
        f"{p}_ip": str(status.get("podIP", "")),
        f"{p}_ready": _ready(pod),
        f"{p}_phase": str(status.get("phase", "")),
        f"{p}_node_name": str(spec.get("nodeName", "")),
        f"{p}_host_ip": str(status.get("hostIP", "")),
        f"{p}_uid": str(meta.get("uid", "")),
    }


def _container_labels(container: Obj, port: Obj | None, init: bool) -> dict[str, str]:
    p = "__meta_kubernetes_pod_container"
    out = {f"{p}_name": str(container.get("name", "")), f"{p}_init": str(init).lower()}
    if port is not None:
        out[f"{p}_port_name"] = str(port.get("name", ""))
        out[f"{p}_port_number"] = str(port.get("containerPort", ""))
        out[f"{p}_port_protocol"] = str(port.get("protocol", "TCP"))
    return out


def pod_targets(pod: Obj) -> list[Obj]:
    """Role ``pod``: one target per container port, one per container without ports; none for
    a pod without an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return []
    base = pod_labels(pod)
    spec = pod.get("spec") or {}
    groups = []
    for init, containers in ((False, spec.get("containers")), (True, spec.get("initContainers"))):
        for container in containers or []:
            ports = container.get("ports") or []
            if not ports and not init:
                groups.append(
                    {
                        "targets": [ip],
                        "labels": {**base, **_container_labels(container, None, init)},
                    }
                )
            for port in ports:
                groups.append(
                    {
                        "targets": [f"{ip}:{port['containerPort']}"],
                        "labels": {**base, **_container_labels(container, port, init)},
                    }
                )
    return groups


def endpoints_targets(endpoints: Obj, services: dict[str, Obj], pods: dict[str, Obj]) -> list[Obj]:
    """Role ``endpoints``: one target per address and port of every subset, with the Service's
    labels and, where the address is a pod's, the pod's and its matching container's."""
    meta = endpoints["metadata"]
    base = {
        "__meta_kubernetes_namespace": str(meta.get("namespace", "")),
        **_object_labels("__meta_kubernetes_endpoints", meta),
    }
    service = services.get(meta.get("name", ""))
    if service is not None:
        base.update(_object_labels("__meta_kubernetes_service", service["metadata"]))
    groups = []
    for subset in endpoints.get("subsets") or []:
        addresses = [(a, "true") for a in subset.get("addresses") or []] + [
            (a, "false") for a in subset.get("notReadyAddresses") or []
        ]
        for address, ready in addresses:
            ref = address.get("targetRef") or {}
            labels = {
                **base,
                "__meta_kubernetes_endpoint_hostname": str(address.get("hostname", "")),
                "__meta_kubernetes_endpoint_node_name": str(address.get("nodeName", "")),
                "__meta_kubernetes_endpoint_ready": ready,
                "__meta_kubernetes_endpoint_address_target_kind": str(ref.get("kind", "")),
                "__meta_kubernetes_endpoint_address_target_name": str(ref.get("name", "")),
            }
            pod = pods.get(ref.get("name", "")) if ref.get("kind") == "Pod" else None
            if pod is not None:
                labels.update(pod_labels(pod))
            for port in subset.get("ports") or []:
                target = {
                    **labels,
                    "__meta_kubernetes_endpoint_port_name": str(port.get("name", "")),
                    "__meta_kubernetes_endpoint_port_protocol": str(port.get("protocol", "TCP")),
                }
                for container in ((pod or {}).get("spec") or {}).get("containers") or []:
                    for cport in container.get("ports") or []:
                        if cport.get("containerPort") == port.get("port"):
                            target.update(_container_labels(container, cport, False))
                groups.append({"targets": [f"{address['ip']}:{port['port']}"], "labels": target})
    return groups


class KubernetesDiscovery:
    """The discovery server on a free loopback port; ``url`` goes into ``scrape_configs``.
    ``list_objects`` lists an API path (e.g. ``lambda p: raw.list(p)["items"]``) on every
    request, so what Prometheus sees is never older than its ``refresh_interval``."""

    def __init__(self, list_objects: ListObjects) -> None:
        self.list_objects = list_objects
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                role = url.path.strip("/")
                if role not in ROLES:
                    self.send_error(404, f"role {role!r}; allowed: {', '.join(ROLES)}")
                    return
                names = urllib.parse.parse_qs(url.query).get("namespaces", [""])[0]
                body = json.dumps(owner.targets(role, [n for n in names.split(",") if n]))
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> KubernetesDiscovery:
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def __enter__(self) -> KubernetesDiscovery:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _in(self, namespaces: Iterable[str], plural: str) -> list[Obj]:
        names = list(namespaces) or [""]
        found = []
        for ns in names:
            path = f"/api/v1/namespaces/{ns}/{plural}" if ns else f"/api/v1/{plural}"
            found += self.list_objects(path)
        return found

    def targets(self, role: str, namespaces: list[str]) -> list[Obj]:
        """What Prometheus gets for ``role`` in ``namespaces`` (empty: all)."""
        pods = self._in(namespaces, "pods")
        if role == "pod":
            return [group for pod in pods for group in pod_targets(pod)]
        by_ns: dict[tuple[str, str], Obj] = {
            (p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods
        }
        services = {
            (s["metadata"]["namespace"], s["metadata"]["name"]): s
            for s in self._in(namespaces, "services")
        }
        groups = []
        for endpoints in self._in(namespaces, "endpoints"):
            ns = endpoints["metadata"]["namespace"]
            groups += endpoints_targets(
                endpoints,
                {name: s for (n, name), s in services.items() if n == ns},
                {name: p for (n, name), p in by_ns.items() if n == ns},
            )
        return groups
