"""Node-agent parts that need no API server: plugin registration over real gRPC sockets, the
container runtime (shim, hooks, signals), CDI edits into a container config, pod phase."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from e2e.sandbox.nodeagent.claims import PodClaim, container_cdi_ids, container_claim_devices
from e2e.sandbox.nodeagent.config import NodeConfig, Timings
from e2e.sandbox.nodeagent.containers import build_config, expand
from e2e.sandbox.nodeagent.devicemanager import DeviceInstance, DeviceManager
from e2e.sandbox.nodeagent.dra_plugins import V1, V1BETA1, DraPlugins, PreparedDevice
from e2e.sandbox.nodeagent.health import (
    HEALTH_V1,
    HEALTH_V1ALPHA1,
    HEALTHY,
    SERVICES,
    UNHEALTHY,
    UNKNOWN,
    DeviceHealth,
    HealthCache,
    NodeHealth,
    allocated_resources_status,
    choose_health_service,
    truncate_message,
)
from e2e.sandbox.nodeagent.podresources import (
    PodEntry,
    PodResourcesServer,
    Sources,
    container_devices_pb,
)
from e2e.sandbox.nodeagent.podstatus import ContainerView, phase
from e2e.sandbox.nodeagent.registration import DIAL_TIMEOUT, PluginWatcher
from e2e.sandbox.nodeagent.runtime import (
    ContainerConfig,
    CreateContainerError,
    ExitStatus,
    Runtime,
)
from e2e.sandbox.nodeagent.testing import wait_for
from e2e.support.standin_dra_plugin import DRIVER, StandinDraPlugin
from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Device, Hook
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_kube.raw import RawApi
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as dpb
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as dpb_grpc
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2 as hpb
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2_grpc as hpb_grpc
from gpuslice_protos.kubelet.podresources.v1 import api_pb2 as prpb
from gpuslice_protos.kubelet.podresources.v1 import api_pb2_grpc as pr_grpc

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def root() -> Iterator[Path]:
    """A short root dir (unix socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gsu-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Recorder:
    """A plugin handler that records what the watcher asked of it."""

    def __init__(self, reject: str = "") -> None:
        self.reject = reject
        self.events: list[tuple[str, str, str]] = []

    def validate_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        from e2e.sandbox.nodeagent.registration import RegistrationError

        if self.reject:
            raise RegistrationError(self.reject)

    def register_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        self.events.append(("register", name, endpoint))

    def deregister_plugin(self, name: str, endpoint: str) -> None:
        self.events.append(("deregister", name, endpoint))


def plugin_in(root: Path, **kwargs: Any) -> StandinDraPlugin:
    return StandinDraPlugin(
        root / "plugins_registry", root / "plugins", root / "cdi", cast(RawApi, None), **kwargs
    )


def watcher(root: Path, handler: Any, kind: str = "DRAPlugin") -> PluginWatcher:
    fast = Timings.fast()
    return PluginWatcher(root / "plugins_registry", {kind: handler}, fast, "unit")


# ---- registration ---------------------------------------------------------------------------
def test_existing_socket_is_registered_and_notified_last(root: Path) -> None:
    plugin = plugin_in(root).start()
    rec = Recorder()
    w = watcher(root, rec)
    try:
        w.reconcile()
        assert rec.events == [("register", DRIVER, str(plugin.dra_socket))]
        assert plugin.calls.notifications == [(True, "")]
    finally:
        plugin.stop()


def test_dot_files_and_non_sockets_are_ignored(root: Path) -> None:
    registry = root / "plugins_registry"
    registry.mkdir(parents=True)
    (registry / "not-a-socket.sock").write_text("")
    hidden = plugin_in(root, driver="hidden.example.com")
    hidden.reg_socket = registry / ".hidden-reg.sock"
    hidden.start()
    rec = Recorder()
    try:
        watcher(root, rec).reconcile()
        assert rec.events == []
        assert hidden.calls.get_info == 0
    finally:
        hidden.stop()


def test_unknown_type_and_rejected_validation_are_notified(root: Path) -> None:
    plugin = plugin_in(root, plugin_type="CSIPlugin").start()
    try:
        watcher(root, Recorder()).reconcile()
        ok, error = plugin.calls.notifications[-1]
        assert not ok
        assert error.startswith("no handler registered for plugin type: CSIPlugin")
    finally:
        plugin.stop()
    plugin = plugin_in(root).start()
    rec = Recorder(reject="nope")
    try:
        watcher(root, rec).reconcile()
        assert plugin.calls.notifications == [
            (False, "RegisterPlugin error -- plugin validation failed with err: nope")
        ]
        assert rec.events == []
    finally:
        plugin.stop()


def test_socket_removal_deregisters_and_recreation_registers_again(root: Path) -> None:
    plugin = plugin_in(root).start()
    rec = Recorder()
    w = watcher(root, rec)
    try:
        w.reconcile()
        plugin.stop_registration()  # removes the socket
        w.reconcile()
        assert rec.events[-1][0] == "deregister"
        plugin.start_registration()  # a new socket at the same path
        w.reconcile()
        assert [e[0] for e in rec.events] == ["register", "deregister", "register"]
        assert plugin.calls.get_info == 2
    finally:
        plugin.stop()


def test_stop_gives_up_a_dial_to_a_plugin_that_never_answers(root: Path) -> None:
    """The dial waits up to 10 s for a hung plugin; stop() must not return before the thread is
    gone, nor wait that long: a watcher thread that outlives stop() logs into a closed stream."""
    registry = root / "plugins_registry"
    registry.mkdir()
    w = watcher(root, Recorder())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(registry / "hung-reg.sock"))
        hung.listen()
        hung.settimeout(10)
        w.start()
        conn, _ = hung.accept()  # the watcher is dialling; nothing will ever answer it
        with conn:
            started = time.monotonic()
            w.stop()
            stopped_in = time.monotonic() - started
    assert [t.name for t in threading.enumerate() if t.name == "unit-plugin-watcher"] == []
    assert stopped_in < DIAL_TIMEOUT / 2


@pytest.mark.parametrize(
    ("versions", "chosen", "error"),
    [
        (("v1.DRAPlugin", "v1beta1.DRAPlugin"), V1, ""),
        (("v1beta1.DRAPlugin", "v1.DRAPlugin"), V1BETA1, ""),
        (("v2.DRAPlugin", "v1beta1.DRAPlugin"), V1BETA1, ""),
        ((), "", "empty list of supported versions"),
        (("v0.DRAPlugin",), "", "none of the versions supported by the plugin"),
    ],
)
def test_dra_version_is_the_first_supported_in_the_plugins_order(
    root: Path, versions: tuple[str, ...], chosen: str, error: str
) -> None:
    plugin = plugin_in(root, supported_versions=versions).start()
    dra = DraPlugins(root, Timings.fast(), lambda driver: None, "unit")
    try:
        watcher(root, dra).reconcile()
        if error:
            ok, message = plugin.calls.notifications[-1]
            assert not ok and error in message
            assert not dra.registered(DRIVER)
        else:
            assert dra.endpoint(DRIVER).version == chosen
            assert plugin.calls.notifications == [(True, "")]
    finally:
        dra.stop()
        plugin.stop()


def test_dra_endpoint_outside_the_root_or_registered_twice_is_refused(root: Path) -> None:
    from e2e.sandbox.nodeagent.registration import RegistrationError

    dra = DraPlugins(root, Timings.fast(), lambda driver: None, "unit")
    with pytest.raises(RegistrationError, match="not inside the kubelet root dir"):
        dra.validate_plugin(DRIVER, "/var/run/elsewhere.sock", [V1])
    with pytest.raises(RegistrationError, match="invalid DRA driver name"):
        dra.validate_plugin("Not_A_DNS_Name", str(root / "plugins/x.sock"), [V1])
    endpoint = str(root / "plugins" / "d.sock")
    dra.register_plugin(DRIVER, endpoint, [V1])
    with pytest.raises(RegistrationError, match="already registered"):
        dra.validate_plugin(DRIVER, endpoint, [V1])
    dra.stop()


def test_slices_are_wiped_when_no_endpoint_is_left(root: Path) -> None:
    wiped: list[str] = []
    dra = DraPlugins(root, Timings.fast(slice_wipe_delay=0.2), wiped.append, "unit")
    endpoint = str(root / "plugins" / "d.sock")
    dra.register_plugin(DRIVER, endpoint, [V1])
    dra.deregister_plugin(DRIVER, endpoint)
    dra.register_plugin(DRIVER, endpoint, [V1])  # back within the delay: no wipe
    time.sleep(0.4)
    assert wiped == []
    dra.deregister_plugin(DRIVER, endpoint)
    wait_for(lambda: wiped == [DRIVER], 5, "the wipe")
    dra.stop()


# ---- runtime ----------------------------------------------------------------------------------
def config(root: Path, script: str, **kwargs: Any) -> ContainerConfig:
    return ContainerConfig(
        pod_uid="pod-1",
        name="c",
        argv=["sh", "-c", script],
        env={"PATH": "/usr/bin:/bin", "FROM_POD": "pod"},
        cwd=str(root),
        **kwargs,
    )


def wait_exit(container: Any, timeout: float = 10) -> ExitStatus:
    result: ExitStatus = wait_for(container.poll, timeout, "the container to exit")
    return result


def test_container_runs_with_cdi_env_and_hooks_see_the_oci_state(root: Path) -> None:
    state_file = root / "hook-state.json"
    hook = Hook(
        hook_name="createContainer",
        path="/bin/sh",
        args=["sh", "-c", f'cat > {state_file}; echo "$HOOK_ENV" >> {root / "hook-env"}'],
        env=["HOOK_ENV=from-cdi"],
    )
    edits = ContainerEdits(env=["GPU=gpu-0", "FROM_POD=cdi-wins"], hooks=[hook])
    runtime = Runtime(root / "pods", "unit")
    c = runtime.run(
        config(root, "echo $GPU $FROM_POD; exit 7", edits=edits, annotations={"a": "b"})
    )
    status = wait_exit(c)
    assert (status.exit_code, status.reason) == (7, "Error")
    assert runtime.log_path("pod-1", "c").read_text() == "gpu-0 cdi-wins\n"
    state = json.loads(state_file.read_text())
    assert state["ociVersion"] and state["status"] == "created" and state["id"] == c.id
    assert state["pid"] == c.shim_pid and state["annotations"] == {"a": "b"}
    assert Path(state["bundle"]).is_dir()
    assert (root / "hook-env").read_text() == "from-cdi\n"


def test_failing_hook_fails_creation_and_runs_nothing(root: Path) -> None:
    marker = root / "ran"
    hook = Hook(hook_name="createRuntime", path="/bin/false")
    runtime = Runtime(root / "pods", "unit")
    with pytest.raises(CreateContainerError, match="createRuntime hook /bin/false exited with 1"):
        runtime.run(config(root, f"touch {marker}", edits=ContainerEdits(hooks=[hook])))
    assert not marker.exists()


def test_stop_sends_sigterm_then_sigkill_after_the_grace(root: Path) -> None:
    runtime = Runtime(root / "pods", "unit")
    log = runtime.log_path("pod-1", "c")
    polite = runtime.run(
        config(root, "trap 'exit 0' TERM; echo up; while true; do sleep 0.05; done")
    )
    wait_for(lambda: log.read_text() == "up\n", 5, "the trap to be set")
    assert polite.stop(grace=5).exit_code == 0
    stubborn = runtime.run(config(root, "trap '' TERM; echo up; while true; do sleep 0.05; done"))
    wait_for(lambda: log.read_text() == "up\n", 5, "the trap to be set")
    t0 = time.monotonic()
    status = stubborn.stop(grace=0.5)
    assert status.exit_code == 137 and status.signal == 9
    assert time.monotonic() - t0 < 4


def test_a_restarted_agent_adopts_a_running_container(root: Path) -> None:
    runtime = Runtime(root / "pods", "unit")
    first = runtime.run(config(root, "sleep 30"))
    adopted = Runtime(root / "pods", "unit").adopt("pod-1", "c")
    assert adopted is not None and adopted.id == first.id and adopted.poll() is None
    status = adopted.stop(grace=5)
    assert status.exit_code == 143  # SIGTERM, reported by the shim
    assert first.poll() == status


# ---- container config -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)-$(B)", "1-$(B)"),
        ("$$(A)", "$(A)"),
        ("$$", "$"),
        ("$(A", "$(A"),
        ("a$b", "a$b"),
    ],
)
def test_var_expansion(text: str, expected: str) -> None:
    assert expand(text, {"A": "1"}) == expected


def pod_with(container: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [container]},
    }


def test_cdi_ids_resolve_into_env_and_unknown_ids_fail_creation(root: Path) -> None:
    specs = ClaimSpecs(root / "cdi", vendor="k8s.example.com")
    ids = specs.write(
        "claim1", [Device(name="claim1-gpu-0", container_edits=ContainerEdits(env=["GPU=0"]))]
    )
    container = {"name": "c", "image": "x", "command": ["env"]}
    cfg = build_config(
        pod_with(container),
        container,
        node_name="n",
        cdi_root=root / "cdi",
        cdi_ids=ids,
        device_plugin=[{"envs": {"DP": "1"}}],
        workdir=root,
    )
    assert cfg.edits.env == ["DP=1", "GPU=0"]
    with pytest.raises(CreateContainerError, match="unresolvable CDI devices"):
        build_config(
            pod_with(container),
            container,
            node_name="n",
            cdi_root=root / "cdi",
            cdi_ids=["k8s.example.com/claim=claim2-gpu-0"],
            device_plugin=[],
            workdir=root,
        )


def test_containers_get_only_the_claims_and_requests_they_list() -> None:
    claims = [PodClaim("a", "claim-a", True), PodClaim("b", "claim-b", False)]
    devices = {
        "claim-a": [
            PreparedDevice("pool", "gpu-0", ("gpu",), ("v/c=a-0",)),
            PreparedDevice("pool", "gpu-1", ("other/sub",), ("v/c=a-1",)),
            PreparedDevice("pool", "gpu-2", (), ("v/c=a-2",)),
        ],
        "claim-b": [PreparedDevice("pool", "gpu-3", ("x",), ("v/c=b-3",))],
    }
    pod: dict[str, Any] = {"status": {}}

    def ids(refs: list[dict[str, str]]) -> list[str]:
        container = {"name": "c", "resources": {"claims": refs}}
        return container_cdi_ids(pod, container, claims, lambda n: devices[n])

    assert ids([{"name": "a"}]) == ["v/c=a-0", "v/c=a-1", "v/c=a-2"]
    assert ids([{"name": "a", "request": "other"}]) == ["v/c=a-1", "v/c=a-2"]
    assert ids([{"name": "b"}]) == ["v/c=b-3"]
    assert ids([]) == []
    # the kubelet's order: the pod's claims as spec.resourceClaims lists them, not as the
    # container does; a device two entries select is passed twice (the runtime skips repeats)
    assert ids([{"name": "b"}, {"name": "a", "request": "gpu"}]) == [
        "v/c=a-0",
        "v/c=a-2",
        "v/c=b-3",
    ]
    assert ids([{"name": "a", "request": "gpu"}, {"name": "a", "request": "other"}]) == [
        "v/c=a-0",
        "v/c=a-2",
        "v/c=a-1",
        "v/c=a-2",
    ]


# ---- pod phase ----------------------------------------------------------------------------------
def view(
    name: str, *, running: bool = False, exit_code: int | None = None, **kw: Any
) -> ContainerView:
    v = ContainerView(name=name, image="x", **kw)
    if running:
        v.running_since = "2026-01-01T00:00:00Z"
    if exit_code is not None:
        v.exited = ExitStatus(exit_code, "Completed" if exit_code == 0 else "Error", "", "")
    return v


@pytest.mark.parametrize(
    ("policy", "apps", "terminal", "expected"),
    [
        ("Always", [view("a")], False, "Pending"),
        ("Always", [view("a", running=True), view("b")], False, "Pending"),
        ("Always", [view("a", running=True)], False, "Running"),
        ("Never", [view("a", exit_code=0)], False, "Succeeded"),
        ("Never", [view("a", exit_code=0), view("b", exit_code=1)], False, "Failed"),
        ("OnFailure", [view("a", exit_code=0)], False, "Succeeded"),
        ("Always", [view("a", exit_code=0)], False, "Running"),
        ("Always", [view("a", exit_code=143)], True, "Failed"),
        ("Always", [view("a", exit_code=0)], True, "Succeeded"),
        ("Always", [view("a")], True, "Failed"),
    ],
)
def test_phase(policy: str, apps: list[ContainerView], terminal: bool, expected: str) -> None:
    assert phase(policy, [], apps, terminal) == expected


def test_phase_waits_for_init_containers() -> None:
    init = view("init", init=True)
    assert phase("Always", [init], [view("a")], False) == "Pending"
    failed = view("init", init=True, exit_code=1)
    assert phase("Never", [failed], [view("a")], False) == "Failed"


# ---- device health (NodeWatchResources, allocatedResourcesStatus) -----------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def dev_health(device: str, health: str, message: str = "", timeout: float = 0) -> DeviceHealth:
    return DeviceHealth("pool", device, health, message, timeout)


def test_health_is_stamped_on_receipt_and_decays_to_unknown_after_the_timeout() -> None:
    clock = FakeClock()
    cache = HealthCache(30.0, clock)
    changed = cache.update(
        "d", [dev_health("gpu-0", HEALTHY, "ok"), dev_health("gpu-1", UNHEALTHY, "bad", 5)]
    )
    assert changed == [("d", "pool", "gpu-0"), ("d", "pool", "gpu-1")]
    assert cache.get("d", "pool", "gpu-0") == (HEALTHY, "ok")
    assert cache.get("d", "pool", "gpu-9") == (UNKNOWN, "")
    assert cache.get("other", "pool", "gpu-0") == (UNKNOWN, "")
    clock.now += 5.5  # gpu-1's own timeout (5 s) passed; gpu-0 has the default (30 s)
    assert cache.get("d", "pool", "gpu-1") == (UNKNOWN, "")
    assert cache.get("d", "pool", "gpu-0") == (HEALTHY, "ok")
    # a repeat refreshes gpu-0 (no change), stamped with the receive time; gpu-1, missing
    # from the message and timed out, is now Unknown in the cache too (a change)
    assert cache.update("d", [dev_health("gpu-0", HEALTHY, "ok")]) == [("d", "pool", "gpu-1")]
    clock.now += 29.9
    assert cache.get("d", "pool", "gpu-0") == (HEALTHY, "ok")
    clock.now += 0.2
    assert cache.get("d", "pool", "gpu-0") == (UNKNOWN, "")


def test_zero_or_negative_timeouts_use_the_default() -> None:
    clock = FakeClock()
    cache = HealthCache(30.0, clock)
    cache.update("d", [dev_health("a", HEALTHY, timeout=0), dev_health("b", HEALTHY, timeout=-3)])
    clock.now += 29
    assert cache.get("d", "pool", "a")[0] == cache.get("d", "pool", "b")[0] == HEALTHY
    clock.now += 2
    assert cache.get("d", "pool", "a")[0] == cache.get("d", "pool", "b")[0] == UNKNOWN


def test_unreported_devices_turn_unknown_once_timed_out_and_changes_are_reported() -> None:
    clock = FakeClock()
    cache = HealthCache(30.0, clock)
    cache.update("d", [dev_health("a", HEALTHY), dev_health("b", HEALTHY)])
    clock.now += 10
    assert cache.update("d", [dev_health("a", UNHEALTHY, "XID 79")]) == [("d", "pool", "a")]
    assert cache.update("d", [dev_health("a", UNHEALTHY, "XID 48")]) == [("d", "pool", "a")]
    assert cache.update("d", [dev_health("a", UNHEALTHY, "XID 48", 60)]) == [("d", "pool", "a")]
    clock.now += 21  # b was last reported 31 s ago
    assert cache.update("d", [dev_health("a", UNHEALTHY, "XID 48", 60)]) == [("d", "pool", "b")]
    assert cache.get("d", "pool", "b") == (UNKNOWN, "")
    assert cache.update("d", [dev_health("a", UNHEALTHY, "XID 48", 60)]) == []
    assert cache.clear_driver("d") == [("d", "pool", "a"), ("d", "pool", "b")]
    assert cache.get("d", "pool", "a") == (UNKNOWN, "")
    assert cache.clear_driver("d") == []


def test_health_service_choice_and_message_limit() -> None:
    assert choose_health_service([V1, HEALTH_V1ALPHA1]) == HEALTH_V1ALPHA1
    assert choose_health_service([V1, V1BETA1]) is None
    # v1 is preferred, but only once gpuslice_protos mirrors it
    assert choose_health_service([HEALTH_V1ALPHA1, HEALTH_V1]) == (
        HEALTH_V1 if HEALTH_V1 in SERVICES else HEALTH_V1ALPHA1
    )
    assert truncate_message("x" * 1024) == "x" * 1024
    assert truncate_message("x" * 2000) == "x" * 1021 + "..."


def test_allocated_resources_status_names_claims_and_requests() -> None:
    pod: dict[str, Any] = {
        "spec": {
            "containers": [
                {"name": "a", "resources": {"claims": [{"name": "gpu"}, {"name": "nic"}]}},
                {"name": "b", "resources": {"claims": [{"name": "gpu", "request": "big"}]}},
                {"name": "c"},
                {"name": "d", "resources": {"claims": [{"name": "unprepared"}]}},
            ]
        }
    }
    claims = [
        PodClaim("gpu", "p-gpu-x", True),
        PodClaim("nic", "nic-claim", False),
        PodClaim("unprepared", "later", True),
        PodClaim("", "p-extended", True),  # the extended-resource claim: not reported
    ]
    devices = {
        "p-gpu-x": [
            ("gpu.example.com", PreparedDevice("n1", "gpu-0", ("big",), ("v/c=x-0", "v/c=y"))),
            ("gpu.example.com", PreparedDevice("n1", "gpu-1", ("small",), ("v/c=x-1",))),
        ],
        "nic-claim": [("nic.example.com", PreparedDevice("n1", "nic-0", (), ()))],
        "later": [],
    }
    health = {
        ("gpu.example.com", "n1", "gpu-0"): (UNHEALTHY, "XID 79 (NoSchedule)"),
        ("gpu.example.com", "n1", "gpu-1"): (HEALTHY, "healthy"),
    }

    def status(messages: bool) -> dict[str, list[dict[str, Any]]]:
        return allocated_resources_status(
            pod,
            claims,
            lambda name: devices[name],
            lambda *key: health.get(key, (UNKNOWN, "")),
            messages=messages,
        )

    gpu = [
        {"resourceID": "v/c=x-0", "health": "Unhealthy", "message": "XID 79 (NoSchedule)"},
        {"resourceID": "v/c=x-1", "health": "Healthy", "message": "healthy"},
    ]
    assert status(True) == {
        "a": [
            {"name": "claim:gpu", "resources": gpu},
            {
                "name": "claim:nic",
                "resources": [{"resourceID": "nic.example.com/n1/nic-0", "health": "Unknown"}],
            },
        ],
        # every device of the claim, as the kubelet reports it, under the request's name
        "b": [{"name": "claim:gpu/big", "resources": gpu}],
    }
    without = status(False)["b"][0]["resources"]
    assert without == [{k: v for k, v in r.items() if k != "message"} for r in gpu]


class FakeHealthServer(hpb_grpc.DRAResourceHealthServicer):
    """A plugin's health service: each stream sends the next script's messages, then stays
    open until ``end`` is set (then ends), or aborts with ``code``."""

    def __init__(self, root: Path) -> None:
        self.socket = root / "health.sock"
        self.scripts: list[list[hpb.NodeWatchResourcesResponse]] = []
        self.end = threading.Event()
        self.code: grpc.StatusCode | None = None
        self.opened = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        hpb_grpc.add_DRAResourceHealthServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()

    def NodeWatchResources(
        self, request: hpb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[hpb.NodeWatchResourcesResponse]:
        self.opened += 1
        if self.code is not None:
            context.abort(self.code, "not here")
        yield from self.scripts.pop(0) if self.scripts else []
        while context.is_active() and not self.end.wait(0.05):
            pass
        self.end.clear()

    def stop(self) -> None:
        self.server.stop(0)


def message(
    **devices: tuple[hpb.HealthStatus.ValueType, str, int],
) -> hpb.NodeWatchResourcesResponse:
    return hpb.NodeWatchResourcesResponse(
        devices=[
            hpb.DeviceHealth(
                device=hpb.DeviceIdentifier(pool_name="n1", device_name=name),
                health=health,
                message=text,
                last_updated_time=1,  # the plugin's clock is ignored
                health_check_timeout_seconds=timeout,
            )
            for name, (health, text, timeout) in devices.items()
        ]
    )


def test_the_health_stream_fills_the_cache_is_reopened_and_cleared_when_it_ends(
    root: Path,
) -> None:
    server = FakeHealthServer(root)
    server.scripts = [
        [message(a=(hpb.HEALTHY, "ok", 0)), message(a=(hpb.UNHEALTHY, "XID 79", 0))],
        [message(a=(hpb.HEALTHY, "back", -1))],
    ]
    changes: list[list[tuple[str, str, str]]] = []
    health = NodeHealth(node="unit", retry=0.2, default_timeout=30, on_change=changes.append)
    channel = grpc.insecure_channel(f"unix://{server.socket}")
    try:
        assert health.watch("d", str(server.socket), channel, [V1, HEALTH_V1ALPHA1]) == (
            HEALTH_V1ALPHA1
        )
        wait_for(lambda: health.cache.get("d", "n1", "a") == (UNHEALTHY, "XID 79"), 5, "XID")
        assert changes == [[("d", "n1", "a")], [("d", "n1", "a")]]
        server.end.set()  # the stream ends: cleared, re-opened after 0.2 s
        wait_for(lambda: health.cache.get("d", "n1", "a") == (HEALTHY, "back"), 5, "reopen")
        assert server.opened == 2
        assert [("d", "n1", "a")] in changes[2:]
        health.unwatch(str(server.socket))
        assert health.cache.get("d", "n1", "a") == (UNKNOWN, "")
        assert health.watch("d", "x", channel, [V1]) is None  # no health service: no stream
    finally:
        health.stop()
        channel.close()
        server.stop()


def test_unimplemented_stops_watching(root: Path) -> None:
    server = FakeHealthServer(root)
    server.code = grpc.StatusCode.UNIMPLEMENTED
    health = NodeHealth(node="unit", retry=0.05, default_timeout=30, on_change=lambda _: None)
    channel = grpc.insecure_channel(f"unix://{server.socket}")
    try:
        health.watch("d", "ep", channel, [HEALTH_V1ALPHA1])
        w = health.watcher("ep")
        assert w is not None
        wait_for(lambda: not w.alive, 5, "the watcher to give up")
        assert w.unimplemented and server.opened == 1
    finally:
        health.stop()
        channel.close()
        server.stop()


# ---- pod resources API --------------------------------------------------------------------------
def test_claim_devices_per_container_follow_claims_requests_and_extended_mappings() -> None:
    claims = [PodClaim("a", "claim-a", True), PodClaim("", "ext-claim", True)]
    a0 = PreparedDevice("pool", "gpu-0", ("gpu",), ("v/c=a-0",), share_id="s0")
    a1 = PreparedDevice("pool", "gpu-1", ("other/sub",), ("v/c=a-1",))
    e0 = PreparedDevice("pool", "gpu-2", ("container-0-request-0",), ("v/c=e-0",))
    devices = {"claim-a": [("drv", a0), ("drv", a1)], "ext-claim": [("drv", e0)]}
    pod: dict[str, Any] = {
        "status": {
            "extendedResourceClaimStatus": {
                "resourceClaimName": "ext-claim",
                "requestMappings": [
                    {
                        "containerName": "x",
                        "resourceName": "r",
                        "requestName": "container-0-request-0",
                    }
                ],
            }
        }
    }

    def got(name: str, refs: list[dict[str, str]]) -> dict[str, list[str]]:
        container = {"name": name, "resources": {"claims": refs}}
        out = container_claim_devices(pod, container, claims, lambda n: devices.get(n, []))
        return {c: [d.device_name for _, d in ds] for c, ds in out.items()}

    assert got("c", [{"name": "a"}]) == {"claim-a": ["gpu-0", "gpu-1"]}
    assert got("c", [{"name": "a", "request": "other"}]) == {"claim-a": ["gpu-1"]}
    # the same claim through two requests: one entry, no duplicates
    both = [{"name": "a", "request": "gpu"}, {"name": "a"}]
    assert got("c", both) == {"claim-a": ["gpu-0", "gpu-1"]}
    assert got("c", []) == {}
    assert got("x", []) == {"ext-claim": ["gpu-2"]}
    devices["claim-a"] = []  # not prepared here: left out
    assert got("c", [{"name": "a"}]) == {}


def test_container_devices_are_one_entry_per_device_and_numa_node() -> None:
    out = container_devices_pb(
        [DeviceInstance("r/gpu", "d0", (0, 1)), DeviceInstance("r/gpu", "d1")]
    )
    assert [(c.resource_name, list(c.device_ids)) for c in out] == [
        ("r/gpu", ["d0"]),
        ("r/gpu", ["d0"]),
        ("r/gpu", ["d1"]),
    ]
    assert [[n.ID for n in c.topology.nodes] for c in out] == [[0], [1], []]
    assert not out[2].HasField("topology")


def _pr_pod(name: str, uid: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": uid},
        "spec": {
            "initContainers": [
                {"name": "setup"},  # not restartable: not listed
                {
                    "name": "side",
                    "restartPolicy": "Always",
                    "resources": {"claims": [{"name": "a"}]},
                },
            ],
            "containers": [
                {"name": "main", "resources": {"claims": [{"name": "a"}]}},
                {"name": "plain"},
            ],
        },
    }


def test_pod_resources_service_over_its_socket(root: Path) -> None:
    dev = PreparedDevice("pool-a", "gpu-0", ("gpu",), ("v/c=x", "v/c=y"), share_id="sh-1")
    dev2 = PreparedDevice("pool-a", "gpu-1", ("gpu",), ("v/c=z",))
    running = PodEntry(_pr_pod("p1", "u1"), [PodClaim("a", "claim-1", True)])
    finished = PodEntry(_pr_pod("p2", "u2"), [PodClaim("a", "claim-2", True)], active=False)
    dp = {("u1", "main"): [DeviceInstance("example.com/gpu", "d0", (1,))]}
    sources = Sources(
        active_pods=lambda: [running],
        find_pod=lambda ns, n: {("ns", "p1"): running, ("ns", "p2"): finished}.get((ns, n)),
        claim_devices=lambda ns, c: (
            [("drv.example", dev), ("drv.example", dev2)] if (ns, c) == ("ns", "claim-1") else []
        ),
        container_devices=lambda uid, key: dp.get((uid, key), []),
        allocatable=lambda: [DeviceInstance("example.com/gpu", "d1")],
    )
    server = PodResourcesServer(root / "pod-resources", sources, "unit")
    server.start()
    channel = grpc.insecure_channel(f"unix://{root / 'pod-resources' / 'kubelet.sock'}")
    try:
        stub = pr_grpc.PodResourcesListerStub(channel)
        listed = stub.List(prpb.ListPodResourcesRequest(), timeout=5).pod_resources
        assert [(p.name, p.namespace) for p in listed] == [("p1", "ns")]
        by_name = {c.name: c for c in listed[0].containers}
        assert list(by_name) == ["side", "main", "plain"]
        main = by_name["main"]
        assert [(d.resource_name, list(d.device_ids)) for d in main.devices] == [
            ("example.com/gpu", ["d0"])
        ]
        assert [n.ID for n in main.devices[0].topology.nodes] == [1]
        (dyn,) = main.dynamic_resources
        assert (dyn.claim_name, dyn.claim_namespace) == ("claim-1", "ns")
        first, second = dyn.claim_resources
        assert (first.driver_name, first.pool_name, first.device_name) == (
            "drv.example",
            "pool-a",
            "gpu-0",
        )
        assert [c.name for c in first.cdi_devices] == ["v/c=x", "v/c=y"]
        assert first.HasField("share_id") and first.share_id == "sh-1"
        assert [c.name for c in second.cdi_devices] == ["v/c=z"]
        assert not second.HasField("share_id")
        assert len(by_name["side"].dynamic_resources) == 1 and not by_name["side"].devices
        assert not by_name["plain"].dynamic_resources and not by_name["plain"].devices

        got = stub.Get(prpb.GetPodResourcesRequest(pod_name="p1", pod_namespace="ns"), timeout=5)
        assert got.pod_resources == listed[0]
        gone = stub.Get(prpb.GetPodResourcesRequest(pod_name="p2", pod_namespace="ns"), timeout=5)
        assert [c.name for c in gone.pod_resources.containers] == ["side", "main", "plain"]
        assert not any(c.devices or c.dynamic_resources for c in gone.pod_resources.containers)
        with pytest.raises(grpc.RpcError) as err:
            stub.Get(prpb.GetPodResourcesRequest(pod_name="nope", pod_namespace="ns"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "pod nope in namespace ns not found" in str(err.value.details())

        alloc = stub.GetAllocatableResources(prpb.AllocatableResourcesRequest(), timeout=5)
        assert [(d.resource_name, list(d.device_ids)) for d in alloc.devices] == [
            ("example.com/gpu", ["d1"])
        ]
        assert not alloc.cpu_ids and not alloc.memory
    finally:
        channel.close()
        server.stop()
    assert not (root / "pod-resources" / "kubelet.sock").exists()


class TopologyPlugin(dpb_grpc.DevicePluginServicer):
    """A device plugin that lists d0 (NUMA 0), d1 (no topology) and an unhealthy d2."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.done = threading.Event()

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return dpb.DevicePluginOptions()

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        numa0 = dpb.TopologyInfo(nodes=[dpb.NUMANode(ID=0)])
        yield dpb.ListAndWatchResponse(
            devices=[
                dpb.Device(ID="d0", health="Healthy", topology=numa0),
                dpb.Device(ID="d1", health="Healthy"),
                dpb.Device(ID="d2", health="Unhealthy"),
            ]
        )
        self.done.wait(30)

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        return dpb.PreferredAllocationResponse()

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return dpb.PreStartContainerResponse()

    def Allocate(self, request: Any, context: Any) -> Any:
        return dpb.AllocateResponse(
            container_responses=[
                dpb.ContainerAllocateResponse() for _ in request.container_requests
            ]
        )


def test_device_manager_reports_allocations_and_healthy_devices_with_numa(root: Path) -> None:
    config = NodeConfig(name="unit", root=root, timings=Timings.fast())
    config.make_dirs()
    manager = DeviceManager(config, lambda: None)
    manager.start()
    plugin = TopologyPlugin(config.device_plugins_dir / "topo.sock")
    server = UnixGrpcServer([plugin.socket], name="topo")
    server.add(dpb_grpc.add_DevicePluginServicer_to_server, plugin, "v1beta1.DevicePlugin")
    server.start()
    try:
        manager.register(
            dpb.RegisterRequest(version="v1beta1", endpoint="topo.sock", resource_name="ex.com/gpu")
        )
        allocatable = wait_for(manager.allocatable, 5, "ListAndWatch")
        assert allocatable == [
            DeviceInstance("ex.com/gpu", "d0", (0,)),
            DeviceInstance("ex.com/gpu", "d1", ()),
        ]
        pod = {
            "metadata": {"uid": "u1"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {"ex.com/gpu": 2}}}]},
        }
        manager.allocate(pod)
        assert manager.container_devices("u1", "main") == allocatable
        assert manager.container_devices("u1", "other") == []
    finally:
        plugin.done.set()
        manager.stop()
        server.stop(grace=0.2)
