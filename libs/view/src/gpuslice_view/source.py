"""Reading the view straight from the API server: one list per kind, no watch.

This is how the kubectl plugin works without the controller (``ApiSource``). It asks discovery which
resource.k8s.io version to read (the newest of v1, v1beta2, v1beta1 the server serves) and in
which version DeviceTaintRule is served (v1 on 1.37, v1beta2 on 1.36, v1alpha3 before).
"""

from __future__ import annotations

from gpuslice_api.names import DRIVER
from gpuslice_core.errors import FailedPreconditionError
from gpuslice_kube.discovery import RESOURCE_GROUP, RESOURCE_VERSIONS, served_versions
from gpuslice_kube.errors import KubeForbiddenError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_view import report
from gpuslice_view.model import ClusterView
from gpuslice_view.reasons import why_pod
from gpuslice_view.report import Row

TAINT_RULE_VERSIONS = ("v1", "v1beta2", "v1alpha3")
"""Where DeviceTaintRule is served, newest first."""


def resource_version(raw: RawApi) -> str:
    served = served_versions(raw)
    version = next((v for v in RESOURCE_VERSIONS if v in served), None)
    if version is None:
        raise FailedPreconditionError(
            f"the API server serves no {RESOURCE_GROUP} (DRA) version gpuslice reads "
            f"({', '.join(RESOURCE_VERSIONS)}); served: {', '.join(served) or 'none'}"
        )
    return version


def taint_rule_version(raw: RawApi) -> str | None:
    """The newest version in which the server serves DeviceTaintRule; None if it serves none."""
    served = served_versions(raw)
    for version in TAINT_RULE_VERSIONS:
        if version not in served:
            continue
        try:
            doc = raw.get(f"/apis/{RESOURCE_GROUP}/{version}")
        except KubeNotFoundError:
            continue
        if any(r.get("name") == "devicetaintrules" for r in doc.get("resources") or []):
            return version
    return None


def _items(raw: RawApi, path: str, field_selector: str | None = None) -> list[Obj]:
    items: list[Obj] = raw.list(path, field_selector=field_selector)["items"]
    return items


def load(
    raw: RawApi,
    *,
    driver: str = DRIVER,
    pods_namespace: str | None = None,
    all_pods: bool = False,
) -> ClusterView:
    """The view from one list of each kind: our driver's ResourceSlices, every ResourceClaim
    (allocations in every namespace count for what is free), DeviceClasses, DeviceTaintRules
    (where served), and pods only when asked for (``pods_namespace`` or ``all_pods``)."""
    gv = f"{RESOURCE_GROUP}/{resource_version(raw)}"
    rules: list[Obj] = []
    rule_version = taint_rule_version(raw)
    if rule_version is not None:
        try:
            rules = _items(
                raw, resource_path(f"{RESOURCE_GROUP}/{rule_version}", "devicetaintrules")
            )
        except KubeForbiddenError:
            rules = []  # a user who may not read them sees no cordons, not an error
    pods: list[Obj] = []
    if all_pods or pods_namespace:
        pods = _items(
            raw, resource_path("v1", "pods", namespace=None if all_pods else pods_namespace)
        )
    return ClusterView.build(
        slices=_items(
            raw, resource_path(gv, "resourceslices"), field_selector=f"spec.driver={driver}"
        ),
        claims=_items(raw, resource_path(gv, "resourceclaims")),
        pods=pods,
        classes=_items(raw, resource_path(gv, "deviceclasses")),
        rules=rules,
        driver=driver,
    )


class ApiSource:
    """The commands' answers from one listing of the API (``load``): what ``kubectl gpuslice``
    shows without the controller. Same shapes as the controller's ``/view/`` (``remote``)."""

    name = "api"

    def __init__(self, raw: RawApi) -> None:
        self.raw = raw

    def gpu_rows(self) -> list[Row]:
        return report.gpu_rows(load(self.raw))

    def gpu_row(self, ref: str) -> Row:
        view = load(self.raw)
        device = view.find(ref)
        return report.gpu_row(view, view.usage()[device.key])

    def claim_rows(self, namespace: str | None) -> list[Row]:
        return report.claim_rows(load(self.raw), namespace)

    def why_pod(self, namespace: str, name: str) -> Row | None:
        """``{pod, node, scheduler, reasons}``; None when there is no such pod with claims."""
        view = load(self.raw, pods_namespace=namespace)
        pod = view.pods.get((namespace, name))
        if pod is None:
            return None
        subject = {"pod": f"{namespace}/{name}", "node": pod.node, "scheduler": pod.scheduling}
        return {**subject, "reasons": [r.to_dict() for r in why_pod(view, pod)]}
