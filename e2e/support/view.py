"""Pods on a sandbox GPU node for the cluster-view tests (view/): started with a claim from a
template, deleted and waited for."""

from __future__ import annotations

from e2e.sandbox.gpunode import RESOURCE, GpuNode, claim_template, gpu_pod
from e2e.sandbox.nodeagent.testing import wait_pod_gone
from gpuslice_kube.raw import RawApi, resource_path


def start_pod(
    kube: RawApi,
    ns: str,
    node: GpuNode,
    name: str,
    *,
    device_class: str = "gpu.gpuslice.dev",
    selector: str | None = None,
    **capacity: str,
) -> None:
    template = claim_template(ns, name, device_class, selector=selector, **capacity)
    kube.create(resource_path(RESOURCE, "resourceclaimtemplates", namespace=ns), template)
    kube.create(
        resource_path("v1", "pods", namespace=ns), gpu_pod(ns, name, node.name, template=name)
    )


def delete_pods(kube: RawApi, ns: str, *names: str) -> None:
    for name in names:
        kube.delete(resource_path("v1", "pods", namespace=ns, name=name))
    for name in names:
        wait_pod_gone(kube, ns, name, timeout=30)
