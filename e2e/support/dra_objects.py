"""The DRA objects the node-agent tests create for the stand-in driver
(e2e/support/standin_dra_plugin.py): hand-written ResourceSlices, claim templates and pods that
ask for them."""

from __future__ import annotations

from e2e.sandbox.nodeagent.testing import unique
from e2e.support.standin_dra_plugin import DRIVER
from gpuslice_kube.raw import Obj, RawApi, resource_path

RESOURCE = "resource.k8s.io/v1"


def shareable_gpu(name: str = "gpu-0") -> Obj:
    return {
        "name": name,
        "allowMultipleAllocations": True,
        "attributes": {"type": {"string": "gpu"}, "index": {"int": 0}},
        "capacity": {
            "cores": {
                "value": "100",
                "requestPolicy": {
                    "default": "100",
                    "validRange": {"min": "1", "max": "100", "step": "1"},
                },
            }
        },
    }


def create_slice(kube: RawApi, node: str, devices: list[Obj], driver: str = DRIVER) -> Obj:
    body = {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": {"name": unique(f"{node}-slice")},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }
    return kube.create(resource_path(RESOURCE, "resourceslices"), body)


def claim_template(namespace: str, name: str, device_class: str, cores: str | None) -> Obj:
    exactly: Obj = {"deviceClassName": device_class}
    if cores is not None:
        exactly["capacity"] = {"requests": {"cores": cores}}
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def gpu_pod(
    namespace: str,
    name: str,
    node: str,
    template: str,
    script: str = "echo GPU_DEVICE=$GPU_DEVICE GPU_CORES=$GPU_CORES; sleep 60",
) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "command": ["sh", "-c", script],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        },
    }


def create(kube: RawApi, namespace: str, plural: str, obj: Obj, gv: str = "v1") -> Obj:
    return kube.create(resource_path(gv, plural, namespace=namespace), obj)


def delete_pod(kube: RawApi, namespace: str, name: str) -> None:
    kube.delete(resource_path("v1", "pods", namespace=namespace, name=name))
