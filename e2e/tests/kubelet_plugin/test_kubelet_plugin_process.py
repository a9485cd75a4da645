"""The plugin as a real process against the sandbox's API server: a clean stop on SIGTERM, and
kill -9 in the middle of a prepare loop (with an enforcer, so each prepare has side effects
outside the node's files) followed by a restart — no claim lost, none prepared twice."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import delete_node_slices, node_slices
from e2e.sandbox.nodeagent.testing import wait_event, wait_for
from e2e.support.kubelet_plugin import ClaimMaker, Processes
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.core import ServiceExitedError
from gpuslice_testkit.kubelet_plugin.dra import (
    ClaimAnswer,
    ClaimTuple,
    DraClient,
    ref,
    result,
)
from gpuslice_testkit.kubelet_plugin.harness import Node
from gpuslice_testkit.kubelet_plugin.process import PluginProcess
from gpuslice_testkit.kubelet_plugin.standins import StandinEnforcer

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)


@pytest.fixture
def processes(
    sandbox: ControlPlane, kube: RawApi, short_dir: Path, fake_node: Node, node_name: str
) -> Iterator[Processes]:
    made = Processes(sandbox, short_dir, fake_node, node_name)
    yield made
    for p in made.started:
        p.stop()
    delete_node_slices(kube, node_name)


@pytest.mark.timeout(60)
def test_sigterm_stops_cleanly(processes: Processes) -> None:
    plugin = processes.start()
    assert plugin.terminate() == 0
    assert not plugin.sockets.registration.exists()
    assert not plugin.sockets.dra.exists()
    assert "kubelet plugin stopped" in plugin.log.read_text()


@pytest.mark.timeout(90)
def test_a_device_plugin_node_refuses_the_kubelet_plugin(
    processes: Processes, kube: RawApi, node_name: str
) -> None:
    nodes = resource_path("v1", "nodes")
    labelled: Obj = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node_name, "labels": {"gpuslice.dev/mode": "device-plugin"}},
    }
    kube.create(nodes, labelled)
    try:
        with pytest.raises(ServiceExitedError, match="exited with 3"):
            processes.start()
        event = wait_event(kube, "default", node_name, "KubeletPluginRefused")
        assert event["type"] == "Warning"
        assert event["involvedObject"]["kind"] == "Node"
        assert f"node {node_name} is labelled gpuslice.dev/mode=device-plugin" in event["message"]
        assert node_slices(kube, node_name) == []  # refused before publishing anything

        # no label, but a device plugin's GPUs in the capacity (NVIDIA's, say)
        node = resource_path("v1", "nodes", name=node_name)
        kube.patch(node, {"metadata": {"labels": {"gpuslice.dev/mode": None}}})
        status = {"status": {"capacity": {"nvidia.com/gpu": "8"}}}
        kube.patch(f"{node}/status", status)
        with pytest.raises(ServiceExitedError, match="exited with 3"):
            processes.start()
        assert "has nvidia.com/gpu=8 in its capacity" in processes.started[-1].tail()

        # the device plugin is gone for good: the kubelet reports 0, and the plugin starts
        kube.patch(f"{node}/status", {"status": {"capacity": {"nvidia.com/gpu": "0"}}})
        processes.start()
    finally:
        kube.delete(resource_path("v1", "nodes", name=node_name))


@pytest.mark.timeout(90)
def test_kill_9_in_the_middle_of_a_prepare_loop_loses_nothing(
    processes: Processes, claims: ClaimMaker, short_dir: Path, node_name: str
) -> None:
    # a slow enforcer keeps each prepare inside its side effects for a while
    enforcer = StandinEnforcer(delay=0.03).serve(short_dir / "enforcer.sock")
    enforcer_flag = ("--enforcer-socket", str(short_dir / "enforcer.sock"))
    refs = []
    for i in range(30):
        claim = claims(
            f"c{i}", results=[result(f"gpu-{i % 2}", pool=node_name, cores="2", memory="1Gi")]
        )
        refs.append(ref(claim))
    acked: dict[str, ClaimAnswer] = {}
    interrupted = 0
    rng = random.Random(7)
    try:
        for _round in range(4):
            plugin = processes.start(*enforcer_flag)
            pending = [c for c in refs if c[2] not in acked]
            if not pending:
                break
            stop = threading.Event()
            loop = threading.Thread(target=_prepare_loop, args=(plugin, pending, acked, stop))
            # kill while the k-th prepare of this round is inside CreateShare: its intent is
            # in the checkpoint, its share may or may not exist, its CDI spec does not
            target = enforcer.arrivals + rng.randint(1, 6)
            loop.start()
            wait_for(partial(arrived, enforcer, target), 20, f"CreateShare call #{target}")
            plugin.kill9()
            stop.set()
            loop.join(10)
            interrupted += sum(
                r["state"] != "PrepareCompleted" for r in plugin.checkpoint_claims().values()
            )
        print(f"kills that landed mid-prepare: {interrupted}; acknowledged: {len(acked)}")
        assert interrupted > 0, "no kill landed in the middle of a prepare"

        plugin = processes.start(*enforcer_flag)
        client = DraClient(plugin.sockets.dra)
        try:
            final = client.prepare(refs)  # the kubelet retries what it never got an answer for
            assert all(a.error == "" for a in final.values()), final
            for uid, answer in acked.items():  # nothing acknowledged was lost or changed
                assert final[uid] == answer
            records = plugin.checkpoint_claims()
            uids = {c[2] for c in refs}
            assert set(records) == uids
            assert {r["state"] for r in records.values()} == {"PrepareCompleted"}
            specs = sorted(p.name for p in (short_dir / "cdi").glob("*.json"))
            assert len(specs) == len(uids)
            # every claim holds exactly one live share: none was prepared twice
            assert set(enforcer.shares) == uids
            for uid in uids:
                assert enforcer.created[uid] - enforcer.released[uid] == 1

            assert set(client.unprepare(refs).values()) == {""}
            assert enforcer.shares == {}
            assert list((short_dir / "cdi").glob("*.json")) == []
        finally:
            client.close()
    finally:
        enforcer.stop()


def arrived(enforcer: StandinEnforcer, count: int) -> bool:
    return enforcer.arrivals >= count


def _prepare_loop(
    plugin: PluginProcess,
    pending: list[ClaimTuple],
    acked: dict[str, ClaimAnswer],
    stop: threading.Event,
) -> None:
    client = DraClient(plugin.sockets.dra, timeout=5)
    try:
        for claim in pending:
            if stop.is_set():
                return
            try:
                answer = client.prepare([claim])[claim[2]]
            except Exception:  # the plugin died under the call: no answer, the kubelet retries
                return
            if not answer.error:
                acked[claim[2]] = answer
    finally:
        client.close()
