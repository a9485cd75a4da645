"""``gpuslice_kubelet_plugin_device_info`` of a plugin in-process on a fake node: one series per
device that exists, with the GPU instance id NVML reports, and the join it is for — its
``dra_device``, with the node as ``Hostname`` (what the node monitor's relabelling gives it),
labels the same device as the controller's series do, read from the slices it published."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import delete_node_slices, node_slices
from e2e.sandbox.nodeagent.testing import wait_for
from e2e.support.kubelet_plugin import ClaimMaker
from gpuslice_controller.view.metrics import DEVICE_LABELS, device_labels
from gpuslice_kube.raw import RawApi
from gpuslice_nvml import open_nvml
from gpuslice_testkit.kubelet_plugin.dra import ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness, Node, Running, write_node
from gpuslice_testkit.kubelet_plugin.standins import StandinMigManager
from gpuslice_view.objects import slice_from

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)

INFO = "gpuslice_kubelet_plugin_device_info"
Labels = dict[str, str]


def device_info(plugin: Running) -> dict[str, Labels]:
    """The plugin's ``device_info`` series as a scrape gives them, by ``dra_device``."""
    found: dict[str, Labels] = {}
    for family in plugin.app.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == INFO:
                assert sample.value == 1
                found[sample.labels["dra_device"]] = sample.labels
    return found


def controller_labels(kube: RawApi, node: str, count: int) -> dict[str, Labels]:
    """The controller's ``DEVICE_LABELS`` of each device the node's slices publish (once
    there are ``count``), by ``dra_device``."""

    def published() -> dict[str, Labels] | None:
        contents = [slice_from(s) for s in node_slices(kube, node)]
        devices = [d for c in contents if c is not None for d in c.devices]
        labels = [
            dict(zip(DEVICE_LABELS, device_labels(d, d.node, d.name), strict=True)) for d in devices
        ]
        return {lb["dra_device"]: lb for lb in labels} if len(labels) == count else None

    return wait_for(published, 10, f"{count} published devices")


def joined(row: Labels, node: str) -> Labels:
    """What ``on (Hostname, dra_device) group_left (GPU_I_ID)`` matches on the controller's
    side: the row with its node, less the GPU instance id the controller does not know."""
    return {"Hostname": node, **{k: v for k, v in row.items() if k != "GPU_I_ID"}}


def test_static_devices_join_the_controllers_series(
    plugin: Running, fake_node: Node, node_name: str, kube: RawApi
) -> None:
    rows = device_info(plugin)
    assert sorted(rows) == ["gpu-0", "gpu-1", "gpu-2-mig-1g-10gb-0", "gpu-2-mig-3g-40gb-4"]
    assert rows["gpu-0"]["GPU_I_ID"] == rows["gpu-0"]["GPU_I_PROFILE"] == ""
    migs = {m.placement.start: m for m in fake_node.nvml.mig_devices(2)}
    assert rows["gpu-2-mig-1g-10gb-0"]["GPU_I_ID"] == str(migs[0].gpu_instance_id)
    assert rows["gpu-2-mig-3g-40gb-4"]["GPU_I_ID"] == str(migs[4].gpu_instance_id)
    controller = controller_labels(kube, node_name, len(rows))
    assert {name: joined(row, node_name) for name, row in rows.items()} == controller


@pytest.fixture
def dyn(sandbox: ControlPlane, kube: RawApi, short_dir: Path, node_name: str) -> Iterator[Running]:
    config = write_node(short_dir, [{"model": "H100", "count": 2, "migEnabled": True}], "dyn")
    with open_nvml("fake", config) as nvml, open_nvml("fake", config) as manager_nvml:
        mig = StandinMigManager(manager_nvml).serve(short_dir / "mig.sock")
        harness = Harness(short_dir, sandbox.kubeconfig, nvml, node_name=node_name)
        try:
            yield harness.start(dynamic_mig=True, mig_manager_socket=short_dir / "mig.sock")
        finally:
            harness.stop_all()
            mig.stop()
            delete_node_slices(kube, node_name)


def test_a_dynamic_mig_device_has_a_series_from_prepare_to_unprepare(
    dyn: Running, claims: ClaimMaker, node_name: str, kube: RawApi
) -> None:
    name = "gpu-1-mig-3g-40gb-4"
    assert device_info(dyn) == {}  # placements, no instance
    claim = claims("m", results=[result(name, pool=node_name)])
    uid = claim["metadata"]["uid"]
    assert dyn.client.prepare([ref(claim)])[uid].error == ""

    [instance] = dyn.app.nvml.mig_devices(1)
    row = device_info(dyn)[name]
    assert row["GPU_I_ID"] == str(instance.gpu_instance_id)
    assert row["UUID"] == dyn.app.nvml.gpu(1).uuid and row["GPU_I_PROFILE"] == "3g.40gb"
    assert (
        joined(row, node_name)
        == controller_labels(kube, node_name, len(dyn.app.devices.inventory.devices))[name]
    )

    assert dyn.client.unprepare([ref(claim)]) == {uid: ""}
    assert dyn.app.nvml.mig_devices(1) == [] and device_info(dyn) == {}
