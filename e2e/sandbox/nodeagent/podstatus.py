"""Pod status as the kubelet writes it: phase, the four kubelet-owned conditions, container
statuses (docs/node-agent.md, "What it simulates": Pod status). Pure functions; the worker
decides what to send.

The status is sent as a strategic-merge patch: ``conditions`` merge by ``type``, so conditions
the kubelet does not own (PodScheduled, DisruptionTarget, readiness gates) are kept;
``containerStatuses`` is an atomic list and is sent whole. ``startTime`` is set once;
``lastTransitionTime`` only moves when a condition's status flips; ``qosClass`` is left to the
API server, which sets it at creation.
"""

from __future__ import annotations

from dataclasses import dataclass

from e2e.sandbox.nodeagent.kubeapi import now_rfc3339
from e2e.sandbox.nodeagent.runtime import ExitStatus
from gpuslice_kube.raw import Obj

OWNED = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
HOST_IP = "127.0.0.1"


@dataclass
class ContainerView:
    """What the worker knows about one container right now."""

    name: str
    image: str
    init: bool = False
    sidecar: bool = False
    running_since: str = ""  # set while the process runs
    container_id: str = ""
    exited: ExitStatus | None = None  # the current instance ended (and is not restarted yet)
    restarting: bool = False  # exited, a restart is scheduled (CrashLoopBackOff)
    last_terminated: ExitStatus | None = None
    last_container_id: str = ""
    restart_count: int = 0
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""

    @property
    def running(self) -> bool:
        return bool(self.running_since) and self.exited is None

    @property
    def ever_ran(self) -> bool:
        return self.exited is not None or self.last_terminated is not None

    def succeeded(self) -> bool:
        return self.exited is not None and self.exited.exit_code == 0


def _terminated(status: ExitStatus, container_id: str) -> Obj:
    out: Obj = {
        "exitCode": status.exit_code,
        "reason": status.reason,
        "startedAt": status.started_at or None,
        "finishedAt": status.finished_at,
        "containerID": container_id,
    }
    if status.signal:
        out["signal"] = status.signal
    if status.message:
        out["message"] = status.message
    return out


def container_status(v: ContainerView, allocated: list[Obj] | None = None) -> Obj:
    """One container's status; ``allocated``: its ``allocatedResourcesStatus`` (device health)."""
    state: Obj
    if v.running:
        state = {"running": {"startedAt": v.running_since}}
    elif v.exited is not None and not v.restarting:
        state = {"terminated": _terminated(v.exited, v.container_id)}
    else:
        waiting: Obj = {"reason": v.waiting_reason}
        if v.waiting_message:
            waiting["message"] = v.waiting_message
        state = {"waiting": waiting}
    last: Obj = {}
    if v.restarting and v.exited is not None:
        last = {"terminated": _terminated(v.exited, v.container_id)}
    elif v.last_terminated is not None:
        last = {"terminated": _terminated(v.last_terminated, v.last_container_id)}
    out: Obj = {
        "name": v.name,
        "image": v.image,
        "imageID": "",
        "ready": v.running,
        "started": v.running,
        "restartCount": v.restart_count,
        "state": state,
        "lastState": last,
    }
    if v.container_id and (v.running or (v.exited is not None and not v.restarting)):
        out["containerID"] = v.container_id
    if allocated:
        out["allocatedResourcesStatus"] = allocated
    return out


def phase(
    restart_policy: str, inits: list[ContainerView], apps: list[ContainerView], terminal: bool
) -> str:
    """kubelet's getPhase: ``terminal`` when the pod is being torn down (deleted)."""
    init_failed = any(
        i.exited is not None and i.exited.exit_code != 0 and not i.restarting
        for i in inits
        if not i.sidecar
    )
    init_pending = any(not (i.running if i.sidecar else i.succeeded()) for i in inits)
    if init_failed and restart_policy == "Never":
        return "Failed"
    if init_pending and not terminal:
        return "Pending"
    running = sum(1 for a in apps if a.running)
    stopped = sum(1 for a in apps if not a.running and a.ever_ran)
    waiting = sum(1 for a in apps if not a.running and not a.ever_ran)
    succeeded = sum(1 for a in apps if a.succeeded())
    if terminal:
        if running:
            return "Running"
        if waiting and not stopped:
            return "Failed"
        return "Succeeded" if stopped and succeeded == len(apps) else "Failed"
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if stopped:
        if restart_policy == "Always":
            return "Running"
        if succeeded == stopped and not any(a.restarting for a in apps):
            return "Succeeded"
        if restart_policy == "Never":
            return "Failed"
        return "Running"
    return "Pending"


def _condition(ctype: str, ok: bool, reason: str = "", message: str = "") -> Obj:
    out: Obj = {"type": ctype, "status": "True" if ok else "False"}
    if reason:
        out["reason"] = reason
    if message:
        out["message"] = message
    return out


def conditions(
    pod_phase: str, sandbox_ready: bool, inits: list[ContainerView], apps: list[ContainerView]
) -> list[Obj]:
    out = [
        _condition(
            "PodReadyToStartContainers", sandbox_ready and pod_phase not in ("Succeeded", "Failed")
        )
    ]
    incomplete = [i.name for i in inits if not (i.running if i.sidecar else i.succeeded())]
    if not incomplete or pod_phase == "Succeeded":
        out.append(
            _condition(
                "Initialized", True, "PodCompleted" if inits and pod_phase == "Succeeded" else ""
            )
        )
    else:
        out.append(
            _condition(
                "Initialized",
                False,
                "ContainersNotInitialized",
                f"containers with incomplete status: [{' '.join(incomplete)}]",
            )
        )
    unready = [a.name for a in apps if not a.running]
    if pod_phase == "Succeeded":
        ready = _condition("ContainersReady", False, "PodCompleted")
    elif unready:
        ready = _condition(
            "ContainersReady",
            False,
            "ContainersNotReady",
            f"containers with unready status: [{' '.join(unready)}]",
        )
    else:
        ready = _condition("ContainersReady", True)
    out.append(ready)
    out.append({**ready, "type": "Ready"})
    return out


def with_transitions(new: list[Obj], current: list[Obj], generation: int | None) -> list[Obj]:
    """Keep each condition's lastTransitionTime unless its status flipped."""
    now = now_rfc3339()
    old = {c.get("type"): c for c in current}
    out = []
    for cond in new:
        prev = old.get(cond["type"])
        since = (
            prev.get("lastTransitionTime")
            if prev and prev.get("status") == cond["status"]
            else None
        )
        full = {**cond, "lastProbeTime": None, "lastTransitionTime": since or now}
        if generation is not None:
            full["observedGeneration"] = generation
        out.append(full)
    return out


def build(
    pod: Obj,
    *,
    pod_phase: str,
    sandbox_ready: bool,
    inits: list[ContainerView],
    apps: list[ContainerView],
    allocated: dict[str, list[Obj]] | None = None,
) -> Obj:
    """The status part of the patch. ``allocated``: container name → its
    ``allocatedResourcesStatus`` (health.allocated_resources_status)."""
    allocated = allocated or {}
    current = pod.get("status") or {}
    generation = pod["metadata"].get("generation")
    status: Obj = {
        "phase": pod_phase,
        "hostIP": HOST_IP,
        "hostIPs": [{"ip": HOST_IP}],
        "startTime": current.get("startTime") or now_rfc3339(),
        "conditions": with_transitions(
            conditions(pod_phase, sandbox_ready, inits, apps),
            [c for c in current.get("conditions") or [] if c.get("type") in OWNED],
            generation,
        ),
        "containerStatuses": [container_status(a, allocated.get(a.name)) for a in apps],
    }
    if inits:
        status["initContainerStatuses"] = [container_status(i) for i in inits]
    if sandbox_ready:
        status["podIP"] = HOST_IP
        status["podIPs"] = [{"ip": HOST_IP}]
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def rejected(pod: Obj, reason: str, message: str) -> Obj:
    current = pod.get("status") or {}
    return {
        "phase": "Failed",
        "reason": reason,
        "message": f"Pod was rejected: {message}",
        "startTime": current.get("startTime") or now_rfc3339(),
        "hostIP": HOST_IP,
        "hostIPs": [{"ip": HOST_IP}],
    }


def _norm(value: object) -> object:
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items() if v not in (None, {}, [], "")}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return value


def changed(pod: Obj, status: Obj) -> bool:
    """False when sending ``status`` would not change the pod (no-op patches are skipped)."""
    current = pod.get("status") or {}
    for key, value in status.items():
        have = current.get(key)
        if key == "conditions":
            have = [c for c in have or [] if c.get("type") in OWNED]
            order = {c["type"]: i for i, c in enumerate(value)}
            have = sorted(have, key=lambda c: order.get(c.get("type"), 99))
        if _norm(have) != _norm(value):
            return True
    return False
