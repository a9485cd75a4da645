"""The plugin's own CDI spec for whole GPUs and MIG devices, and Allocate naming it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuslice_core.cdi import load_spec, resolve
from gpuslice_device_plugin.allocate import container_response
from gpuslice_device_plugin.cdispec import write_spec
from gpuslice_device_plugin.devices import discover
from gpuslice_nvml import Nvml
from gpuslice_testkit.device_plugin import H100_MIXED, settings

pytestmark = pytest.mark.timeout(30)
Factory = Callable[[dict[str, Any]], Nvml]
SPEC = "k8s.gpu.gpuslice.dev-device-plugin-gpu_node.json"
KIND = "k8s.gpu.gpuslice.dev/device-plugin-gpu"


def test_one_spec_with_every_gpu_and_mig_device(fake_node: Factory, tmp_path: Path) -> None:
    nvml = fake_node(H100_MIXED)
    dev = tmp_path / "host"
    (dev / "dev").mkdir(parents=True)
    for name in ("nvidia0", "nvidia2", "nvidiactl", "nvidia-uvm"):  # no nvidia-uvm-tools here
        (dev / "dev" / name).touch()
    root = tmp_path / "cdi"
    ids = write_spec(nvml, root, dev_root=dev)
    assert ids is not None
    spec = load_spec(root / SPEC)
    assert spec.kind == KIND
    gpus = nvml.gpus()
    migs = [m for g in gpus if g.mig_enabled for m in nvml.mig_devices(g.index)]
    assert len(spec.devices) == len(gpus) + len(migs) == 4 + 6
    assert ids[gpus[0].uuid] == [f"{KIND}=node-{gpus[0].uuid}"]
    by_name = {d.name: d.container_edits for d in spec.devices}
    first = by_name[f"node-{gpus[0].uuid}"]
    assert [n.path for n in first.device_nodes] == [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    ]
    assert first.device_nodes[0].host_path == str(dev / "dev" / "nvidia0")
    key = f"NODE_{gpus[0].uuid}".replace("-", "_").upper()
    assert f"GPUSLICE_{key}_UUID={gpus[0].uuid}" in first.env
    assert f"GPUSLICE_{key}_DEVICE=gpu-0" in first.env
    # a MIG device gets its parent's node (GPU 2: minor 2)
    assert migs[0].uuid.startswith("MIG-") and ids[migs[0].uuid] == [f"{KIND}=node-{migs[0].uuid}"]
    assert by_name[f"node-{migs[0].uuid}"].device_nodes[0].path == "/dev/nvidia2"
    # no NVIDIA_VISIBLE_DEVICES in a device: two devices in one container would overwrite it
    assert not any(
        e.startswith("NVIDIA_VISIBLE_DEVICES=") for d in spec.devices for e in d.container_edits.env
    )


def test_rewrite_is_idempotent_and_stale_specs_go(fake_node: Factory, tmp_path: Path) -> None:
    nvml = fake_node({"gpus": [{"model": "L4", "count": 2}]})
    root = tmp_path / "cdi"
    root.mkdir()
    stale = root / "k8s.gpu.gpuslice.dev-device-plugin-gpu_old.json"
    stale.write_text("{}")
    mps = root / "k8s.gpu.gpuslice.dev-device-plugin_gpu.json"  # the MPS replicas' spec stays
    mps.write_text("{}")
    first = write_spec(nvml, root)
    before = (root / SPEC).read_text()
    assert write_spec(nvml, root) == first and (root / SPEC).read_text() == before
    assert not stale.exists() and mps.exists()
    assert not list(root.glob(".*.tmp"))
    # toolkit: the toolkit's names, our spec removed
    assert write_spec(nvml, root, mode="toolkit") is None
    assert not (root / SPEC).exists() and mps.exists()
    both = write_spec(nvml, root, mode="both")
    assert both is not None
    uuid = nvml.gpu(0).uuid
    assert both[uuid] == [f"{KIND}=node-{uuid}", f"nvidia.com/gpu={uuid}"]
    assert json.loads((root / SPEC).read_text())["kind"] == KIND


def test_allocate_names_our_devices_and_the_runtime_resolves_them(
    fake_node: Factory, tmp_path: Path
) -> None:
    nvml = fake_node({"gpus": [{"model": "H100", "count": 4}]})
    ts = "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}]}}"
    [gpu] = discover(nvml, settings(ts))
    ids = write_spec(nvml, tmp_path)
    picked = [gpu.devices[0], gpu.devices[1], gpu.devices[2]]  # two replicas of GPU 0, one of 1
    uuids = [nvml.gpu(0).uuid, nvml.gpu(1).uuid]
    out = container_response(
        gpu,
        picked,
        list_strategies=["cdi-cri", "cdi-annotations"],
        id_strategy="uuid",
        pass_device_specs=False,
        cdi_ids=ids,
    )
    names = [f"{KIND}=node-{u}" for u in uuids]
    assert [c.name for c in out.cdi_devices] == names
    assert dict(out.annotations) == {"cdi.k8s.io/gpuslice-device-plugin_gpu": ",".join(names)}
    assert dict(out.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids)}
    edits = resolve(tmp_path, names, strict=True)  # what a CDI runtime does with them
    assert {e.split("=", 1)[1] for e in edits.env if "_UUID=" in e} == set(uuids)
    # the toolkit's names, as before, when asked for
    old = container_response(
        gpu, picked, list_strategies=["cdi-cri"], id_strategy="index", pass_device_specs=False
    )
    assert [c.name for c in old.cdi_devices] == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    assert not old.envs
