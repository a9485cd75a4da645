"""The slice inventory: GPU memory sizes from our driver's ResourceSlices, kept per change."""

from __future__ import annotations

from typing import Any, cast

from gpuslice_controller.admission.inventory import GpuInventory, slice_facts
from gpuslice_kube.raw import RawApi

GIB = 1024**3


def slice_(name: str, *devices: tuple[str, str], v1beta1: bool = False) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for kind, memory in devices:
        body = {"attributes": {"type": {"string": kind}}, "capacity": {"memory": {"value": memory}}}
        out.append({"name": f"d{len(out)}", **({"basic": body} if v1beta1 else body)})
    return {"metadata": {"name": name, "resourceVersion": "1"}, "spec": {"devices": out}}


def test_whole_gpu_sizes_in_every_version_and_mig_devices_ignored() -> None:
    facts = slice_facts(slice_("a", ("gpu", "40Gi"), ("mig", "5Gi"), ("gpu", "80Gi")), "d")
    assert facts.gpu_memory == {40 * GIB, 80 * GIB}
    old = slice_facts(slice_("b", ("gpu", "24Gi"), v1beta1=True), "d")
    assert old.gpu_memory == {24 * GIB}


def test_sizes_follow_added_changed_and_deleted_slices() -> None:
    inventory = GpuInventory(cast(RawApi, None), driver="gpu.gpuslice.dev", version="v1")
    assert inventory.gpu_memory_sizes() == frozenset() and inventory.max_gpu_memory() is None
    inventory._on_event("ADDED", slice_("n1", ("gpu", "40Gi")))
    inventory._on_event("ADDED", slice_("n2", ("gpu", "80Gi")))
    assert inventory.max_gpu_memory() == 80 * GIB
    inventory._on_event("MODIFIED", slice_("n2", ("gpu", "24Gi")))
    assert inventory.gpu_memory_sizes() == {40 * GIB, 24 * GIB}
    inventory._on_event("DELETED", slice_("n1"))
    assert inventory.gpu_memory_sizes() == {24 * GIB}
    assert inventory.max_gpu_memory() == 24 * GIB
