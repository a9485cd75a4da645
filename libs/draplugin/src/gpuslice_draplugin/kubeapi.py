"""The resource.k8s.io API as a DRA driver uses it: which version the server offers, claims,
this node's ResourceSlices and its Node, all as raw JSON (docs/decisions.md section 2).

The version is detected, never configured: ``resource.k8s.io/v1`` where the server serves it,
else ``v1beta2``, else ``v1beta1``. ResourceSlices of v1beta1 wrap a device's fields in
``basic``; ``to_version`` converts the v1 shape the publisher builds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpuslice_core.errors import UnsupportedError
from gpuslice_core.logging import get_logger
from gpuslice_kube.discovery import RESOURCE_GROUP, RESOURCE_VERSIONS, served_versions
from gpuslice_kube.errors import KubeForbiddenError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path

log = get_logger(__name__)

GROUP = RESOURCE_GROUP
PREFERRED = RESOURCE_VERSIONS
_MINOR = re.compile(r"(\d+)")


@dataclass(frozen=True)
class ServerInfo:
    """What the API server offers: the resource.k8s.io version used and its minor release."""

    version: str  # v1 | v1beta2 | v1beta1
    minor: int  # 37 for v1.37.x

    @property
    def group_version(self) -> str:
        return f"{GROUP}/{self.version}"

    @property
    def counters_in_own_slices(self) -> bool:
        """1.35+: a slice holds devices or shared counters, never both."""
        return self.minor >= 35


def detect(raw: RawApi) -> ServerInfo:
    """Ask the API server which resource.k8s.io versions it serves and which release it is."""
    served = served_versions(raw, GROUP)
    if not served:
        raise UnsupportedError(
            f"the API server does not serve {GROUP}: DRA needs Kubernetes 1.32+ "
            "(resource.k8s.io/v1beta1 enabled) or 1.34+"
        )
    version = next((v for v in PREFERRED if v in served), None)
    if version is None:
        raise UnsupportedError(
            f"the API server serves {GROUP} versions {served}, none of {list(PREFERRED)}"
        )
    info = raw.get("/version")
    match = _MINOR.match(str(info.get("minor") or ""))
    minor = int(match.group(1)) if match else 0
    server = ServerInfo(version=version, minor=minor)
    if version != "v1":
        log.warning(
            "resource.k8s.io/v1 is not served; falling back",
            using=server.group_version,
            served=served,
        )
    return server


def read_node(raw: RawApi, node_name: str) -> Obj | None:
    """The Node, or None when it does not exist or this process may not read it."""
    try:
        return raw.get(resource_path("v1", "nodes", name=node_name))
    except (KubeNotFoundError, KubeForbiddenError) as exc:
        log.info("cannot read the Node", node=node_name, error=str(exc))
        return None


def to_version(device: dict[str, Any], version: str) -> dict[str, Any]:
    """Convert a v1-shaped device to ``version`` (v1beta1 nests everything under ``basic``)."""
    if version != "v1beta1":
        return device
    basic = {k: v for k, v in device.items() if k != "name"}
    return {"name": device["name"], "basic": basic}


def device_fields(device: Obj) -> Obj:
    """The fields of a device of any version (v1beta1's ``basic`` unwrapped)."""
    basic = device.get("basic")
    return basic if isinstance(basic, dict) else device


class ResourceApi:
    """Claims and this node's slices on the detected resource.k8s.io version."""

    def __init__(self, raw: RawApi, server: ServerInfo) -> None:
        self.raw = raw
        self.server = server

    @property
    def slices_path(self) -> str:
        return resource_path(self.server.group_version, "resourceslices")

    def slice_path(self, name: str) -> str:
        return resource_path(self.server.group_version, "resourceslices", name=name)

    def get_claim(self, namespace: str, name: str) -> Obj:
        return self.raw.get(
            resource_path(
                self.server.group_version, "resourceclaims", namespace=namespace, name=name
            )
        )
