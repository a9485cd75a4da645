"""Which versions of an API group the API server serves (the group's discovery document).

Discovery is readable by every authenticated user (the ``system:discovery`` ClusterRole), so
asking needs no RBAC of our own.
"""

from __future__ import annotations

from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import RawApi

RESOURCE_GROUP = "resource.k8s.io"
RESOURCE_VERSIONS = ("v1", "v1beta2", "v1beta1")
"""The resource.k8s.io versions gpuslice speaks, newest first."""


def served_versions(raw: RawApi, group: str = RESOURCE_GROUP) -> list[str]:
    """The versions of ``group`` the server serves, in its order; [] when it serves none."""
    try:
        doc = raw.get(f"/apis/{group}")
    except KubeNotFoundError:
        return []
    return [str(v.get("version")) for v in doc.get("versions") or []]


def newest_resource_version(raw: RawApi) -> str | None:
    """The newest resource.k8s.io version both the server and gpuslice speak, if any."""
    served = served_versions(raw)
    return next((v for v in RESOURCE_VERSIONS if v in served), None)
