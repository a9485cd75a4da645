"""The Node object and its heartbeats, as the kubelet keeps them.

Registration POSTs the Node (labels, the attach-detach annotation); when it exists already the
labels and annotations are patched onto it. Status is a strategic-merge PATCH of
``nodes/<n>/status``, computed every ``node_status`` seconds and sent when it changed or every
``node_status_report`` seconds. The Lease ``kube-node-lease/<node>`` (owner: the Node) is the
real heartbeat and is renewed every ``lease_renew`` seconds. ``stop()`` stops both, so the node
lifecycle controller turns the node Unknown after its grace period, as for a dead kubelet.
"""

from __future__ import annotations

import platform
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.sandbox.nodeagent.config import NodeConfig
from e2e.sandbox.nodeagent.kubeapi import KubeletApi, now_micro, now_rfc3339
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import ConflictError, KubeAlreadyExistsError, KubeNotFoundError
from gpuslice_kube.raw import Obj, resource_path

log = get_logger(__name__)

RUNTIME_VERSION = "gpuslice-nodeagent://0.1.0"
ExtendedResources = Callable[[], tuple[dict[str, str], dict[str, str]]]

CONDITIONS = (
    (
        "MemoryPressure",
        "False",
        "KubeletHasSufficientMemory",
        "kubelet has sufficient memory available",
    ),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
)


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _read(path: str, default: str) -> str:
    try:
        return Path(path).read_text().strip() or default
    except OSError:
        return default


def _os_image() -> str:
    for line in _read("/etc/os-release", "").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip('"')
    return "Linux"


class NodeReporter:
    """Registers the Node, keeps its status and Lease fresh until ``stop()``."""

    def __init__(
        self,
        api: KubeletApi,
        config: NodeConfig,
        extended: ExtendedResources,
        kubelet_version: str,
        kubelet_port: int,
    ) -> None:
        self.api = api
        self.kubelet_port = kubelet_port
        self.config = config
        self.extended = extended
        self.kubelet_version = kubelet_version
        self.node_uid = ""
        self._system_uuid = str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{config.name}.gpuslice"))
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_sent: Obj | None = None
        self._last_sent_at = 0.0
        self._sent_resources: set[str] = set()
        self._transitions: dict[str, str] = {}

    # ---- registration ---------------------------------------------------------------------
    def labels(self) -> dict[str, str]:
        return {
            "kubernetes.io/hostname": self.config.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": _arch(),
            "beta.kubernetes.io/os": "linux",
            "beta.kubernetes.io/arch": _arch(),
            **self.config.labels,
        }

    def register(self) -> None:
        annotations = {"volumes.kubernetes.io/controller-managed-attach-detach": "true"}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.config.name,
                "labels": self.labels(),
                "annotations": annotations,
            },
            "spec": {"unschedulable": False},
        }
        try:
            created = self.api.raw.create(resource_path("v1", "nodes"), node)
        except KubeAlreadyExistsError:
            created = self.api.raw.patch(
                self.api.node_path(),
                {"metadata": {"labels": self.labels(), "annotations": annotations}},
            )
        self.node_uid = created["metadata"]["uid"]
        log.info("node registered", node=self.config.name, uid=self.node_uid)

    # ---- status ------------------------------------------------------------------------------
    def _resources(self) -> tuple[dict[str, Any], dict[str, Any]]:
        base = {
            "cpu": self.config.cpu,
            "memory": self.config.memory,
            "ephemeral-storage": self.config.ephemeral_storage,
            "pods": str(self.config.pods),
        }
        ext_capacity, ext_allocatable = self.extended()
        capacity: dict[str, Any] = {**base, **ext_capacity}
        allocatable: dict[str, Any] = {**base, **ext_allocatable}
        for name in self._sent_resources - set(capacity):  # a resource that went away
            capacity[name] = None
            allocatable[name] = None
        return capacity, allocatable

    def desired_status(self) -> Obj:
        capacity, allocatable = self._resources()
        return {
            "capacity": capacity,
            "allocatable": allocatable,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                # every sandbox node is this machine; the API server dials the first of
                # Hostname/InternalIP for kubectl logs, so it must resolve to loopback
                {"type": "Hostname", "address": "localhost"},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {
                "machineID": _read("/etc/machine-id", self._system_uuid.replace("-", "")),
                "systemUUID": self._system_uuid,
                "bootID": _read("/proc/sys/kernel/random/boot_id", ""),
                "kernelVersion": platform.release(),
                "osImage": _os_image(),
                "containerRuntimeVersion": RUNTIME_VERSION,
                "kubeletVersion": self.kubelet_version,
                "operatingSystem": "linux",
                "architecture": _arch(),
            },
        }

    def _conditions(self) -> list[Obj]:
        now = now_rfc3339()
        out = []
        for ctype, status, reason, message in CONDITIONS:
            since = self._transitions.setdefault(f"{ctype}={status}", now)
            out.append(
                {
                    "type": ctype,
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": since,
                }
            )
        return out

    def sync_status(self, force: bool = False) -> bool:
        """Send the status if it changed (or ``force``/report period); True when sent."""
        desired = self.desired_status()
        due = self._last_sent_at + self.config.timings.node_status_report
        if not force and desired == self._last_sent and time.monotonic() < due:
            return False
        patch = dict(desired)
        patch["conditions"] = self._conditions()
        self.api.patch_node_status({"status": patch})
        self._last_sent = desired
        self._last_sent_at = time.monotonic()
        self._sent_resources = {k for k, v in desired["capacity"].items() if v is not None}
        return True

    def poke(self) -> None:
        """Compute the status now (device-plugin resources changed)."""
        self._poke.set()

    # ---- lease -------------------------------------------------------------------------------
    def renew_lease(self) -> None:
        spec = {
            "holderIdentity": self.config.name,
            "leaseDurationSeconds": self.config.timings.lease_duration,
            "renewTime": now_micro(),
        }
        try:
            lease = self.api.raw.get(self.api.lease_path())
        except KubeNotFoundError:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": self.config.name,
                    "namespace": "kube-node-lease",
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Node",
                            "name": self.config.name,
                            "uid": self.node_uid,
                        }
                    ],
                },
                "spec": spec,
            }
            self.api.raw.create(self.api.lease_path(name=False), body)
            return
        lease["spec"] = {**lease.get("spec", {}), **spec}
        try:
            self.api.raw.replace(self.api.lease_path(), lease)
        except ConflictError:
            self.renew_lease()

    # ---- loops -------------------------------------------------------------------------------
    def start(self) -> None:
        self.register()
        self.sync_status(force=True)
        self.renew_lease()
        self._spawn("lease", self._lease_loop)
        self._spawn("node-status", self._status_loop)

    def _spawn(self, what: str, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name=f"{self.config.name}-{what}", daemon=True)
        t.start()
        self._threads.append(t)

    def _lease_loop(self) -> None:
        while not self._stop.wait(self.config.timings.lease_renew):
            try:
                self.renew_lease()
            except Exception as exc:
                log.warning("lease renewal failed", node=self.config.name, error=str(exc))

    def _status_loop(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(self.config.timings.node_status)
            self._poke.clear()
            if self._stop.is_set():
                return
            try:
                self.sync_status()
            except Exception as exc:
                log.warning("node status update failed", node=self.config.name, error=str(exc))

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        for t in self._threads:
            t.join(timeout=10)
