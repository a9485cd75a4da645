"""The API calls a kubelet makes, on top of ``RawApi`` (raw JSON, retries on transient errors).

Only what the node agent needs: its Node and Lease, the pods bound to it and their status,
the claims they reference, Events, and the deletions a kubelet sends (pod with grace 0 and a
UID precondition, the node's ResourceSlices by field selector).
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from typing import Any

from gpuslice_kube.raw import STRATEGIC_PATCH, Obj, RawApi, resource_path

RESOURCE_GV = "resource.k8s.io/v1"
_event_seq = itertools.count()


def now_rfc3339() -> str:
    """``metav1.Time``: seconds precision, UTC."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """``metav1.MicroTime`` (Lease renewTime, Event eventTime)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeletApi:
    """One node's view of the API, with a correlator that folds repeated Events into a count."""

    def __init__(self, raw: RawApi, node_name: str) -> None:
        self.raw = raw
        self.node_name = node_name
        self._events: dict[tuple[str, str, str, str], tuple[str, str, int]] = {}
        self._events_lock = threading.Lock()

    # ---- nodes and leases -----------------------------------------------------------------
    def node_path(self, status: bool = False) -> str:
        path = resource_path("v1", "nodes", name=self.node_name)
        return path + "/status" if status else path

    def patch_node_status(self, patch: Obj) -> Obj:
        return self.raw.patch(self.node_path(status=True), patch, content_type=STRATEGIC_PATCH)

    def lease_path(self, name: bool = True) -> str:
        return resource_path(
            "coordination.k8s.io/v1",
            "leases",
            namespace="kube-node-lease",
            name=self.node_name if name else None,
        )

    # ---- pods ------------------------------------------------------------------------------
    @staticmethod
    def pod_path(namespace: str, name: str, sub: str = "") -> str:
        path = resource_path("v1", "pods", namespace=namespace, name=name)
        return f"{path}/{sub}" if sub else path

    def patch_pod_status(self, pod: Obj, status: Obj) -> Obj:
        """Strategic-merge PATCH of ``pods/<n>/status`` carrying ``metadata.uid``: if the pod
        was replaced by one with another UID the server refuses (UID is immutable)."""
        meta = pod["metadata"]
        body = {"metadata": {"uid": meta["uid"]}, "status": status}
        return self.raw.patch(
            self.pod_path(meta["namespace"], meta["name"], "status"),
            body,
            content_type=STRATEGIC_PATCH,
        )

    def delete_pod_finally(self, pod: Obj) -> None:
        """What the kubelet sends once a deleted pod is terminal: grace 0, UID precondition."""
        meta = pod["metadata"]
        self.raw.delete(
            self.pod_path(meta["namespace"], meta["name"]),
            precondition_uid=meta["uid"],
            grace_period_seconds=0,
        )

    # ---- DRA -------------------------------------------------------------------------------
    def get_claim(self, namespace: str, name: str) -> Obj:
        return self.raw.get(
            resource_path(RESOURCE_GV, "resourceclaims", namespace=namespace, name=name)
        )

    def delete_slices(self, driver: str | None = None) -> None:
        """DeleteCollection of this node's ResourceSlices (of one driver, or all of them)."""
        selector = f"spec.nodeName={self.node_name}"
        if driver:
            selector += f",spec.driver={driver}"
        self.raw.delete_collection(
            resource_path(RESOURCE_GV, "resourceslices"), field_selector=selector
        )

    # ---- events ----------------------------------------------------------------------------
    def event(
        self, obj: Obj, event_type: str, reason: str, message: str, field_path: str = ""
    ) -> None:
        """Record a core/v1 Event as the kubelet's recorder does (source kubelet/<node>);
        an identical repeat within the agent's life bumps ``count`` and ``lastTimestamp``."""
        meta = obj["metadata"]
        namespace = meta.get("namespace") or "default"
        key = (meta.get("uid", ""), event_type, reason, message)
        stamp = now_rfc3339()
        with self._events_lock:
            known = self._events.get(key)
        if known is not None:
            ns, name, count = known
            try:
                self.raw.patch(
                    resource_path("v1", "events", namespace=ns, name=name),
                    {"count": count + 1, "lastTimestamp": stamp},
                )
                with self._events_lock:
                    self._events[key] = (ns, name, count + 1)
                return
            except Exception:
                pass
        name = f"{meta['name']}.{time.time_ns():x}{next(_event_seq)}"
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", "v1"),
                "kind": obj.get("kind", "Pod"),
                "namespace": meta.get("namespace"),
                "name": meta["name"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
                **({"fieldPath": field_path} if field_path else {}),
            },
            "reason": reason,
            "message": message,
            "type": event_type,
            "source": {"component": "kubelet", "host": self.node_name},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": "kubelet",
            "reportingInstance": self.node_name,
        }
        self.raw.create(resource_path("v1", "events", namespace=namespace), body)
        with self._events_lock:
            self._events[key] = (namespace, name, 1)
