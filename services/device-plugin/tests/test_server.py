"""The plugin's servers against a stand-in kubelet Registration service on kubelet.sock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_core.health import HealthServer
from gpuslice_device_plugin.allocate import Topology
from gpuslice_device_plugin.cli import probe
from gpuslice_device_plugin.devices import discover
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.run import Probes
from gpuslice_device_plugin.server import PluginManager
from gpuslice_nvml import HealthEvent, HealthEventKind, Nvml
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuslice_testkit.core import http_probe, wait_for
from gpuslice_testkit.device_plugin import H100X8_NVLINK, Kubelet, settings

pytestmark = pytest.mark.timeout(30)
Factory = Callable[[dict[str, Any]], Nvml]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="gdp-"))  # unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_manager(nvml: Nvml, directory: Path, config: str = "") -> PluginManager:
    s = settings(config)
    resources = discover(nvml, s)
    health = HealthTracker(nvml, quiet_period=1000)
    manager = PluginManager(
        directory, resources, s, health, Topology.from_nvml(nvml, range(8)), Metrics()
    )
    manager.start()
    return manager


def stub(manager: PluginManager) -> pb_grpc.DevicePluginStub:
    socket = manager.socket(manager.resources[0])
    return pb_grpc.DevicePluginStub(grpc.insecure_channel(f"unix://{socket}"))


def test_register_list_allocate_and_stop(fake_node: Factory, short_dir: Path) -> None:
    nvml = fake_node(H100X8_NVLINK)
    kubelet = Kubelet(short_dir).start()
    other = short_dir / "other.sock"
    other_server = UnixGrpcServer([other], name="other")
    other_server.start()
    manager = start_manager(nvml, short_dir)
    try:
        req = kubelet.requests.get(timeout=5)
        assert (req.version, req.endpoint, req.resource_name) == (
            "v1beta1",
            "gpuslice-gpu.sock",
            "nvidia.com/gpu",
        )
        assert req.options.get_preferred_allocation_available
        plugin = stub(manager)
        stream = plugin.ListAndWatch(pb.Empty(), timeout=20)
        first = next(stream)
        assert [d.health for d in first.devices] == ["Healthy"] * 8
        assert [d.topology.nodes[0].ID for d in first.devices] == [0] * 4 + [1] * 4
        uuid0 = first.devices[0].ID
        manager.health.handle(HealthEvent(HealthEventKind.XID, 0, uuid0, xid=79))
        second = next(stream)
        assert second.devices[0].health == "Unhealthy"
        with pytest.raises(grpc.RpcError) as err:
            plugin.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuid0, "nope"])]
                )
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown device IDs: nope" in str(err.value.details())
        with pytest.raises(grpc.RpcError) as err:
            plugin.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuid0])]
                )
            )
        assert f"unhealthy device IDs: {uuid0} (XID 79)" in str(err.value.details())
        ids = [first.devices[1].ID]
        samples = []
        for _ in range(50):
            start = time.perf_counter()
            reply = plugin.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
                )
            )
            samples.append(time.perf_counter() - start)
        assert reply.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == ids[0]
        samples.sort()
        p50, worst = samples[25] * 1e3, samples[-1] * 1e3
        print(f"Allocate over the socket: p50 {p50:.2f} ms, max of 50 {worst:.2f} ms")
        pref = plugin.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[d.ID for d in first.devices[1:]],
                        must_include_deviceIDs=[first.devices[5].ID],
                        allocation_size=2,
                    )
                ]
            )
        )
        chosen = list(pref.container_responses[0].deviceIDs)
        assert chosen[0] == first.devices[5].ID and chosen[1] in {
            first.devices[4].ID,
            first.devices[6].ID,
        }
    finally:
        manager.stop()
        manager.health.stop()
        kubelet.stop()
    assert not (short_dir / "gpuslice-gpu.sock").exists()
    assert other.exists()  # not ours: left alone
    other_server.stop(0.1)


def test_reregisters_when_kubelet_sock_is_recreated(fake_node: Factory, short_dir: Path) -> None:
    nvml = fake_node(H100X8_NVLINK)
    kubelet = Kubelet(short_dir).start()
    manager = start_manager(nvml, short_dir)
    try:
        kubelet.requests.get(timeout=5)
        kubelet.stop()
        (short_dir / "gpuslice-gpu.sock").unlink()  # the restarted kubelet clears the dir
        kubelet = Kubelet(short_dir)
        start = time.monotonic()
        kubelet.start()
        req = kubelet.requests.get(timeout=5)
        took = time.monotonic() - start
        print(f"re-registered {took * 1e3:.0f} ms after kubelet.sock was re-created")
        assert took < 1.0
        assert req.endpoint == "gpuslice-gpu.sock"
        wait_for(lambda: (short_dir / "gpuslice-gpu.sock").exists(), 5, "our socket again")
        assert next(stub(manager).ListAndWatch(pb.Empty(), timeout=5)).devices
    finally:
        manager.stop()
        manager.health.stop()
        kubelet.stop()


def test_register_is_retried_until_the_kubelet_is_there(
    fake_node: Factory, short_dir: Path
) -> None:
    nvml = fake_node(H100X8_NVLINK)
    manager = start_manager(nvml, short_dir)
    kubelet = Kubelet(short_dir)
    try:
        assert not manager.all_registered()
        kubelet.start()
        kubelet.requests.get(timeout=5)
        wait_for(manager.all_registered, 5, "registered")
    finally:
        manager.stop()
        manager.health.stop()
        kubelet.stop()


def test_probes_follow_the_served_sockets(fake_node: Factory, short_dir: Path) -> None:
    """/readyz (run.Probes): 503 before any resource serves, 200 while every socket answers
    SERVING (what --probe checks), 503 once one stops and when the plugin stops; /healthz: the
    kubelet watch runs."""
    nvml = fake_node(H100X8_NVLINK)
    probes = Probes()
    server = HealthServer("127.0.0.1:0", live=probes.live, ready=probes.ready).start()
    manager: PluginManager | None = None
    try:
        assert http_probe(server.port, "/readyz") == 503
        assert http_probe(server.port, "/healthz") == 200
        manager = start_manager(nvml, short_dir)
        probes.manager = manager
        assert http_probe(server.port, "/readyz") == 200
        assert http_probe(server.port, "/healthz") == 200
        assert probe(short_dir) == 0  # --probe agrees
        first = manager.endpoints[0].server
        assert first is not None
        first.health.enter_graceful_shutdown()
        assert http_probe(server.port, "/readyz") == 503
        probes.stopping = True
        assert probes.ready() == ["stopping"]
    finally:
        if manager is not None:
            manager.stop()
            manager.health.stop()
        probes.close()
        server.stop()
