"""What a client of the plugin's sockets that does not behave like the kubelet can do: hold
streams open, name ten thousand devices, or start the plugin with a relative directory. None of
it may keep the kubelet's Allocate from being answered or the plugin from saying what is
wrong."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpuslice_device_plugin import cli
from gpuslice_device_plugin.allocate import Topology
from gpuslice_device_plugin.devices import discover
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.server import STREAM_CAP, PluginManager
from gpuslice_nvml import Nvml
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuslice_testkit.device_plugin import H100X8_NVLINK, Kubelet, settings

pytestmark = pytest.mark.timeout(30)
Factory = Callable[[dict[str, Any]], Nvml]


@pytest.fixture
def manager(fake_node: Factory) -> Iterator[PluginManager]:
    directory = Path(tempfile.mkdtemp(prefix="gdp-"))  # unix socket paths are short
    nvml = fake_node(H100X8_NVLINK)
    kubelet = Kubelet(directory).start()
    s = settings()
    health = HealthTracker(nvml, quiet_period=1000)
    plugin = PluginManager(
        directory, discover(nvml, s), s, health, Topology.from_nvml(nvml, range(8)), Metrics()
    )
    plugin.start()
    kubelet.requests.get(timeout=5)
    try:
        yield plugin
    finally:
        plugin.stop(grace=0.1)
        health.stop()
        kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _channel(plugin: PluginManager) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{plugin.socket(plugin.resources[0])}")


def test_held_streams_never_starve_allocate(manager: PluginManager) -> None:
    """More ListAndWatch and Health.Watch streams than the server had threads (8) used to
    leave Allocate without one until its deadline; now streams have their own budget and those
    over the cap are refused by name."""
    channel = _channel(manager)
    plugin = pb_grpc.DevicePluginStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    held: list[Any] = [plugin.ListAndWatch(pb.Empty(), timeout=20) for _ in range(STREAM_CAP + 8)]
    held += [
        health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)
        for _ in range(STREAM_CAP + 8)
    ]
    try:
        time.sleep(0.5)  # every stream reached the server
        ids = [manager.resources[0].devices[0].id]
        start = time.perf_counter()
        reply = plugin.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
            timeout=2,
        )
        took = time.perf_counter() - start
        assert reply.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == ids[0]
        refused = [s for s in held if s.done()]
        print(f"Allocate with {len(held) - len(refused)} streams held: {took * 1e3:.1f} ms")
        assert len(refused) == 16
        assert {s.code() for s in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        details = sorted(str(s.details()) for s in refused)
        assert f"at most {STREAM_CAP} streams of /grpc.health.v1.Health/Watch" in details[0]
        listandwatch = f"at most {STREAM_CAP} streams of /v1beta1.DevicePlugin/ListAndWatch"
        assert listandwatch in details[-1]
        assert all(not s.done() for s in held if s not in refused)
    finally:
        for stream in held:
            stream.cancel()
        channel.close()


def test_a_freed_stream_slot_is_taken_again(manager: PluginManager) -> None:
    channel = _channel(manager)
    plugin = pb_grpc.DevicePluginStub(channel)
    held = [plugin.ListAndWatch(pb.Empty(), timeout=20) for _ in range(STREAM_CAP)]
    try:
        for stream in held:
            next(stream)
        held.pop().cancel()
        deadline = time.monotonic() + 5  # the stream notices within its 1 s wake-up
        while True:
            stream = plugin.ListAndWatch(pb.Empty(), timeout=20)
            try:
                assert next(stream).devices
                held.append(stream)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the cancelled stream's slot never freed"
                time.sleep(0.1)
    finally:
        for stream in held:
            stream.cancel()
        channel.close()


def test_ten_thousand_unknown_ids_get_a_short_error(manager: PluginManager) -> None:
    """The message used to list every ID (260 KB), which a default gRPC client refuses as
    RESOURCE_EXHAUSTED (its trailing metadata limit is 8 KB) instead of reading the error."""
    channel = _channel(manager)
    ids = [f"GPU-{n:08d}-0000-0000-0000-000000000000" for n in range(10_000)]
    try:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.DevicePluginStub(channel).Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
                ),
                timeout=10,
            )
    finally:
        channel.close()
    details = str(err.value.details())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert len(details) < 1024, len(details)
    assert f"unknown device IDs: {ids[0]}, {ids[1]}" in details
    assert "and 9995 more (10000 in all)" in details


def test_a_relative_device_plugins_dir_is_an_argument_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It used to crash with a gRPC traceback (``unix://rel/...`` cannot be bound)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--device-plugins-dir", "rel/plugins", "--mode-check=false", "--nvml=fake"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--device-plugins-dir: 'rel/plugins' is a relative path" in err, err
    assert "Traceback" not in err
