"""NVIDIA's ``timeSlicingConfig.interval`` honoured at prepare: the GPU's compute time slice is set
(on the fake node, as ``nvidia-smi compute-policy --set-timeslice`` sets a real one), a second
claim asking the same GPU for another interval is refused naming both, the last claim's
unprepare puts the GPU back to Default, and a restart after kill -9 finishes what a dead
instance left — the plugin in-process over the real DRA socket, claims in the sandbox's API."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.support.kubelet_plugin import ClaimMaker
from gpuslice_kube.raw import Obj
from gpuslice_kubelet_plugin.checkpoint import (
    ClaimRecord,
    DeviceRecord,
    PluginState,
    open_store,
)
from gpuslice_nvml.types import TIME_SLICES
from gpuslice_testkit.kubelet_plugin.dra import gpu_config, ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness, Node, Running

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)

NV = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
SHARES = (
    "6a1d3f0e-7c2b-4e9a-8f1d-2b3c4d5e6f70",
    "6a1d3f0e-7c2b-4e9a-8f1d-2b3c4d5e6f71",
    "6a1d3f0e-7c2b-4e9a-8f1d-2b3c4d5e6f72",
)


def time_sliced(interval: str) -> Obj:
    params = {
        **NV,
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}},
    }
    return gpu_config(params)


def share_claim(
    claims: ClaimMaker, name: str, node_name: str, interval: str, share: int, gpu: str = "gpu-1"
) -> Obj:
    """A 30 % / 20Gi share of ``gpu`` whose NVIDIA config asks for ``interval``."""
    return claims(
        name,
        results=[result(gpu, pool=node_name, cores="30", memory="20Gi", share_id=SHARES[share])],
        config=[time_sliced(interval)],
    )


def slice_of(node: Node, gpu: int) -> int:
    """The fake GPU's time slice, as ``nvidia-smi compute-policy`` would show it."""
    return node.control.state().gpus[gpu].time_slice


def uid(claim: Obj) -> str:
    return str(claim["metadata"]["uid"])


def test_the_interval_is_set_conflicts_are_refused_and_the_last_unprepare_restores_default(
    plugin: Running, claims: ClaimMaker, fake_node: Node, node_name: str, namespace: str
) -> None:
    gpu1 = fake_node.nvml.gpu(1)
    assert slice_of(fake_node, 1) == TIME_SLICES["Default"]

    long = share_claim(claims, "long", node_name, "Long", 0)
    assert plugin.client.prepare([ref(long)])[uid(long)].error == ""
    assert slice_of(fake_node, 1) == TIME_SLICES["Long"]
    record = plugin.state.committer.read().claims[uid(long)]
    assert [d.time_slice for d in record.devices] == ["Long"]  # what teardown will undo
    # idempotent: the repeat changes nothing
    assert plugin.client.prepare([ref(long)])[uid(long)].error == ""

    short = share_claim(claims, "short", node_name, "Short", 1)
    error = plugin.client.prepare([ref(short)])[uid(short)].error
    assert (
        f"request gpu: resource.nvidia.com/v1beta1 GpuConfig sharing.timeSlicingConfig.interval"
        f" 'Short' for GPU {gpu1.uuid} (gpu-1) conflicts with 'Long', which ResourceClaim"
        f" {namespace}/long set on it"
    ) in error
    assert uid(short) not in plugin.state.committer.read().claims
    assert slice_of(fake_node, 1) == TIME_SLICES["Long"]

    also_long = share_claim(claims, "also-long", node_name, "Long", 2)
    assert plugin.client.prepare([ref(also_long)])[uid(also_long)].error == ""

    # the first claim goes: the other still holds Long; the last one goes: Default again
    assert plugin.client.unprepare([ref(long)]) == {uid(long): ""}
    assert slice_of(fake_node, 1) == TIME_SLICES["Long"]
    assert plugin.client.unprepare([ref(also_long)]) == {uid(also_long): ""}
    assert slice_of(fake_node, 1) == TIME_SLICES["Default"]
    # now the GPU takes the interval the refused claim asked for
    assert plugin.client.prepare([ref(short)])[uid(short)].error == ""
    assert slice_of(fake_node, 1) == TIME_SLICES["Short"]


def test_a_claim_without_an_interval_leaves_the_gpus_time_slice_alone(
    plugin: Running, claims: ClaimMaker, fake_node: Node, node_name: str
) -> None:
    fake_node.nvml.set_compute_time_slice(0, TIME_SLICES["Medium"])  # set by an operator
    plain = claims(
        "plain",
        results=[result("gpu-0", pool=node_name)],
        config=[gpu_config({**NV, "sharing": {"strategy": "TimeSlicing"}})],
    )
    assert plugin.client.prepare([ref(plain)])[uid(plain)].error == ""
    assert plugin.client.unprepare([ref(plain)]) == {uid(plain): ""}
    assert slice_of(fake_node, 0) == TIME_SLICES["Medium"]


def _record(uid: str, state: str, pool: str, gpu_uuid: str, interval: str) -> ClaimRecord:
    return ClaimRecord(
        uid=uid,
        namespace="ns",
        name=f"claim-{uid}",
        state=state,  # type: ignore[arg-type]
        owner="dead-1",
        devices=[
            DeviceRecord(
                request="gpu",
                pool=pool,
                device="gpu-0",
                gpu_uuid=gpu_uuid,
                uuid=gpu_uuid,
                cores=30,
                shared=True,
                time_slice=interval,
            )
        ],
    )


@pytest.mark.parametrize(
    ("left", "after"),
    [
        # killed after nvidia-smi set the slice, before the record said PrepareCompleted
        ({"started": "PrepareStarted"}, "Default"),
        # killed mid-unprepare, before the slice was put back
        ({"leaving": "UnprepareStarted"}, "Default"),
        # a completed claim stays prepared, and so does its GPU's slice
        ({"done": "PrepareCompleted", "started": "PrepareStarted"}, "Long"),
    ],
    ids=["prepare-started", "unprepare-started", "completed-kept"],
)
def test_after_kill_9_a_restart_puts_back_what_a_dead_instance_left(
    harness: Harness,
    fake_node: Node,
    node_name: str,
    left: dict[str, str],
    after: str,
    tmp_path: Path,
) -> None:
    gpu0 = fake_node.nvml.gpu(0)
    fake_node.nvml.set_compute_time_slice(0, TIME_SLICES["Long"])  # the dead instance set it
    state = PluginState(
        claims={u: _record(u, s, node_name, gpu0.uuid, "Long") for u, s in left.items()}
    )
    open_store(harness.settings().state_dir, boot_id="boot-1").save(state)

    plugin = harness.start()

    kept = sorted(u for u, s in left.items() if s == "PrepareCompleted")
    assert sorted(plugin.state.committer.read().claims) == kept
    assert slice_of(fake_node, 0) == TIME_SLICES[after]
