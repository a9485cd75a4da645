"""``gpuslice_kubelet_plugin_device_info`` as a scrape shows it: one series per device that
exists, with the GPU instance id NVML reports, gone when the instance is."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord, PluginState
from gpuslice_kubelet_plugin.discovery import discover
from gpuslice_kubelet_plugin.metrics import PluginMetrics
from gpuslice_kubelet_plugin.state import device_rows
from gpuslice_nvml import Nvml, Placement, open_nvml
from gpuslice_testkit.kubelet_plugin.harness import Node, write_node

INFO = "gpuslice_kubelet_plugin_device_info"


def series(metrics: PluginMetrics) -> list[str]:
    """The ``device_info`` lines of a scrape."""
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if line.startswith(INFO + "{")]


def test_whole_gpus_and_static_mig_devices_have_a_series_each(node: Node) -> None:
    nvml = node.nvml
    metrics = PluginMetrics(devices=lambda: device_rows(discover(nvml), PluginState()))
    gpu0, gpu2 = nvml.gpu(0).uuid, nvml.gpu(2).uuid
    small = next(m for m in nvml.mig_devices(2) if m.profile == "1g.10gb")
    assert metrics.registry.get_sample_value(
        INFO, {"gpu": "0", "UUID": gpu0, "GPU_I_PROFILE": "", "GPU_I_ID": "", "dra_device": "gpu-0"}
    )
    labels = {
        "gpu": "2",
        "UUID": gpu2,
        "GPU_I_PROFILE": "1g.10gb",
        "GPU_I_ID": str(small.gpu_instance_id),
        "dra_device": "gpu-2-mig-1g-10gb-0",
    }
    assert metrics.registry.get_sample_value(INFO, labels) == 1
    assert len(series(metrics)) == 4  # gpu-0, gpu-1 and the two instances of GPU 2

    # the MIG manager destroys the 1g instance; the next rescan no longer has it
    nvml.destroy_compute_instance(2, small.gpu_instance_id, small.compute_instance_id)
    nvml.destroy_gpu_instance(2, small.gpu_instance_id)
    assert metrics.registry.get_sample_value(INFO, labels) is None
    assert [s for s in series(metrics) if "mig" in s] == [
        f'{INFO}{{GPU_I_ID="{m.gpu_instance_id}",GPU_I_PROFILE="3g.40gb",UUID="{gpu2}",'
        f'dra_device="gpu-2-mig-3g-40gb-4",gpu="2"}} 1.0'
        for m in nvml.mig_devices(2)
    ]


def _create(nvml: Nvml, gpu: int, profile: str, start: int) -> int:
    """A GPU instance and its compute instance, as the MIG manager makes them at prepare."""
    shape = next(p for p in nvml.gpu_instance_profiles(gpu) if p.name == profile)
    gi = nvml.create_gpu_instance(gpu, shape.id, Placement(start, shape.placements[0].size))
    ci = next(p for p in nvml.compute_instance_profiles(gpu, gi.id) if p.name == profile)
    nvml.create_compute_instance(gpu, gi.id, ci.id)
    return gi.id


def test_a_dynamic_mig_device_has_a_series_while_a_claim_holds_its_instance(
    tmp_path: Path,
) -> None:
    config = write_node(tmp_path, [{"model": "H100", "count": 1, "migEnabled": True}], "dyn")
    with open_nvml("fake", config) as nvml:
        inventory = discover(nvml, dynamic_mig_enabled=True)
        state = PluginState()
        metrics = PluginMetrics(devices=lambda: device_rows(inventory, state))
        assert series(metrics) == []  # placements are not instances

        gi = _create(nvml, 0, "3g.40gb", 4)
        state.claims["uid-1"] = ClaimRecord(
            uid="uid-1",
            namespace="ns",
            name="c",
            state="PrepareCompleted",
            owner="me",
            devices=[
                DeviceRecord(
                    request="r",
                    pool="node",
                    device="gpu-0-mig-3g-40gb-4",
                    kind="mig",
                    gpu_uuid=nvml.gpu(0).uuid,
                    gpu_instance_id=gi,
                )
            ],
        )
        [instance] = nvml.mig_devices(0)
        assert series(metrics) == [
            f'{INFO}{{GPU_I_ID="{instance.gpu_instance_id}",GPU_I_PROFILE="3g.40gb",'
            f'UUID="{nvml.gpu(0).uuid}",dra_device="gpu-0-mig-3g-40gb-4",gpu="0"}} 1.0'
        ]
        del state.claims["uid-1"]  # unprepared (and the instance destroyed)
        assert series(metrics) == []
