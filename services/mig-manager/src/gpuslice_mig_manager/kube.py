"""The MIG manager's Kubernetes side: its Node's labels in, state label and Events out.

- ``gpuslice.dev/mig.config`` (set by the operator) selects a layout by name.
- ``gpuslice.dev/mig.config.state`` (set by us): ``pending``, ``rebooting``, ``success`` or
  ``failed``, like NVIDIA's ``nvidia.com/mig.config.state``.
- Reasons go into core/v1 Events on the Node (namespace ``default``, where the kubelet puts
  Node events), so ``kubectl describe node`` shows why a layout waits or failed.

Writes go through ``RawApi`` (transient failures retried with backoff); a failure to report is
logged and never stops the MIG work itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from gpuslice_api.names import MIG_CONFIG_LABEL, MIG_STATE_LABEL
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.events import node_event
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kube.reflector import Reflector
from gpuslice_mig_manager.sources import ConfigMapLayouts

#: Event types.
NORMAL, WARNING = "Normal", "Warning"

log = get_logger(__name__)

LABEL_CONFIG = MIG_CONFIG_LABEL
LABEL_STATE = MIG_STATE_LABEL
COMPONENT = "gpuslice-mig-manager"
REPORTING_COMPONENT = "gpu.gpuslice.dev/mig-manager"


class NodeReporter(Protocol):
    """Where the controller reports: the state label and Events on the Node."""

    def set_state(self, state: str | None) -> None:
        """Set the state label; ``None`` removes it."""
        ...

    def event(self, type_: str, reason: str, message: str) -> None: ...


class NullReporter:
    """Used without a Kubernetes API (``--node-name`` unset): reports go to the log only."""

    def set_state(self, state: str | None) -> None:
        log.info("mig config state", state=state)

    def event(self, type_: str, reason: str, message: str) -> None:
        log.info("mig event", type=type_, reason=reason, message=message)


class KubeNode:
    """The state label and Events of one Node."""

    def __init__(self, raw: RawApi, node_name: str) -> None:
        self.raw = raw
        self.node_name = node_name
        self.uid = ""
        self._lock = threading.Lock()

    def set_state(self, state: str | None) -> None:
        patch = {"metadata": {"labels": {LABEL_STATE: state}}}  # null removes it
        try:
            self.raw.patch(resource_path("v1", "nodes", name=self.node_name), patch)
        except GpusliceError as exc:
            log.error(
                "cannot set the state label", node=self.node_name, state=state, error=str(exc)
            )
        else:
            log.info("mig config state", node=self.node_name, state=state)

    def event(self, type_: str, reason: str, message: str) -> None:
        node_event(
            self.raw,
            self.node_name,
            self.uid,
            type_=type_,
            reason=reason,
            message=message,
            component=COMPONENT,
            reporting_component=REPORTING_COMPONENT,
        )
        log.info("event", type=type_, reason=reason, message=message)


def watch_node(
    raw: RawApi, node: KubeNode, on_labels: Callable[[dict[str, str]], None]
) -> Reflector:
    """A reflector on our own Node that hands its labels to ``on_labels`` on every change."""

    def handle(event_type: str, obj: Obj) -> None:
        if event_type == "DELETED":
            return
        meta = obj.get("metadata") or {}
        node.uid = str(meta.get("uid") or "")
        on_labels(dict(meta.get("labels") or {}))

    return Reflector(
        raw,
        resource_path("v1", "nodes"),
        handle,
        field_selector=f"metadata.name={node.node_name}",
    )


def watch_config_map(raw: RawApi, source: ConfigMapLayouts) -> Reflector:
    """A reflector that keeps ``source`` at the ConfigMap's current data."""

    def handle(event_type: str, obj: Obj) -> None:
        source.update(None if event_type == "DELETED" else dict(obj.get("data") or {}))

    return Reflector(
        raw,
        resource_path("v1", "configmaps", namespace=source.namespace),
        handle,
        field_selector=f"metadata.name={source.name}",
    )
