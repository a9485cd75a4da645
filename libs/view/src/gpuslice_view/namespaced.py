"""The view's namespaced resources in ``view.gpuslice.dev/v1alpha1``: ``gpuclaims`` and
``gpureasons``.

``GPUClaim`` (``gpuclaims``, list/get/watch): one per ResourceClaim on our devices or asking one
of our DeviceClasses, named as the claim, in its namespace. ``kubectl gpuslice claims -o json``'s
row as an object: ``metadata.labels`` are the claim's own (``kubectl get gpuclaims -l``),
``spec.requests`` what it asks, ``status`` its state, the devices allocated to it (node, cores,
memory, the enforcer's used figures where current) and the pods it is reserved for.

``GPUReason`` (``gpureasons``, get only): why a pod has no GPU, or where it has one — ``kubectl
gpuslice why pod/<name>``'s answer, named as the pod, in its namespace. Get only: the reasons
are derived for one pod when asked, and a list of every pod's would cost a diagnosis per pod
with GPU claims for what no one reads whole (docs/decisions.md, 14).

Both are namespaced, so RBAC grants them per namespace (a RoleBinding to ``view``), which the
cluster-scoped ``gpus`` cannot be. As in ``resource``, the UIDs are derived from the names and
``metadata.resourceVersion`` is given by whoever keeps the objects.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from gpuslice_api.quantity import human_bytes
from gpuslice_view import report
from gpuslice_view.model import ClusterView
from gpuslice_view.resource import API_VERSION, GROUP, Columns, Obj

CLAIMS = "gpuclaims"
CLAIM_SINGULAR = "gpuclaim"
CLAIM_KIND = "GPUClaim"
CLAIM_LIST_KIND = "GPUClaimList"
REASONS = "gpureasons"
REASON_SINGULAR = "gpureason"
REASON_KIND = "GPUReason"


def uid(resource: str, namespace: str, name: str) -> str:
    """A UID derived from the resource and the name (the same on every replica; not the
    ResourceClaim's or the pod's own UID, which name other objects)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{resource}.{GROUP}/{namespace}/{name}"))


def _meta(resource: str, namespace: str, name: str, labels: Mapping[str, str]) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace, "uid": uid(resource, namespace, name)}
    if labels:
        meta["labels"] = dict(labels)
    return meta


def claim_object(row: Mapping[str, Any]) -> Obj:
    """The ``GPUClaim`` of a ``report.claim_row`` (no resourceVersion yet). A row from an older
    controller, without labels, requests or nodes, gives an object without them."""
    return {
        "apiVersion": API_VERSION,
        "kind": CLAIM_KIND,
        "metadata": _meta(CLAIMS, row["namespace"], row["name"], row.get("labels") or {}),
        "spec": {"requests": list(row.get("requests") or [])},
        "status": {
            "state": row["state"],
            "devices": list(row["devices"]),
            "pods": list(row["pods"]),
        },
    }


def claim_row_of(obj: Mapping[str, Any]) -> Obj:
    """The ``report.claim_row`` a ``GPUClaim`` was built from (``kubectl gpuslice claims``
    prints its own table from it)."""
    meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj["status"]
    return {
        "namespace": meta["namespace"],
        "name": meta["name"],
        "labels": dict(meta.get("labels") or {}),
        "state": status["state"],
        "requests": list(spec.get("requests") or []),
        "devices": list(status.get("devices") or []),
        "pods": list(status.get("pods") or []),
    }


def claim_objects(view: ClusterView) -> list[Obj]:
    """Every ``GPUClaim`` of the view (a store's ``derive``)."""
    now = time.time()
    claims = sorted(view.claims.values(), key=lambda c: c.key)
    return [claim_object(report.claim_row(view, c, now)) for c in claims if view.ours(c)]


def reason_object(namespace: str, name: str, answer: Mapping[str, Any]) -> Obj:
    """The ``GPUReason`` of ``why pod/<name>``'s answer (``pod``, ``node``, ``scheduler``,
    ``reasons``: what ``/view/why/<namespace>/<pod>`` returns)."""
    return {
        "apiVersion": API_VERSION,
        "kind": REASON_KIND,
        "metadata": _meta(REASONS, namespace, name, {}),
        "status": {
            "node": answer.get("node") or "",
            "scheduler": answer.get("scheduler") or "",
            "reasons": list(answer.get("reasons") or []),
        },
    }


def why_of(obj: Mapping[str, Any]) -> Obj:
    """``why pod/<name>``'s answer from a ``GPUReason``."""
    meta, status = obj["metadata"], obj["status"]
    return {
        "pod": f"{meta['namespace']}/{meta['name']}",
        "node": status.get("node") or "",
        "scheduler": status.get("scheduler") or "",
        "reasons": list(status.get("reasons") or []),
    }


# --- the tables kubectl prints (server-side printing) ----------------------------------------

CLAIM_COLUMNS: Columns = (
    ("Name", "string", 0, "The claim's name (the ResourceClaim's)."),
    ("State", "string", 0, "Allocated, Pending or Deleting."),
    ("Devices", "string", 0, "The devices allocated to it: <node>/<index> or <node>/<device>."),
    ("Cores", "string", 0, "The share of each device's cores (SMs) it holds."),
    ("Memory", "string", 0, "The memory it holds on each device."),
    ("SM-Used", "string", 0, "The SM utilisation the enforcer measures for it (- unknown)."),
    ("Mem-Used", "string", 0, "The memory the enforcer measures in use by it (- unknown)."),
    ("Pods", "string", 0, "The pods it is reserved for."),
    ("Nodes", "string", 1, "The nodes of its devices."),
    ("Classes", "string", 1, "The DeviceClasses its requests ask for."),
)

REASON_COLUMNS: Columns = (
    ("Name", "string", 0, "The pod's name."),
    ("Node", "string", 0, "The node it is bound to (- not scheduled)."),
    ("Reasons", "string", 0, "The codes of its claims' reasons."),
    ("Message", "string", 0, "The first reason, in words."),
    ("Scheduler", "string", 1, "The scheduler's PodScheduled=False message, if any."),
)


def _joined(values: Sequence[str]) -> str:
    return ",".join(values) or "-"


def _classes(requests: Sequence[Mapping[str, Any]]) -> list[str]:
    found: list[str] = []
    for r in requests:
        for one in r.get("firstAvailable") or [r]:
            if one.get("deviceClassName"):
                found.append(one["deviceClassName"])
    return list(dict.fromkeys(found))


def claim_cells(obj: Mapping[str, Any]) -> list[Any]:
    """One ``gpuclaims`` table row's cells, in ``CLAIM_COLUMNS`` order."""
    status = obj["status"]
    devices = status["devices"]
    return [
        obj["metadata"]["name"],
        status["state"],
        _joined([d["device"] for d in devices]),
        _joined([f"{d['cores']}%" if d["cores"] else "-" for d in devices]),
        _joined([human_bytes(d["memory"]) for d in devices]),
        _joined(["-" if d["smUsed"] is None else f"{d['smUsed']:.0f}%" for d in devices]),
        _joined(
            ["-" if d["memoryUsed"] is None else human_bytes(d["memoryUsed"]) for d in devices]
        ),
        _joined(status["pods"]),
        _joined(list(dict.fromkeys(d.get("node") or "-" for d in devices))),
        _joined(_classes((obj.get("spec") or {}).get("requests") or [])),
    ]


def reason_cells(obj: Mapping[str, Any]) -> list[Any]:
    """One ``gpureasons`` table row's cells, in ``REASON_COLUMNS`` order."""
    status = obj["status"]
    reasons = status["reasons"]
    first = reasons[0] if reasons else None
    message = first["message"] if first else "-"
    if first and first.get("claim"):
        message = f"claim {first['claim']}: {message}"
    return [
        obj["metadata"]["name"],
        status["node"] or "-",
        _joined(list(dict.fromkeys(r["code"] for r in reasons))),
        message,
        status["scheduler"] or "-",
    ]
