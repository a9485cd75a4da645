"""The kubelet plugin's side of the per-node mode check (``gpuslice_api.nodemode``).

Before it publishes a slice or opens a socket, the plugin reads its Node and refuses a node
whose GPUs the device plugin serves: a log line, a Warning Event ``KubeletPluginRefused`` on the
Node, and :class:`NodeRefusedError` (the command exits 3; the kubelet's restart back-off checks
again). A Node that does not exist, or that the plugin may not read, is not refused: the check
is logged as skipped, since without the Node there is nothing that says the device plugin is
there.
"""

from __future__ import annotations

from typing import Any, NoReturn

from gpuslice_api.nodemode import kubelet_plugin_refusal
from gpuslice_core.errors import FailedPreconditionError
from gpuslice_core.logging import get_logger
from gpuslice_draplugin.kubeapi import read_node
from gpuslice_kube.events import node_event
from gpuslice_kube.raw import RawApi

log = get_logger(__name__)

REFUSED_REASON = "KubeletPluginRefused"
COMPONENT = "gpuslice-kubelet-plugin"


class NodeRefusedError(FailedPreconditionError):
    """This node's GPUs are served by the device plugin."""


def check_node_mode(raw: RawApi, node_name: str) -> None:
    """Raise :class:`NodeRefusedError` (after the log line and the Event) on a device-plugin
    node; return on a DRA node."""
    node = read_node(raw, node_name)
    if node is None:
        log.warning("per-node mode not checked: cannot read the Node", node=node_name)
        return
    reason = kubelet_plugin_refusal(node)
    if reason is not None:
        refuse(raw, node, "this node is in device-plugin mode", reason)


def refuse(raw: RawApi, node: dict[str, Any], what: str, reason: str) -> NoReturn:
    """Refuse ``node``: the error line, the Warning Event on the Node, NodeRefusedError."""
    log.error(f"refusing to start: {what}", reason=reason)
    meta = node.get("metadata") or {}
    node_event(
        raw,
        str(meta.get("name") or ""),
        str(meta.get("uid") or ""),
        type_="Warning",
        reason=REFUSED_REASON,
        message=reason,
        component=COMPONENT,
    )
    raise NodeRefusedError(reason)
