"""What the webhooks need to know about the cluster's GPUs, kept from a watch of ResourceSlices.

Only our driver's slices are watched (field selector ``spec.driver``), and of each only what the
admission checks use: the memory sizes of the whole GPUs on each slice, so a
claim or a translated pod that asks for more memory than any GPU has is refused at the door
instead of waiting forever. Nothing that can be derived is kept.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from gpuslice_api.quantity import parse_quantity
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_kube.reflector import Reflector, metadata_only, object_key

log = get_logger(__name__)


@dataclass(frozen=True)
class SliceFacts:
    gpu_memory: frozenset[int]
    """Bytes: the distinct ``memory`` capacities of the whole GPUs (``type: gpu``) on the slice."""


def _value(attribute: Obj | None) -> object:
    if not attribute:
        return None
    for key in ("string", "int", "version", "bool"):
        if key in attribute:
            return attribute[key]
    return None


def slice_facts(obj: Obj, driver: str) -> SliceFacts:
    """The facts of one ResourceSlice (resource.k8s.io v1, v1beta2 or v1beta1)."""
    sizes: set[int] = set()
    for device in (obj.get("spec") or {}).get("devices") or []:
        body = device.get("basic") or device  # v1beta1 nests the device under "basic"
        attributes = body.get("attributes") or {}
        kind = _value(attributes.get("type") or attributes.get(f"{driver}/type"))
        if kind != "gpu":
            continue
        memory = ((body.get("capacity") or {}).get("memory") or {}).get("value")
        if memory is None:
            continue
        try:
            sizes.add(int(parse_quantity(memory)))
        except InvalidArgumentError:
            log.warning(
                "slice publishes an unreadable memory capacity",
                slice=obj["metadata"]["name"],
                device=device.get("name"),
                value=memory,
            )
    return SliceFacts(frozenset(sizes))


class GpuInventory:
    """Our driver's ResourceSlices, reduced to ``SliceFacts``, and what they add up to."""

    def __init__(self, raw: RawApi, *, driver: str, version: str) -> None:
        self.driver = driver
        self._facts: dict[str, SliceFacts] = {}
        self._sizes: frozenset[int] | None = frozenset()  # None: recompute on the next read
        self._lock = threading.Lock()
        self.reflector = Reflector(
            raw,
            f"/apis/resource.k8s.io/{version}/resourceslices",
            self._on_event,
            field_selector=f"spec.driver={driver}",
            keep=metadata_only,  # the facts are kept here; whole slices are not
        )

    def _on_event(self, event_type: str, obj: Obj) -> None:
        key = object_key(obj)
        with self._lock:
            if event_type == "DELETED":
                self._facts.pop(key, None)
            else:
                self._facts[key] = slice_facts(obj, self.driver)
            self._sizes = None

    def start(self) -> None:
        self.reflector.start()

    def stop(self) -> None:
        self.reflector.stop()

    def synced(self) -> bool:
        return self.reflector.synced.is_set()

    def gpu_memory_sizes(self) -> frozenset[int]:
        """The distinct memory sizes (bytes) of the whole GPUs our driver publishes (computed
        once per change of the slices, not per admission review)."""
        with self._lock:
            if self._sizes is None:
                self._sizes = frozenset().union(*(f.gpu_memory for f in self._facts.values()))
            return self._sizes

    def max_gpu_memory(self) -> int | None:
        """Bytes of the largest GPU our driver publishes; None when it publishes none (yet)."""
        return max(self.gpu_memory_sizes(), default=None)
