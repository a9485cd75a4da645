"""The plugin's own Node: the per-node mode check, the config label, what the node says about
sharing, and Events.

**Per-node mode.** A GPU is served by DRA or by the device plugin, never both (two allocators over
one GPU over-admit). The chart decides by the node label ``gpuslice.dev/mode``: the node
DaemonSet (DRA) runs where it is not ``device-plugin``, this plugin where it is. At start the
plugin checks both sides of that rule against the API server and refuses to serve when either
says DRA (:func:`refusal`):

1. the label ``gpuslice.dev/mode`` must be ``device-plugin`` (absent or any other value means
   the node is a DRA node);
2. no ResourceSlice of the DRA driver ``gpu.gpuslice.dev`` may exist for the node (the kubelet
   plugin still publishes, e.g. right after the label was switched: the kubelet removes the
   slices about 30 s after the driver stopped).

A refusal is a log line, a Warning Event ``DevicePluginRefused`` on the Node (namespace
``default``, where the kubelet puts Node events) and exit status 3: nothing is served, and the
kubelet's restart back-off re-checks later, so a node being switched starts by itself.

**Sharing, on the node.** After discovery the plugin labels the node per resource,
``sharing.gpuslice.dev/<resource without nvidia.com/>=none|time-slicing|mps`` (selectable, like
NVIDIA's ``nvidia.com/gpu.sharing-strategy``), and writes the annotation
``gpuslice.dev/device-plugin-sharing`` with the details as JSON: replicas, and whether they are
enforced — never for time-slicing, and for MPS the level and mechanisms the enforcer chose.
Labels of resources the node no longer has are removed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuslice_api.names import DRIVER
from gpuslice_api.nodemode import MODE_DEVICE_PLUGIN, MODE_LABEL
from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.devices import Resource
from gpuslice_device_plugin.mps import ReplicaShare
from gpuslice_kube.discovery import newest_resource_version
from gpuslice_kube.events import node_event
from gpuslice_kube.raw import Obj, RawApi, resource_path

log = get_logger(__name__)

DRA_DRIVER = DRIVER
SHARING_LABEL_PREFIX = "sharing.gpuslice.dev/"
SHARING_ANNOTATION = "gpuslice.dev/device-plugin-sharing"
COMPONENT = "gpuslice-device-plugin"
REFUSED_REASON = "DevicePluginRefused"
POD_LIST_DEADLINE = 5.0


@dataclass(frozen=True)
class NodeInfo:
    name: str
    uid: str
    labels: dict[str, str]


def refusal(node: NodeInfo, dra_slices: Sequence[str]) -> str | None:
    """Why this node must not run the device plugin, or None when it may."""
    mode = node.labels.get(MODE_LABEL)
    if mode != MODE_DEVICE_PLUGIN:
        got = f"{MODE_LABEL}={mode}" if mode is not None else f"no label {MODE_LABEL}"
        return (
            f"node {node.name} is a DRA node ({got}); the device plugin serves only nodes"
            f" labelled {MODE_LABEL}={MODE_DEVICE_PLUGIN}, so that no GPU is served by both"
        )
    if dra_slices:
        return (
            f"node {node.name} is labelled {MODE_LABEL}={MODE_DEVICE_PLUGIN} but the DRA driver"
            f" {DRA_DRIVER} still publishes {len(dra_slices)} ResourceSlice(s) for it"
            f" ({', '.join(sorted(dra_slices)[:3])}); a GPU must not be served by both: stop the"
            " gpuslice kubelet plugin on this node first"
        )
    return None


def sharing_state(
    resources: Sequence[Resource], shares: dict[str, ReplicaShare]
) -> tuple[dict[str, str], dict[str, Any]]:
    """The per-resource labels and the annotation's content."""
    labels: dict[str, str] = {}
    details: dict[str, Any] = {}
    for r in resources:
        labels[SHARING_LABEL_PREFIX + r.name.split("/", 1)[1]] = r.sharing
        entry: dict[str, Any] = {"sharing": r.sharing, "devices": len(r.devices)}
        if r.sharing == "time-slicing":
            entry |= {
                "replicas": r.replicas,
                "enforced": False,
                "note": "time-slicing replicas share the GPU without memory or compute limits",
            }
        elif r.sharing == "mps":
            first = shares[r.devices[0].id]
            entry |= {
                "replicas": r.replicas,
                "enforced": first.level != "none",
                "enforcement": first.level,
                "cores": first.cores,
                "memoryBytes": first.memory_bytes,
                "memoryMechanism": first.memory_mechanism,
                "coresMechanism": first.cores_mechanism,
            }
        details[r.name] = entry
    return labels, details


class KubeNode:
    """Reads and annotates one Node through the API server (retries in ``RawApi``)."""

    def __init__(self, raw: RawApi, name: str) -> None:
        self.raw = raw
        self.name = name
        self.uid = ""

    @property
    def path(self) -> str:
        return resource_path("v1", "nodes", name=self.name)

    def info(self) -> NodeInfo:
        meta = self.raw.get(self.path).get("metadata") or {}
        self.uid = str(meta.get("uid") or "")
        return NodeInfo(self.name, self.uid, dict(meta.get("labels") or {}))

    def dra_slices(self) -> list[str]:
        """Names of the DRA driver's ResourceSlices for this node, in the newest
        resource.k8s.io version the server has (none: a cluster without DRA)."""
        version = newest_resource_version(self.raw)
        if version is None:
            return []
        items = self.raw.list(
            resource_path(f"resource.k8s.io/{version}", "resourceslices"),
            field_selector=f"spec.nodeName={self.name},spec.driver={DRA_DRIVER}",
        )["items"]
        return [str(s["metadata"]["name"]) for s in items]

    def pods(self) -> list[Obj]:
        """This node's pods (``spec.nodeName=<node>``), for the per-container metrics: their
        UIDs and container IDs, which the kubelet's pod resources API does not give. A short
        deadline: a scrape must not hang on the API server."""
        quick = RawApi(self.raw.api_client, deadline=POD_LIST_DEADLINE)
        items: list[Obj] = quick.list(
            resource_path("v1", "pods"), field_selector=f"spec.nodeName={self.name}"
        )["items"]
        return items

    def set_sharing(self, labels: dict[str, str], details: dict[str, Any]) -> None:
        current = self.raw.get(self.path).get("metadata", {}).get("labels") or {}
        patch_labels: dict[str, str | None] = {
            k: None for k in current if k.startswith(SHARING_LABEL_PREFIX) and k not in labels
        }
        patch_labels.update(labels)
        patch: Obj = {
            "metadata": {
                "labels": patch_labels,
                "annotations": {SHARING_ANNOTATION: json.dumps(details, sort_keys=True)},
            }
        }
        self.raw.patch(self.path, patch)
        log.info("node sharing labels set", node=self.name, labels=labels)

    def event(self, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the Node; a failure to report is logged, never raised."""
        node_event(
            self.raw,
            self.name,
            self.uid,
            type_=type_,
            reason=reason,
            message=message,
            component=COMPONENT,
        )
