"""What the commands show, as data (for ``-o json|yaml``) and as tables or text.

Every function here reads a ``ClusterView`` and returns plain dicts and strings; nothing is
kept. The rows carry exact numbers (bytes, percent); the tables round for reading.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gpuslice_api.quantity import human_bytes
from gpuslice_view.live import ShareLive
from gpuslice_view.model import ClusterView, Live, Usage
from gpuslice_view.objects import CORDON_KEY, Claim, Device, Request, Taint
from gpuslice_view.reasons import why_pod

Row = dict[str, Any]


def status(view: ClusterView, device: Device) -> str:
    """``Ready``, ``Cordoned``, ``Cordoned(evict)``, or the blocking taints' keys."""
    parts = []
    for taint in view.taints(device):
        if taint.key == CORDON_KEY and taint.rule:
            parts.append("Cordoned(evict)" if taint.effect == "NoExecute" else "Cordoned")
        elif taint.effect in ("NoSchedule", "NoExecute"):
            parts.append(f"Tainted({taint.key.rsplit('/', 1)[-1]})")
    return ",".join(dict.fromkeys(parts)) or "Ready"


def _taint(taint: Taint) -> Row:
    out: Row = {"key": taint.key, "value": taint.value, "effect": taint.effect}
    if taint.rule:
        out["deviceTaintRule"] = taint.rule
    return out


def _pct(part: int, whole: int) -> int:
    return round(100 * part / whole) if whole else 0


def _live(live: Live) -> Row:
    """The device's live usage as ``-o json`` shows it: None where it is not known."""
    out: Row = {"state": live.state, "memoryUsed": live.memory_used, "smUsed": live.sm_used}
    if live.age is not None:
        out["ageSeconds"] = round(live.age, 1)
    if live.error:
        out["error"] = live.error
    return out


def _used(live: Live, share: ShareLive | None) -> Row:
    """An allocation's use (None unless the enforcer reports its share)."""
    if live.state != "ok" or share is None:
        return {"memoryUsed": None, "smUsed": None}
    return {"memoryUsed": share.memory_used, "smUsed": share.sm_used}


def gpu_row(view: ClusterView, usage: Usage, now: float | None = None) -> Row:
    d = usage.device
    claims = view.claims
    live = view.live_of(d, time.time() if now is None else now)
    shares = []
    for s in usage.shares:
        claim = claims.get(s.claim)
        shares.append(
            {
                "claim": "/".join(s.claim),
                "request": s.request,
                "cores": d.cores if s.cores is None else s.cores,
                "memory": d.memory if s.memory is None else s.memory,
                "whole": s.cores is None and s.memory is None,
                "pods": list(claim.reserved_for) if claim else [],
                **_used(live, live.shares.get(s.claim)),
            }
        )
    row: Row = {
        "node": d.node,
        "device": d.name,
        "ref": d.ref,
        "type": d.kind,
        "uuid": d.uuid,
        "model": d.model,
        "cores": {"total": d.cores, "used": usage.cores},
        "memory": {"total": d.memory, "used": usage.memory},
        "status": status(view, d),
        "taints": [_taint(t) for t in view.taints(d)],
        "allocations": shares,
        "live": _live(live),
    }
    if d.kind == "mig":
        row.update(parentUUID=d.parent_uuid, profile=d.profile)
    return row


def gpu_rows(view: ClusterView) -> list[Row]:
    now = time.time()
    return [gpu_row(view, u, now) for u in view.usage().values()]


def _bytes(value: int | None) -> str:
    return "-" if value is None else human_bytes(value)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def gpu_table(rows: Sequence[Row], *, wide: bool = False) -> str:
    head = ["NODE", "DEVICE", "MODEL", "CORES%", "MEMORY", "MEMORY%", "SM-USED", "MEM-USED"]
    head += ["CLAIMS", "STATUS"]
    if wide:
        head += ["UUID", "PODS"]
    body = []
    for r in rows:
        cores, memory = r["cores"], r["memory"]
        model = f"MIG {r['profile']}" if r["type"] == "mig" else r["model"]
        line = [
            r["node"],
            r["device"],
            model,
            f"{_pct(cores['used'], cores['total'])}%" if cores["total"] else "-",
            f"{human_bytes(memory['used'])}/{human_bytes(memory['total'])}",
            f"{_pct(memory['used'], memory['total'])}%",
            _percent(r["live"]["smUsed"]),
            _bytes(r["live"]["memoryUsed"]),
            str(len(r["allocations"])),
            r["status"],
        ]
        if wide:
            pods = sorted({p for a in r["allocations"] for p in a["pods"]})
            line += [r["uuid"] or "-", ",".join(pods) or "-"]
        body.append(line)
    return table(head, body)


def describe_gpu(row: Row) -> str:
    cores, memory = row["cores"], row["memory"]
    lines = [
        f"Device:     {row['ref']}  ({row['device']} on node {row['node']})",
        f"Type:       {row['type']}",
        f"UUID:       {row['uuid'] or '-'}",
        f"Model:      {row['model']}",
    ]
    if row["type"] == "mig":
        lines += [f"Profile:    {row['profile']}", f"Parent:     {row['parentUUID']}"]
    if cores["total"]:
        lines.append(f"Cores:      {cores['used']}% of 100% allocated")
    lines += [
        f"Memory:     {human_bytes(memory['used'])} of {human_bytes(memory['total'])} allocated "
        f"({_pct(memory['used'], memory['total'])}%)",
        f"Used:       {_live_line(row['live'])}",
        f"Status:     {row['status']}",
        "Taints:" + ("     <none>" if not row["taints"] else ""),
    ]
    for t in row["taints"]:
        value = f"={t['value']}" if t["value"] else ""
        by = f"  (DeviceTaintRule {t['deviceTaintRule']})" if "deviceTaintRule" in t else ""
        lines.append(f"  {t['key']}{value}:{t['effect']}{by}")
    lines.append("Allocations:" + (" <none>" if not row["allocations"] else ""))
    if row["allocations"]:
        body = [
            [
                a["claim"],
                a["request"],
                f"{a['cores']}%" if cores["total"] else "-",
                human_bytes(a["memory"]),
                _percent(a["smUsed"]),
                _bytes(a["memoryUsed"]),
                ",".join(a["pods"]) or "-",
            ]
            for a in row["allocations"]
        ]
        head = ["CLAIM", "REQUEST", "CORES", "MEMORY", "SM-USED", "MEM-USED", "PODS"]
        tab = table(head, body)
        lines += ["  " + line for line in tab.splitlines()]
    return "\n".join(lines)


def _live_line(live: Row) -> str:
    """``12Gi memory, 25% SM (enforcer, 3s ago)``, or ``-`` and why it is not known."""
    age = f", {live['ageSeconds']:.0f}s ago" if "ageSeconds" in live else ""
    if live["state"] == "ok":
        return f"{_bytes(live['memoryUsed'])} memory, {_percent(live['smUsed'])} SM (enforcer{age})"
    why = {
        "unknown": "no enforcer metrics from this node",
        "stale": f"the enforcer's last figures are too old{age}",
        "unreachable": f"the enforcer did not answer: {live.get('error', '')}",
    }[live["state"]]
    return f"-  ({why})"


def claim_row(view: ClusterView, claim: Claim, now: float | None = None) -> Row:
    devices = []
    now = time.time() if now is None else now
    for s in claim.shares:
        device = view.device_of(s.device)
        live = view.live_of(device, now) if device else Live("unknown")
        devices.append(
            {
                "request": s.request,
                "device": device.ref if device else "/".join(s.device[1:]),
                "node": device.node if device else "",
                "uuid": device.uuid if device else "",
                "cores": (device.cores if device else 0) if s.cores is None else s.cores,
                "memory": (device.memory if device else 0) if s.memory is None else s.memory,
                **_used(live, live.shares.get(claim.key)),
            }
        )
    state = "Deleting" if claim.deleting else "Allocated" if claim.allocated else "Pending"
    return {
        "namespace": claim.namespace,
        "name": claim.name,
        "labels": dict(claim.labels),
        "state": state,
        "requests": [_request(r) for r in claim.requests],
        "devices": devices,
        "pods": list(claim.reserved_for),
    }


def _request(request: Request) -> Row:
    """A claim's request as ``-o json`` shows it (``firstAvailable``: its alternatives)."""
    if request.alternatives:
        return {"name": request.name, "firstAvailable": [_request(a) for a in request.alternatives]}
    return {
        "name": request.name,
        "deviceClassName": request.device_class,
        "allocationMode": "All" if request.all_devices else "ExactCount",
        "count": request.count,
        "cores": request.cores,
        "memory": request.memory,
        "selectors": list(request.selectors),
    }


def claim_rows(view: ClusterView, namespace: str | None) -> list[Row]:
    claims = sorted(view.claims.values(), key=lambda c: c.key)
    now = time.time()
    return [
        claim_row(view, c, now)
        for c in claims
        if (namespace is None or c.namespace == namespace) and view.ours(c)
    ]


def why_row(view: ClusterView, namespace: str, name: str) -> Row | None:
    """``why pod/<name>``'s answer: the pod, its node, the scheduler's message and its claims'
    reasons; None for a pod the view does not keep (none with GPU claims by that name)."""
    pod = view.pods.get((namespace, name))
    if pod is None:
        return None
    reasons = [r.to_dict() for r in why_pod(view, pod)]
    return {
        "pod": f"{namespace}/{name}",
        "node": pod.node,
        "scheduler": pod.scheduling,
        "reasons": reasons,
    }


def claim_table(rows: Sequence[Row], *, all_namespaces: bool) -> str:
    head = ["NAME", "STATE", "DEVICES", "CORES", "MEMORY", "SM-USED", "MEM-USED", "PODS"]
    if all_namespaces:
        head.insert(0, "NAMESPACE")
    body = []
    for r in rows:
        devices = r["devices"]
        line = [
            r["name"],
            r["state"],
            ",".join(d["device"] for d in devices) or "-",
            ",".join(f"{d['cores']}%" if d["cores"] else "-" for d in devices) or "-",
            ",".join(human_bytes(d["memory"]) for d in devices) or "-",
            ",".join(_percent(d["smUsed"]) for d in devices) or "-",
            ",".join(_bytes(d["memoryUsed"]) for d in devices) or "-",
            ",".join(r["pods"]) or "-",
        ]
        if all_namespaces:
            line.insert(0, r["namespace"])
        body.append(line)
    return table(head, body)


def table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Columns padded like kubectl's (three spaces between), no trailing blanks."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=False)]
    lines = [
        "   ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [head, *body]
    ]
    return "\n".join(lines)
