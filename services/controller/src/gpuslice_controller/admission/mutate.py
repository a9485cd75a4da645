"""The mutating webhook: pods in other GPU-sharing systems' dialects become DRA pods.

``translate.translate_pod`` decides (pure); this module does the side effect the decision needs
— the ResourceClaimTemplates it names must exist in the pod's namespace before the pod does, so
the resource claim controller can make the pod's claims from them — and answers with the patch.
Templates are named by what they ask, so one that exists is reused by every pod that asks the
same; a watch of the templates this controller made keeps the common path free of API calls.
A dry run creates nothing (the webhook declares ``sideEffects: NoneOnDryRun``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from gpuslice_controller.admission import translate
from gpuslice_controller.admission.dialects import DEFAULT, Dialects
from gpuslice_controller.admission.review import Decision, Request
from gpuslice_core.logging import get_logger, kobj
from gpuslice_kube.errors import KubeAlreadyExistsError
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_kube.reflector import Reflector, metadata_only

log = get_logger(__name__)

MANAGED_BY = translate.MANAGED_BY_LABEL
MANAGER = translate.MANAGED_BY


def for_version(template: Obj, version: str) -> Obj:
    """A resource.k8s.io/v1 ResourceClaimTemplate in ``version`` (v1beta2 has v1's shape;
    v1beta1 has each request's device fields on the request, not under ``exactly``)."""
    out = copy.deepcopy(template)
    out["apiVersion"] = f"resource.k8s.io/{version}"
    if version == "v1beta1":
        requests = out["spec"]["spec"]["devices"]["requests"]
        for i, request in enumerate(requests):
            exactly = request.pop("exactly", None)
            if exactly is not None:
                requests[i] = {**request, **exactly}
    return out


class PodTranslator:
    """Reviews pod creations (``review``)."""

    def __init__(
        self,
        raw: RawApi,
        *,
        version: str,
        facts: Callable[[], translate.ClusterFacts],
        driver: str,
        device_class: str,
        dialects: Dialects = DEFAULT,
    ) -> None:
        self.raw = raw
        self.version = version
        self.facts = facts
        self.driver = driver
        self.device_class = device_class
        self.dialects = dialects
        self.templates = Reflector(
            raw,
            f"/apis/resource.k8s.io/{version}/resourceclaimtemplates",
            lambda _type, _obj: None,
            label_selector=f"{MANAGED_BY}={MANAGER}",
            keep=metadata_only,  # which templates exist is all the webhook asks
        )

    def start(self) -> None:
        self.templates.start()

    def stop(self) -> None:
        self.templates.stop()

    def synced(self) -> bool:
        return self.templates.synced.is_set()

    def review(self, request: Request) -> Decision:
        if (request.get("kind") or {}).get("kind") != "Pod" or request.get("operation") != "CREATE":
            return Decision.allow()
        pod: dict[str, Any] = request.get("object") or {}
        try:
            result = translate.translate_pod(
                pod,
                self.facts(),
                driver_domain=self.driver,
                device_class=self.device_class,
                dialects=self.dialects,
            )
        except translate.Denied as exc:
            return Decision.deny(str(exc))
        if result is None:
            return Decision.allow()
        namespace = request.get("namespace") or (pod.get("metadata") or {}).get("namespace")
        if not request.get("dryRun"):
            for template in result.templates:
                problem = self._ensure(str(namespace), template)
                if problem:
                    return Decision.deny(problem)
        return Decision.allow(*result.warnings, patch=result.patch)

    def _ensure(self, namespace: str, template: Obj) -> str | None:
        """Make sure ``template`` exists in ``namespace``; a reason to deny if it cannot."""
        name = template["metadata"]["name"]
        if f"{namespace}/{name}" in self.templates.cache:
            return None
        body = for_version(template, self.version)
        body["metadata"]["namespace"] = namespace
        path = f"/apis/resource.k8s.io/{self.version}/namespaces/{namespace}/resourceclaimtemplates"
        try:
            self.raw.create(path, body)
            log.info("claim template created", template=kobj(namespace, name))
            return None
        except KubeAlreadyExistsError:
            pass
        # Made a moment ago (by another replica or request), or someone else's of that name.
        existing = self.raw.get(f"{path}/{name}")
        labels = (existing.get("metadata") or {}).get("labels") or {}
        if labels.get(MANAGED_BY) == MANAGER:
            return None
        return (
            f"ResourceClaimTemplate {namespace}/{name} exists and was not made by "
            f"{MANAGER}; delete or rename it so the pod's GPU request can be translated"
        )
