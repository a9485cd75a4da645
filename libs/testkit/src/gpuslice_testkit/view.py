"""API objects as the API server returns them (plain dicts), for tests of the view and its users."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gpuslice_api import names
from gpuslice_api.names import DRIVER
from gpuslice_view.model import ClusterView

T = TypeVar("T")

Obj = dict[str, Any]
GIB = 1024**3
H100_MIB = 81559
GPU_CLASS = (
    "device.driver == 'gpu.gpuslice.dev' && device.attributes['gpu.gpuslice.dev'].type == 'gpu'"
)
MIG_CLASS = (
    "device.driver == 'gpu.gpuslice.dev' && device.attributes['gpu.gpuslice.dev'].type == 'mig'"
)


def gpu(index: int, *, model: str = "NVIDIA H100 80GB HBM3", mib: int = H100_MIB) -> Obj:
    memory = f"{mib}Mi"
    return {
        "name": f"gpu-{index}",
        "allowMultipleAllocations": True,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-{index:08d}-aaaa"},
            "index": {"int": index},
            "productName": {"string": model},
            "driverVersion": {"version": "570.158.1"},
        },
        "capacity": {
            "cores": {"value": "100", "requestPolicy": {"default": "100"}},
            "memory": {"value": memory, "requestPolicy": {"default": memory}},
        },
    }


def mig(index: int, profile: str, start: int, mib: int) -> Obj:
    return {
        "name": f"gpu-{index}-mig-{profile.replace('.', '-')}-{start}",
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": f"MIG-{index}-{start}"},
            "parentUUID": {"string": f"GPU-{index:08d}-aaaa"},
            "index": {"int": index},
            "profile": {"string": profile},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
        },
        "capacity": {"memory": {"value": f"{mib}Mi"}, "multiprocessors": {"value": "16"}},
    }


def v1beta1_device(device: Obj) -> Obj:
    """The same device as resource.k8s.io/v1beta1 nests it."""
    return {"name": device["name"], "basic": {k: v for k, v in device.items() if k != "name"}}


def resource_slice(node: str, devices: list[Obj], *, generation: int = 1) -> Obj:
    return {
        "metadata": {"name": f"{node}-{DRIVER}-x"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def result(node: str, device: str, request: str = "gpu", **consumed: str) -> Obj:
    out: Obj = {"request": request, "driver": DRIVER, "pool": node, "device": device}
    if consumed:
        out["consumedCapacity"] = consumed
        out["shareID"] = f"share-{device}-{len(consumed)}"
    return out


def claim(
    namespace: str,
    name: str,
    *,
    results: list[Obj] | None = None,
    pods: tuple[str, ...] = (),
    device_class: str = names.GPU_CLASS,
    selectors: tuple[str, ...] = (),
    tolerations: list[Obj] | None = None,
    count: int | None = None,
    v1beta1: bool = False,
    **capacity: str,
) -> Obj:
    exactly: Obj = {"deviceClassName": device_class, "allocationMode": "ExactCount"}
    if count is not None:
        exactly["count"] = count
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if tolerations:
        exactly["tolerations"] = tolerations
    request = {"name": "gpu", **exactly} if v1beta1 else {"name": "gpu", "exactly": exactly}
    obj: Obj = {
        "metadata": {"namespace": namespace, "name": name, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [request]}},
    }
    if results is not None:
        obj["status"] = {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods],
        }
    return obj


def device_class(name: str, expression: str) -> Obj:
    return {
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


CLASSES = [device_class(names.GPU_CLASS, GPU_CLASS), device_class(names.MIG_CLASS, MIG_CLASS)]


def taint_rule(name: str, node: str, device: str, effect: str = "NoSchedule") -> Obj:
    return {
        "metadata": {"name": name},
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": node, "device": device},
            "taint": {"key": f"{DRIVER}/cordon", "effect": effect},
        },
    }


def pod(
    namespace: str,
    name: str,
    *,
    claim: str | None = None,
    template: str | None = None,
    generated: str | None = None,
    hostname: str | None = None,
) -> Obj:
    source = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
    spec: Obj = {"resourceClaims": [{"name": "gpu", **source}], "containers": []}
    if hostname:
        spec["nodeSelector"] = {"kubernetes.io/hostname": hostname}
    status: Obj = {"phase": "Pending"}
    if generated:
        status["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": generated}]
    return {
        "metadata": {"namespace": namespace, "name": name, "uid": f"uid-{name}"},
        "spec": spec,
        "status": status,
    }


class FixedFeeder:
    """What the controller reads of a ``ViewFeeder`` (``synced``, ``events``, ``read``) over a
    view built by hand; counts its reads."""

    def __init__(
        self,
        view: ClusterView,
        *,
        synced: bool = True,
        events: dict[str, int] | None = None,
    ) -> None:
        self.view = view
        self.synced = threading.Event()
        if synced:
            self.synced.set()
        self.events = dict(events or {})
        self.reads = 0

    def read(self, fn: Callable[[ClusterView], T]) -> T:
        self.reads += 1
        return fn(self.view)
