"""The sockets: registration, rolling-update names, a refused registration, the probe, stop —
the plugin in-process against the sandbox's API server."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from e2e.sandbox.nodeagent.testing import wait_for
from e2e.support.kubelet_plugin import ClaimMaker
from gpuslice_draplugin import Sockets, probe
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2 as reg
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpuslice_testkit.core import http_probe
from gpuslice_testkit.kubelet_plugin.dra import ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness, Running
from gpuslice_testkit.kubelet_plugin.standins import StandinEnforcer

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)


def get_info(socket: Path) -> reg.PluginInfo:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        info: reg.PluginInfo = reg_grpc.RegistrationStub(channel).GetInfo(
            reg.InfoRequest(), timeout=5
        )
        return info


def notify(socket: Path, ok: bool, error: str = "") -> None:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=ok, error=error), timeout=5
        )


def test_registration_answers_as_the_kubelet_expects(plugin: Running, short_dir: Path) -> None:
    sockets = plugin.settings.sockets
    assert sockets == Sockets(
        registration=short_dir / "reg" / "gpu.gpuslice.dev-reg.sock",
        dra=short_dir / "plugins" / "gpu.gpuslice.dev" / "dra.sock",
    )
    info = get_info(sockets.registration)
    assert info.type == "DRAPlugin"
    assert info.name == "gpu.gpuslice.dev"
    assert info.endpoint == str(sockets.dra)
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1alpha1.DRAResourceHealth",
    ]
    notify(sockets.registration, True)
    assert plugin.app.helper.server.registered.is_set()


def test_without_health_streaming_and_with_a_pod_uid(harness: Harness, short_dir: Path) -> None:
    plugin = harness.start(health_streaming=False, pod_uid="1234-abcd")
    sockets = plugin.settings.sockets
    assert sockets.registration == short_dir / "reg" / "gpu.gpuslice.dev-1234-abcd-reg.sock"
    assert sockets.dra == short_dir / "plugins" / "gpu.gpuslice.dev" / "dra-1234-abcd.sock"
    info = get_info(sockets.registration)
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert info.endpoint == str(sockets.dra)
    assert probe(sockets) == []


def test_a_refused_registration_recreates_the_socket(harness: Harness) -> None:
    plugin = harness.start()
    plugin.app.helper.server.retry_initial = 0.05
    socket = plugin.settings.sockets.registration

    def identity() -> tuple[int, int] | None:  # what the kubelet's plugin watcher compares
        try:
            st = socket.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_ctime_ns

    before = identity()
    notify(socket, False, "version mismatch")
    wait_for(
        lambda: identity() not in (None, before), 10, "the registration socket to be re-created"
    )
    assert plugin.app.helper.server.failures == 1
    assert plugin.app.helper.server.last_error == "version mismatch"
    assert get_info(socket).name == "gpu.gpuslice.dev"
    notify(socket, True)
    assert plugin.app.helper.server.registered.is_set() and plugin.app.helper.server.failures == 0


def test_probe_and_stop(plugin: Running) -> None:
    sockets = plugin.settings.sockets
    assert probe(sockets, timeout=2) == []
    plugin.stop()
    assert not sockets.registration.exists() and not sockets.dra.exists()
    problems = probe(sockets, timeout=1)
    assert len(problems) == 2
    assert "GetInfo" in problems[0] and "NodePrepareResources" in problems[1]


def test_stop_lets_an_in_flight_prepare_finish(
    harness: Harness, claims: ClaimMaker, node_name: str, short_dir: Path
) -> None:
    enforcer = StandinEnforcer(delay=1.0).serve(short_dir / "enf.sock")
    try:
        plugin = harness.start(enforcer_socket=short_dir / "enf.sock")
        claim = claims("slow", results=[result("gpu-0", pool=node_name, cores="10", memory="1Gi")])
        answers: list[str] = []
        call = threading.Thread(
            target=lambda: answers.append(
                plugin.client.prepare([ref(claim)])[claim["metadata"]["uid"]].error
            )
        )
        call.start()
        assert enforcer.entered.wait(10)  # the call is inside CreateShare (1 s)
        plugin.app.stop()  # SIGTERM's path
        call.join(10)
        assert answers == [""]
        assert not plugin.settings.sockets.dra.exists()
    finally:
        enforcer.stop()


def test_healthz_and_readyz_follow_the_sockets(harness: Harness) -> None:
    """/readyz: what --probe checks (both sockets end to end), from the plugin's own process;
    /healthz: the DRA socket answers; 503 on /readyz once stopping, the port closed after."""
    plugin = harness.start(health_addr="127.0.0.1:0")
    port = plugin.app.health_port
    assert port is not None
    # serving, but no kubelet has registered it: a pod prepared now would fail
    assert http_probe(port, "/readyz") == 503
    assert http_probe(port, "/healthz") == 200
    get_info(plugin.settings.sockets.registration)  # the kubelet's registration, in its order
    notify(plugin.settings.sockets.registration, True)
    assert http_probe(port, "/readyz") == 200
    assert http_probe(port, "/healthz") == 200
    plugin.app.helper.server.stop_registration()  # the kubelet cannot reach us: not ready
    assert http_probe(port, "/readyz") == 503
    assert http_probe(port, "/healthz") == 200  # ...but alive: no restart for that
    plugin.app.helper.server.start_registration()
    # a new registration socket: ready again once the kubelet has registered it again
    wait_for(lambda: plugin.settings.sockets.registration.exists(), 5, "the socket again")
    assert http_probe(port, "/readyz") == 503
    get_info(plugin.settings.sockets.registration)
    notify(plugin.settings.sockets.registration, True)
    wait_for(lambda: http_probe(port, "/readyz") == 200, 5, "ready again")
    plugin.stop()
    assert plugin.app.ready() == ["stopping"]
    assert http_probe(port, "/readyz") is None
