"""The DRA health stream of the plugin in-process (against the sandbox's API server): every
device at once, then again after an NVML event."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2 as hpb
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2_grpc as hpb_grpc
from gpuslice_testkit.kubelet_plugin.harness import Node, Running

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)


def test_the_health_stream_reports_changes(
    plugin: Running, fake_node: Node, node_name: str
) -> None:
    channel = grpc.insecure_channel(f"unix://{plugin.settings.sockets.dra}")
    stub = hpb_grpc.DRAResourceHealthStub(channel)
    stream = stub.NodeWatchResources(hpb.NodeWatchResourcesRequest(), timeout=20)
    messages: queue.Queue[hpb.NodeWatchResourcesResponse] = queue.Queue()

    def read() -> None:
        try:
            for message in stream:
                messages.put(message)
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        first = messages.get(timeout=10)
        assert {d.device.device_name for d in first.devices} == {
            "gpu-0",
            "gpu-1",
            "gpu-2-mig-1g-10gb-0",
            "gpu-2-mig-3g-40gb-4",
        }
        assert all(d.health == hpb.HEALTHY for d in first.devices)
        assert {d.device.pool_name for d in first.devices} == {node_name}
        fake_node.control.inject_xid(1, 79)
        while True:
            update = messages.get(timeout=10)
            by_name = {d.device.device_name: d for d in update.devices}
            if by_name["gpu-1"].health == hpb.UNHEALTHY:
                break
        assert "XID 79 (NoSchedule)" in by_name["gpu-1"].message
        assert by_name["gpu-0"].health == hpb.HEALTHY
    finally:
        stream.cancel()
        channel.close()
