"""The view's GPUs as Kubernetes objects: ``gpus.view.gpuslice.dev/v1alpha1``, kind ``GPU``.

The controller serves them as an aggregated API (``kubectl get gpus``; docs/view-api.md);
``kubectl gpuslice`` reads them back. One object per device our driver publishes, whole GPU or
MIG device, cluster-scoped, read-only:

- ``metadata.name``: ``<node>.<device>`` (``node-1.gpu-0``, ``node-1.gpu-2-mig-1g-10gb-0``). A
  DRA device name is a DNS label and has no dot, so the last dot splits the name back into node
  and device and no two devices share a name — a dash would not (``a-gpu`` + ``0`` and ``a`` +
  ``gpu-0``).
- ``metadata.labels`` (``LABELS``), for ``kubectl get gpus -l``: the node, the type, the model,
  the MIG profile, whether a cordon is on it, whether anything is allocated on it.
- ``spec``: what the driver publishes (node, device, UUID, model, totals, MIG parent).
- ``status``: what is derived (allocated cores and memory, allocations, taints, the summary
  status, the enforcer's live figures) — ``kubectl gpuslice top gpus -o json``'s row, less the
  seconds since the last scrape, which change on every read and would make every read a change.

``metadata.resourceVersion`` is given by whoever keeps the objects (the controller's store);
this module only builds their content.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from gpuslice_api.quantity import human_bytes

GROUP = "view.gpuslice.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
RESOURCE = "gpus"
SINGULAR = "gpu"
KIND = "GPU"
LIST_KIND = "GPUList"

PREFIX = "gpuslice.dev/"
NODE_LABEL = f"{PREFIX}node"
TYPE_LABEL = f"{PREFIX}type"
MODEL_LABEL = f"{PREFIX}model"
PROFILE_LABEL = f"{PREFIX}mig-profile"
CORDONED_LABEL = f"{PREFIX}cordoned"
ALLOCATED_LABEL = f"{PREFIX}allocated"
LABELS = (NODE_LABEL, TYPE_LABEL, MODEL_LABEL, PROFILE_LABEL, CORDONED_LABEL, ALLOCATED_LABEL)

Obj = dict[str, Any]
_NOT_IN_VALUE = re.compile(r"[^A-Za-z0-9._-]+")


def object_name(node: str, device: str) -> str:
    return f"{node}.{device}"


def uid(name: str) -> str:
    """A UID derived from the name: the same on every replica and after a restart, so a client
    that compares UIDs does not take one GPU seen through two replicas for two."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{RESOURCE}.{GROUP}/{name}"))


def label_value(text: str) -> str | None:
    """``text`` as a label value (other characters become ``-``, e.g. the model's spaces), or
    None when nothing usable is left or it is over 63 characters (the label is left out then:
    a truncated value would select the wrong GPUs)."""
    value = _NOT_IN_VALUE.sub("-", text).strip("-._")
    return value if value and len(value) <= 63 else None


def labels(row: Mapping[str, Any]) -> dict[str, str]:
    """The labels of the GPU a ``report.gpu_row`` describes."""
    found = {
        NODE_LABEL: label_value(row["node"]),
        TYPE_LABEL: row["type"],
        MODEL_LABEL: label_value(row["model"] or ""),
        PROFILE_LABEL: label_value(row.get("profile") or ""),
        CORDONED_LABEL: "true" if row["status"].startswith("Cordoned") else "false",
        ALLOCATED_LABEL: "true" if row["allocations"] else "false",
    }
    return {key: value for key, value in found.items() if value}


def gpu_object(row: Mapping[str, Any]) -> Obj:
    """The ``GPU`` object of a ``report.gpu_row`` (no resourceVersion yet)."""
    name = object_name(row["node"], row["device"])
    spec: Obj = {
        "node": row["node"],
        "device": row["device"],
        "ref": row["ref"],
        "type": row["type"],
        "uuid": row["uuid"],
        "model": row["model"],
        "cores": row["cores"]["total"],
        "memory": row["memory"]["total"],
    }
    if row["type"] == "mig":
        spec.update(parentUUID=row.get("parentUUID", ""), profile=row.get("profile", ""))
    live = {k: v for k, v in row["live"].items() if k != "ageSeconds"}
    status: Obj = {
        "status": row["status"],
        "allocatedCores": row["cores"]["used"],
        "allocatedMemory": row["memory"]["used"],
        "allocations": list(row["allocations"]),
        "taints": list(row["taints"]),
        "live": live,
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "uid": uid(name), "labels": labels(row)},
        "spec": spec,
        "status": status,
    }


def row_of(obj: Mapping[str, Any]) -> Obj:
    """The ``report.gpu_row`` a ``GPU`` object was built from (``kubectl gpuslice`` reads the
    objects and prints its own tables); the seconds since the last scrape are not carried."""
    spec, status = obj["spec"], obj["status"]
    row: Obj = {
        "node": spec["node"],
        "device": spec["device"],
        "ref": spec["ref"],
        "type": spec["type"],
        "uuid": spec["uuid"],
        "model": spec["model"],
        "cores": {"total": spec["cores"], "used": status["allocatedCores"]},
        "memory": {"total": spec["memory"], "used": status["allocatedMemory"]},
        "status": status["status"],
        "taints": list(status["taints"]),
        "allocations": list(status["allocations"]),
        "live": dict(status["live"]),
    }
    if spec["type"] == "mig":
        row.update(parentUUID=spec.get("parentUUID", ""), profile=spec.get("profile", ""))
    return row


# --- the table kubectl prints (server-side printing) -----------------------------------------

Columns = Sequence[tuple[str, str, int, str]]
"""A table's columns: (name, type, priority, description), as TableColumnDefinition has them."""

COLUMNS: Columns = (
    ("Name", "string", 0, "The GPU's name: <node>.<device>."),
    ("Node", "string", 0, "The node the device is on."),
    ("Model", "string", 0, "The GPU model, or MIG and the profile for a MIG device."),
    ("Cores%", "string", 0, "The share of the GPU's cores (SMs) allocated to claims."),
    ("Memory", "string", 0, "Memory allocated to claims, of the device's total."),
    ("SM-Used", "string", 0, "The SM utilisation the node's enforcer measures (- unknown)."),
    ("Mem-Used", "string", 0, "The memory the node's enforcer measures in use (- unknown)."),
    ("Claims", "integer", 0, "Allocation results on the device."),
    ("Status", "string", 0, "Ready, Cordoned, Cordoned(evict), or the blocking taints."),
    ("UUID", "string", 1, "The device's UUID (a MIG device's own)."),
    ("Pods", "string", 1, "The pods the claims on the device are reserved for."),
)


def column_definitions(columns: Columns = COLUMNS) -> list[Obj]:
    """meta.k8s.io/v1 TableColumnDefinitions of a kind's ``columns`` (the GPUs' by default);
    priority 1 columns only show with ``-o wide``."""
    return [
        {
            "name": name,
            "type": kind,
            "format": "name" if name == "Name" else "",
            "description": text,
            "priority": priority,
        }
        for name, kind, priority, text in columns
    ]


def _pct(part: int, whole: int) -> str:
    return f"{round(100 * part / whole)}%" if whole else "-"


def cells(obj: Mapping[str, Any]) -> list[Any]:
    """One table row's cells, in ``COLUMNS`` order."""
    spec, status = obj["spec"], obj["status"]
    live = status["live"]
    model = f"MIG {spec['profile']}" if spec["type"] == "mig" else spec["model"]
    memory = f"{human_bytes(status['allocatedMemory'])}/{human_bytes(spec['memory'])}"
    pods = sorted({p for a in status["allocations"] for p in a["pods"]})
    return [
        obj["metadata"]["name"],
        spec["node"],
        model,
        _pct(status["allocatedCores"], spec["cores"]),
        memory,
        "-" if live.get("smUsed") is None else f"{live['smUsed']:.0f}%",
        "-" if live.get("memoryUsed") is None else human_bytes(live["memoryUsed"]),
        len(status["allocations"]),
        status["status"],
        spec["uuid"] or "-",
        ",".join(pods) or "-",
    ]
