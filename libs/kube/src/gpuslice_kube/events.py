"""core/v1 Events about a Node, as node-side services report them.

Events about a cluster-scoped object go to the ``default`` namespace (as the kubelet's do);
``kubectl describe node`` shows them. Reporting never fails the caller: an Event that cannot be
created is logged.
"""

from __future__ import annotations

import datetime as dt

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj, RawApi, resource_path

log = get_logger(__name__)

EVENT_NAMESPACE = "default"
MAX_MESSAGE = 1024
"""The API server's limit on an Event's message."""


def node_event(
    raw: RawApi,
    node: str,
    uid: str,
    *,
    type_: str,
    reason: str,
    message: str,
    component: str,
    reporting_component: str | None = None,
) -> None:
    """Create an Event (``type_`` Normal or Warning) on Node ``node`` (``uid`` if known)."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    event: Obj = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{node}.", "namespace": EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid or node},
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": component, "host": node},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "reportingComponent": reporting_component or component,
        "reportingInstance": node,
    }
    try:
        raw.create(resource_path("v1", "events", namespace=EVENT_NAMESPACE), event)
    except GpusliceError as exc:
        log.error("cannot create an event", node=node, reason=reason, error=str(exc))
