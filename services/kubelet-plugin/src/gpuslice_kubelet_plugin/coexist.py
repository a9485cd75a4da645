"""Refuse a node whose GPUs other GPU software already manages (issue 29).

The per-node mode check (``nodemode``) keeps the plugin off nodes where a device plugin serves
the GPUs. This check, run right after it at start, covers the two other ways to lose a GPU under
a running claim:

- **another DRA driver publishes the same GPUs**: a ResourceSlice of this node whose driver is
  not ours has a device with an attribute naming one of this node's GPU UUIDs (NVIDIA's
  ``gpu.nvidia.com`` publishes ``uuid``, and ``parentUUID`` on MIG devices; any attribute whose
  name ends in ``uuid`` counts, so HAMi's and others' are found too). Two drivers publishing one
  GPU let the scheduler give it to two claims;
- **the GPU Operator's MIG manager manages MIG here**: the node has the Operator's label
  ``nvidia.com/mig.config`` and is not excluded from its MIG manager
  (``nvidia.com/gpu.deploy.mig-manager=false``). That manager repartitions the GPUs whenever
  the label changes, destroying MIG devices that gpuslice's claims hold.

A refusal is what the mode check's is: an error log line, a Warning Event
``KubeletPluginRefused`` on the Node that says what was found and what to change, and
:class:`~gpuslice_kubelet_plugin.nodemode.NodeRefusedError` (the command exits 3, the kubelet's
restart back-off checks again). Where the Node or the slices cannot be read, the check is
logged as skipped: nothing then says that the GPUs are someone else's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpuslice_api.names import DRIVER
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_draplugin.kubeapi import device_fields, read_node
from gpuslice_kube.errors import KubeError
from gpuslice_kube.raw import RawApi, resource_path
from gpuslice_kubelet_plugin.nodemode import refuse
from gpuslice_nvml import Nvml

log = get_logger(__name__)

OPERATOR_MIG_LABEL = "nvidia.com/mig.config"
"""The GPU Operator's (and NVIDIA's mig-manager's) desired MIG layout of a node."""
OPERATOR_MIG_DEPLOY = "nvidia.com/gpu.deploy.mig-manager"
"""The Operator's per-node switch of its MIG manager; ``false`` keeps it off the node."""


def _uuid_values(device: Mapping[str, Any]) -> set[str]:
    """The string values of a device's attributes whose names end in ``uuid``."""
    found = set()
    for name, value in (device_fields(dict(device)).get("attributes") or {}).items():
        if str(name).lower().endswith("uuid") and isinstance(value, Mapping):
            text = value.get("string")
            if isinstance(text, str) and text:
                found.add(text)
    return found


def coexistence_refusal(
    node: Mapping[str, Any], slices: Iterable[Mapping[str, Any]], gpu_uuids: Iterable[str]
) -> str | None:
    """Why the plugin must not serve this node (its Node object, the ResourceSlices of the node,
    its GPUs' UUIDs), or None."""
    meta = node.get("metadata") or {}
    name = meta.get("name", "?")
    labels = meta.get("labels") or {}
    mig = labels.get(OPERATOR_MIG_LABEL)
    if mig is not None and labels.get(OPERATOR_MIG_DEPLOY) != "false":
        return (
            f"node {name} is labelled {OPERATOR_MIG_LABEL}={mig}: the GPU Operator's MIG manager"
            " manages MIG on it and repartitions its GPUs whenever that label changes, also"
            " under gpuslice's claims. Keep the Operator's MIG manager off this node (kubectl"
            f" label node {name} {OPERATOR_MIG_DEPLOY}=false) and set its layout with"
            " gpuslice.dev/mig.config, or remove the label"
            f" (kubectl label node {name} {OPERATOR_MIG_LABEL}-)"
        )
    ours = set(gpu_uuids)
    shared: dict[str, set[str]] = {}
    for obj in slices:
        spec = obj.get("spec") or {}
        driver = spec.get("driver")
        if not driver or driver == DRIVER:
            continue
        for device in spec.get("devices") or []:
            common = _uuid_values(device) & ours
            if common:
                shared.setdefault(str(driver), set()).update(common)
    if shared:
        listed = "; ".join(f"{d}: {', '.join(sorted(u))}" for d, u in sorted(shared.items()))
        return (
            f"another DRA driver publishes GPUs of node {name} in its ResourceSlices ({listed}),"
            " and a GPU published by two drivers can be given to two claims. Run one driver per"
            " node: keep the other driver's kubelet plugin off this node, or gpuslice's (the"
            " chart's node.nodeSelector or node.affinity)"
        )
    return None


def _gpu_uuids(nvml: Nvml) -> set[str]:
    try:
        return {gpu.uuid for gpu in nvml.gpus()}
    except GpusliceError:  # a lost GPU: list the others one by one
        found = set()
        for index in range(nvml.device_count()):
            try:
                found.add(nvml.gpu(index).uuid)
            except GpusliceError:
                continue
        return found


def check_coexistence(raw: RawApi, node_name: str, nvml: Nvml, group_version: str) -> None:
    """Raise :class:`NodeRefusedError` (after the log line and the Event) where other GPU
    software manages this node's GPUs; return otherwise."""
    node = read_node(raw, node_name)
    if node is None:
        log.warning("coexistence not checked: cannot read the Node", node=node_name)
        return
    try:
        slices = raw.list(
            resource_path(group_version, "resourceslices"),
            field_selector=f"spec.nodeName={node_name}",
        )["items"]
    except KubeError as exc:
        log.warning("coexistence with other drivers not checked", node=node_name, error=str(exc))
        slices = []
    reason = coexistence_refusal(node, slices, _gpu_uuids(nvml))
    if reason is not None:
        refuse(raw, node, "other GPU software manages this node's GPUs", reason)
