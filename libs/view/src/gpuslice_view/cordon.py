"""Cordon: a DeviceTaintRule that taints one device ``gpu.gpuslice.dev/cordon``.

The rule's name is derived from the device (``gpuslice-cordon-<pool>-<device>``, made a DNS
subdomain, with a hash when it would be too long), so cordon and uncordon need no lookup and
are idempotent. ``NoSchedule`` keeps new claims off the device; ``NoExecute`` (``--evict``) also
makes kube-controller-manager's device-taint-eviction controller evict the pods that use it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_kube.discovery import RESOURCE_GROUP
from gpuslice_kube.errors import KubeAlreadyExistsError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kube.retry import retry_on_conflict
from gpuslice_view.objects import CORDON_KEY, Device
from gpuslice_view.source import taint_rule_version

MANAGED_BY = "kubectl-gpuslice"
NO_API = (
    "this cluster does not serve DeviceTaintRule (resource.k8s.io v1 from Kubernetes 1.37; "
    "v1beta2 on 1.36 and v1alpha3 on 1.33-1.35, each only where that API version and the "
    "DRADeviceTaintRules feature are enabled), so GPUs cannot be cordoned here"
)


def rule_name(device: Device) -> str:
    """``gpuslice-cordon-<pool>-<device>`` as a DNS subdomain of at most 253 characters."""
    text = re.sub(r"[^a-z0-9.-]+", "-", f"gpuslice-cordon-{device.pool}-{device.name}".lower())
    text = text.strip("-.")
    if len(text) <= 253:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"{text[:242].rstrip('-.')}-{digest}"


def rule(device: Device, version: str, *, evict: bool) -> Obj:
    return {
        "apiVersion": f"{RESOURCE_GROUP}/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(device),
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {f"{CORDON_KEY}-device": device.ref},
        },
        "spec": {
            "deviceSelector": {"driver": device.driver, "pool": device.pool, "device": device.name},
            "taint": {"key": CORDON_KEY, "effect": "NoExecute" if evict else "NoSchedule"},
        },
    }


@dataclass(frozen=True)
class Outcome:
    changed: bool
    message: str


def _version(raw: RawApi) -> str:
    version = taint_rule_version(raw)
    if version is None:
        raise FailedPreconditionError(NO_API)
    return version


def cordon(raw: RawApi, device: Device, *, evict: bool) -> Outcome:
    """Create the device's rule, or change its effect; nothing when it is already so."""
    version = _version(raw)
    body = rule(device, version, evict=evict)
    effect = body["spec"]["taint"]["effect"]
    collection = resource_path(f"{RESOURCE_GROUP}/{version}", "devicetaintrules")
    path = resource_path(f"{RESOURCE_GROUP}/{version}", "devicetaintrules", name=rule_name(device))
    try:
        raw.create(collection, body)
        return Outcome(
            True, f"{device.ref} cordoned ({effect}, DeviceTaintRule {rule_name(device)})"
        )
    except KubeAlreadyExistsError:
        pass

    def update() -> Outcome:
        current = raw.get(path)
        if current["spec"].get("taint", {}).get("effect") == effect:
            return Outcome(False, f"{device.ref} already cordoned ({effect})")
        current["spec"]["taint"] = body["spec"]["taint"]
        raw.replace(path, current)
        return Outcome(
            True, f"{device.ref} cordoned ({effect}, DeviceTaintRule {rule_name(device)})"
        )

    return retry_on_conflict(update)


def uncordon(raw: RawApi, device: Device) -> Outcome:
    version = _version(raw)
    path = resource_path(f"{RESOURCE_GROUP}/{version}", "devicetaintrules", name=rule_name(device))
    try:
        raw.delete(path)
    except KubeNotFoundError:
        return Outcome(False, f"{device.ref} is not cordoned")
    return Outcome(True, f"{device.ref} uncordoned")
