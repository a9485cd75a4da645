"""The per-node mode: a node's GPUs are served by DRA or by the device plugin, never both.

Two allocators over one GPU over-admit it, so the chart picks one per node by the label
``gpuslice.dev/mode`` (``device-plugin``: the device plugin's DaemonSet; anything else or no
label: the node DaemonSet with the DRA kubelet plugin), and each service checks the other side
of that rule against the API server at start and refuses to serve when it fails:

- the device plugin refuses a node that is not labelled ``device-plugin``, or for which the DRA
  driver still publishes ResourceSlices (``gpuslice_device_plugin.node``);
- the kubelet plugin refuses a node that is labelled ``device-plugin``, or whose capacity shows
  GPUs served by a device plugin, ours or NVIDIA's (:func:`kubelet_plugin_refusal`).

A refusal is a log line, a Warning Event on the Node and exit status 3; the kubelet's restart
back-off checks again, so a node being switched from one mode to the other starts by itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuslice_api.names import MODE_LABEL

MODE_DEVICE_PLUGIN = "device-plugin"
EXIT_REFUSED = 3
"""Exit status of a service that refused a node (2: bad configuration, 1: failure)."""


def device_plugin_resources(capacity: Mapping[str, Any]) -> dict[str, str]:
    """The GPU resources a device plugin serves on a node, from ``status.capacity``.

    NVIDIA's plugin and ours both name them ``nvidia.com/gpu``, ``nvidia.com/gpu.shared`` and
    ``nvidia.com/mig-<profile>``. The kubelet keeps a resource in the capacity for 5 minutes after
    its plugin went away and then reports it as 0, so only non-zero counts say that a plugin
    serves (or just served) GPUs. A DeviceClass's
    ``extendedResourceName`` never shows up in a node's capacity: DRA pods asking for
    ``nvidia.com/gpu`` do not count.
    """
    served: dict[str, str] = {}
    for name, value in capacity.items():
        if not (
            name in ("nvidia.com/gpu", "nvidia.com/gpu.shared")
            or name.startswith("nvidia.com/mig-")
        ):
            continue
        if str(value).strip() not in ("", "0"):
            served[name] = str(value)
    return served


def kubelet_plugin_refusal(node: Mapping[str, Any]) -> str | None:
    """Why the DRA kubelet plugin must not serve ``node`` (a Node object), or None."""
    meta = node.get("metadata") or {}
    name = meta.get("name", "?")
    mode = (meta.get("labels") or {}).get(MODE_LABEL)
    if mode == MODE_DEVICE_PLUGIN:
        return (
            f"node {name} is labelled {MODE_LABEL}={MODE_DEVICE_PLUGIN}: the device plugin serves"
            " its GPUs, and the DRA kubelet plugin serves only nodes without that label, so that"
            " no GPU is served by both (remove the label to switch the node to DRA)"
        )
    served = device_plugin_resources((node.get("status") or {}).get("capacity") or {})
    if served:
        listed = ", ".join(f"{k}={v}" for k, v in sorted(served.items()))
        return (
            f"node {name} has {listed} in its capacity: a device plugin (gpuslice's or"
            " NVIDIA's) serves its GPUs, and a GPU must not be served by both; stop the device"
            " plugin on this node first (the kubelet reports the resource as 0 five minutes after)"
        )
    return None


__all__ = [
    "EXIT_REFUSED",
    "MODE_DEVICE_PLUGIN",
    "MODE_LABEL",
    "device_plugin_resources",
    "kubelet_plugin_refusal",
]
