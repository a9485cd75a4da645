"""Node-agent parts that need no API server: plugin registration over real gRPC sockets, the
container runtime (shim, hooks, signals), CDI edits into a container config, pod phase."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from e2e.sandbox.nodeagent.claims import PodClaim, container_cdi_ids
from e2e.sandbox.nodeagent.config import Timings
from e2e.sandbox.nodeagent.containers import build_config, expand
from e2e.sandbox.nodeagent.dra_plugins import V1, V1BETA1, DraPlugins, PreparedDevice
from e2e.sandbox.nodeagent.podstatus import ContainerView, phase
from e2e.sandbox.nodeagent.registration import PluginWatcher
from e2e.sandbox.nodeagent.runtime import (
    ContainerConfig,
    CreateContainerError,
    ExitStatus,
    Runtime,
)
from e2e.sandbox.nodeagent.testing import wait_for
from e2e.tests.standin_dra_plugin import DRIVER, StandinDraPlugin
from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Device, Hook
from gpuslice_kube.raw import RawApi

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
