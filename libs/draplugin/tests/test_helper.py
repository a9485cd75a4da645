"""The helper over its real sockets, without an API server (``raw=None``): registration, both
DRA versions with per-claim answers, the switches, a refused registration, the health stream,
the probe and stop. Publishing and claims need an API server:
e2e/tests/kubelet_plugin/test_kubelet_plugin_*."""

from __future__ import annotations

import queue
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuslice_draplugin import (
    ClaimRef,
    DeviceHealth,
    Helper,
    Pool,
    PreparedDevice,
    PrepareResult,
    Sockets,
    probe,
    start,
)
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as v1
from gpuslice_protos.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2 as hpb
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2_grpc as hpb_grpc
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2 as reg
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc

pytestmark = pytest.mark.timeout(30)
DRIVER = "gpu.example.com"


class FakePlugin:
    """Prepares every claim whose name does not start with ``bad``; ``broken`` raises for the
    whole call; ``forget`` leaves claims of that name out of the answer."""

    def __init__(self) -> None:
        self.broken = False
        self.forget = ""
        self.prepared: list[list[str]] = []

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        if self.broken:
            raise RuntimeError("the node is on fire")
        self.prepared.append([c.name for c in claims])
        out: dict[str, PrepareResult] = {}
        for c in claims:
            if c.name == self.forget:
                continue
            if c.name.startswith("bad"):
                out[c.uid] = ValueError(f"claim {c} asks for too much")
                continue
            out[c.uid] = [PreparedDevice(("gpu",), "node-a", "gpu-0", (f"v/c={c.uid}",), "s1")]
        return out

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, Exception | None]:
        return {c.uid: RuntimeError("busy") if c.name.startswith("bad") else None for c in claims}


class Health:
    def __init__(self) -> None:
        self.subscribers: list[queue.Queue[list[DeviceHealth]]] = []

    def subscribe(self) -> queue.Queue[list[DeviceHealth]]:
        q: queue.Queue[list[DeviceHealth]] = queue.Queue()
        q.put([DeviceHealth("gpu-0", True, "healthy", 10.0)])
        self.subscribers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[list[DeviceHealth]]) -> None:
        self.subscribers.remove(q)


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))  # unix socket paths stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugin() -> FakePlugin:
    return FakePlugin()


def run(plugin: FakePlugin, root: Path, **options: Any) -> Helper:
    return start(
        plugin,
        driver=DRIVER,
        node="node-a",
        registrar_dir=root / "reg",
        plugins_dir=root / "plugins",
        **options,
    )


def get_info(sockets: Sockets) -> reg.PluginInfo:
    with grpc.insecure_channel(f"unix://{sockets.registration}") as channel:
        info: reg.PluginInfo = reg_grpc.RegistrationStub(channel).GetInfo(
            reg.InfoRequest(), timeout=5
        )
        return info


def notify(sockets: Sockets, ok: bool, error: str = "") -> None:
    with grpc.insecure_channel(f"unix://{sockets.registration}") as channel:
        reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=ok, error=error), timeout=5
        )


def call(sockets: Sockets, version: str, method: str, *names: str) -> Any:
    pb: Any = v1 if version == "v1" else v1beta1
    grpc_mod: Any = v1_grpc if version == "v1" else v1beta1_grpc
    claims = [pb.Claim(namespace="ns", name=n, uid=f"uid-{n}") for n in names]
    request = getattr(pb, f"{method}Request")(claims=claims)
    with grpc.insecure_channel(f"unix://{sockets.dra}") as channel:
        return getattr(grpc_mod.DRAPluginStub(channel), method)(request, timeout=5)


def test_registration_names_the_driver_its_dra_socket_and_versions(
    plugin: FakePlugin, root: Path
) -> None:
    helper = run(plugin, root, health=Health())
    try:
        assert helper.sockets == Sockets(
            registration=root / "reg" / f"{DRIVER}-reg.sock",
            dra=root / "plugins" / DRIVER / "dra.sock",
        )
        info = get_info(helper.sockets)
        assert (info.type, info.name, info.endpoint) == (
            "DRAPlugin",
            DRIVER,
            str(helper.sockets.dra),
        )
        assert list(info.supported_versions) == [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth",
        ]
        registered = [helper.registered]
        notify(helper.sockets, True)
        assert [*registered, helper.registered] == [False, True]
        assert probe(helper.sockets) == []
    finally:
        helper.stop()
    assert not helper.sockets.registration.exists() and not helper.sockets.dra.exists()
    assert len(probe(helper.sockets, timeout=1)) == 2


def test_every_claim_gets_its_own_answer_on_both_versions(plugin: FakePlugin, root: Path) -> None:
    helper = run(plugin, root, pod_uid="p1")
    try:
        assert helper.sockets.dra.name == "dra-p1.sock"
        v1_answer = call(helper.sockets, "v1", "NodePrepareResources", "good", "bad")
        assert v1_answer.claims["uid-bad"].error == "claim ns/bad asks for too much"
        [device] = v1_answer.claims["uid-good"].devices
        assert (device.device_name, device.pool_name, device.share_id) == ("gpu-0", "node-a", "s1")
        assert list(device.cdi_device_ids) == ["v/c=uid-good"]
        beta = call(helper.sockets, "v1beta1", "NodePrepareResources", "good")
        assert beta.claims["uid-good"].devices[0].device_name == "gpu-0"  # no share_id field
        gone = call(helper.sockets, "v1", "NodeUnprepareResources", "good", "bad")
        assert {uid: c.error for uid, c in gone.claims.items()} == {
            "uid-good": "",
            "uid-bad": "busy",
        }
        empty = call(helper.sockets, "v1", "NodePrepareResources")  # the probe's call
        assert dict(empty.claims) == {}
        assert plugin.prepared == [["good", "bad"], ["good"]]  # an empty call skips the plugin
    finally:
        helper.stop()


def test_a_plugin_that_raises_or_forgets_fails_only_those_claims(
    plugin: FakePlugin, root: Path
) -> None:
    helper = run(plugin, root)
    try:
        plugin.forget = "lost"
        answer = call(helper.sockets, "v1", "NodePrepareResources", "lost", "good")
        assert answer.claims["uid-lost"].error == (
            "the driver's prepare gave no answer for ResourceClaim ns/lost"
        )
        assert answer.claims["uid-good"].error == ""
        plugin.broken = True
        answer = call(helper.sockets, "v1", "NodePrepareResources", "a", "b")
        assert {c.error for c in answer.claims.values()} == {"the node is on fire"}
    finally:
        helper.stop()


def test_switches_serve_less_or_advertise_something_else(plugin: FakePlugin, root: Path) -> None:
    helper = run(plugin, root, node_v1beta1=False, plugin_type="CSIPlugin")
    try:
        info = get_info(helper.sockets)
        assert (info.type, list(info.supported_versions)) == ("CSIPlugin", ["v1.DRAPlugin"])
        with pytest.raises(grpc.RpcError) as raised:
            call(helper.sockets, "v1beta1", "NodePrepareResources", "good")
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        helper.stop()
    helper = run(plugin, root, registration=False, versions=["v0.DRAPlugin"])
    try:
        assert not helper.sockets.registration.exists()
        assert helper.server.versions == ["v0.DRAPlugin"]
        assert call(helper.sockets, "v1", "NodePrepareResources", "good").claims["uid-good"]
    finally:
        helper.stop()


def test_a_refused_registration_recreates_the_socket(plugin: FakePlugin, root: Path) -> None:
    helper = run(plugin, root)
    try:
        helper.server.retry_initial = 0.05
        socket = helper.sockets.registration
        before = socket.stat().st_ino, socket.stat().st_ctime_ns
        notify(helper.sockets, False, "version mismatch")
        for _ in range(200):
            try:
                if (socket.stat().st_ino, socket.stat().st_ctime_ns) != before:
                    break
            except FileNotFoundError:
                pass
            helper.server.registered.wait(0.05)
        assert (socket.stat().st_ino, socket.stat().st_ctime_ns) != before
        assert (helper.server.failures, helper.server.last_error) == (1, "version mismatch")
        notify(helper.sockets, True)
        assert helper.registered and helper.server.failures == 0
    finally:
        helper.stop()


def test_the_health_stream_sends_the_sources_snapshots(plugin: FakePlugin, root: Path) -> None:
    source = Health()
    helper = run(plugin, root, health=source)
    try:
        with grpc.insecure_channel(f"unix://{helper.sockets.dra}") as channel:
            stream = hpb_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                hpb.NodeWatchResourcesRequest(), timeout=5
            )
            first = next(stream)
            [device] = first.devices
            assert (device.device.pool_name, device.device.device_name) == ("node-a", "gpu-0")
            assert (device.health, device.last_updated_time) == (hpb.HEALTHY, 10)
            source.subscribers[0].put([DeviceHealth("gpu-0", False, "XID 79", 20.0, pool="p")])
            second = next(stream)
            assert second.devices[0].device.pool_name == "p"
            assert second.devices[0].health == hpb.UNHEALTHY
            stream.cancel()
    finally:
        helper.stop()


def test_without_an_api_client_there_is_nothing_to_publish_or_read(
    plugin: FakePlugin, root: Path
) -> None:
    helper = Helper(plugin, driver=DRIVER, node="node-a", registrar_dir=root, plugins_dir=root)
    with pytest.raises(RuntimeError, match="only with an API client"):
        helper.publish({"node-a": Pool()})
    with pytest.raises(RuntimeError, match="only with an API client"):
        helper.claims.read(ClaimRef("ns", "c", "u"))
    assert not helper.sockets.dra.exists()  # built, not started: nothing served
