"""Helpers for tests on the sandbox: waiting with a timeout (no fixed sleeps), pod phase and
conditions, the events of an object, unique names."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import TypeVar

from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.core import WaitTimeoutError as WaitTimeoutError  # re-exported
from gpuslice_testkit.core import wait_for as wait_for  # re-exported

T = TypeVar("T")


def unique(prefix: str) -> str:
    """A DNS-label-safe unique name."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def temporary_namespace(raw: RawApi, prefix: str) -> Iterator[str]:
    """A new namespace named ``<prefix>-<random>``, deleted (with what is in it) after. It is
    handed over once its ``default`` ServiceAccount exists: until the serviceaccount controller
    has made it, the API server refuses every pod there ("serviceaccount default not found")."""
    name = unique(prefix)
    raw.create(
        resource_path("v1", "namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
    )
    try:
        sa = resource_path("v1", "serviceaccounts", namespace=name, name="default")
        wait_for(lambda: get_object(raw, sa), 30, f"the default ServiceAccount of {name}")
        yield name
    finally:
        with contextlib.suppress(KubeNotFoundError):
            raw.delete(resource_path("v1", "namespaces", name=name))


def get_object(raw: RawApi, path: str) -> Obj | None:
    try:
        return raw.get(path)
    except KubeNotFoundError:
        return None


def get_pod(raw: RawApi, namespace: str, name: str) -> Obj | None:
    try:
        return raw.get(resource_path("v1", "pods", namespace=namespace, name=name))
    except KubeNotFoundError:
        return None


def condition(obj: Obj, ctype: str) -> Obj | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return None


def wait_pod_phase(raw: RawApi, namespace: str, name: str, phase: str, timeout: float = 20) -> Obj:
    """The pod once its phase is ``phase``."""

    def check() -> Obj | None:
        pod = get_pod(raw, namespace, name)
        if pod is None:
            raise AssertionError("the pod does not exist")
        status = pod.get("status") or {}
        if status.get("phase") == phase:
            return pod
        raise AssertionError(f"pod status now: {summary(pod)}")

    return wait_for(check, timeout, f"pod {namespace}/{name} to be {phase}")


def summary(pod: Obj) -> str:
    """Phase, conditions and container states in one line (for failure messages)."""
    status = pod.get("status") or {}
    conds = [
        f"{c['type']}={c['status']}"
        + (f"({c.get('reason')}: {c.get('message')})" if c.get("reason") else "")
        for c in status.get("conditions") or []
    ]
    states = [
        f"{c['name']}:{next(iter(c.get('state') or {'?': 0}))}"
        for c in status.get("containerStatuses") or []
    ]
    return f"phase={status.get('phase')} node={pod['spec'].get('nodeName')} {conds} {states}"


def wait_pod_gone(raw: RawApi, namespace: str, name: str, timeout: float = 20) -> None:
    wait_for(
        lambda: get_pod(raw, namespace, name) is None, timeout, f"pod {namespace}/{name} to be gone"
    )


def events_for(raw: RawApi, namespace: str, name: str, reason: str | None = None) -> list[Obj]:
    """Core/v1 Events about the object ``name`` in ``namespace`` (optionally one reason)."""
    selector = f"involvedObject.name={name}"
    if reason:
        selector += f",reason={reason}"
    items = raw.list(resource_path("v1", "events", namespace=namespace), field_selector=selector)[
        "items"
    ]
    return sorted(items, key=lambda e: e.get("lastTimestamp") or "")


def wait_event(raw: RawApi, namespace: str, name: str, reason: str, timeout: float = 20) -> Obj:
    events = wait_for(
        lambda: events_for(raw, namespace, name, reason),
        timeout,
        f"an Event {reason} for {namespace}/{name}",
    )
    return events[-1]
