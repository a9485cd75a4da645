"""The MIG manager against the real control plane: the node label selects a layout from the
shipped ConfigMap, the state label goes pending -> success (or failed), and Events on the Node
say why. The manager runs unchanged as a process, on a fake 8x A100-SXM4-40GB node: on the fake
backend, and for a layout applied (MIG mode turned on: the GPUs reset by the stand-in
``nvidia-smi``) and an unknown layout also with ``--nvml=real`` on the mock libnvidia-ml
answering for that node (docs/nvml-mock.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from e2e.sandbox.binaries import REPO_ROOT
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import events_for, wait_event, wait_for
from gpuslice_core.grpcserver import check_health
from gpuslice_kube.raw import RawApi, resource_path
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_testkit.nvml_mock import NvmlBackend, mock_library_dir, nvml_env, nvml_flags

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(60)

MANIFEST = REPO_ROOT / "e2e" / "manifests" / "mig-configs.yaml"
LABEL = "gpuslice.dev/mig.config"
STATE = "gpuslice.dev/mig.config.state"
NODE = """\
name: {name}
statePath: fake-state.json
gpus:
  - model: A100-SXM4-40GB
    count: 8
"""
_SCRUB = (
    "NODE_NAME",
    "GPUSLICE_NODE_NAME",
    "KUBECONFIG",
    "GPUSLICE_CONFIG_FILE",
    "GPUSLICE_CONFIG_MAP",
    "GPUSLICE_DYNAMIC_MIG",
)


#: The tests that run on both backends take the fixture through this (the others: the fake).
BOTH_BACKENDS = pytest.mark.parametrize("mig_manager", ["fake", "mock"], indirect=True)


@dataclass
class Running:
    node: str
    fake: FakeNvml
    control: FakeNvmlControl
    log: Path


@pytest.fixture
def mig_manager(
    request: pytest.FixtureRequest,
    sandbox: ControlPlane,
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    tmp_path: Path,
) -> Iterator[Running]:
    """The manager on the node agent's node, on the fake backend or (``request.param`` "mock")
    with ``--nvml=real`` on the mock answering for the same fake node."""
    backend: NvmlBackend = getattr(request, "param", "fake")
    if backend == "mock":
        mock_library_dir()  # built before the manager's start is timed (a cold cache: seconds)
    manifest = yaml.safe_load(MANIFEST.read_text())
    kube.create(resource_path("v1", "configmaps", namespace=namespace), manifest)
    config = tmp_path / "node.yaml"
    config.write_text(NODE.format(name=f"mig-{node_agent.name}"))
    log = tmp_path / "mig-manager.log"
    with tempfile.TemporaryDirectory(prefix="gsmm-") as short:
        socket = Path(short) / "mig-manager.sock"
        argv = [
            sys.executable,
            "-m",
            "gpuslice_mig_manager",
            *nvml_flags(backend, config),
            f"--node-name={node_agent.name}",
            f"--kubeconfig={sandbox.kubeconfig}",
            f"--config-map={namespace}/{manifest['metadata']['name']}",
            f"--state-dir={tmp_path / 'state'}",
            f"--socket={socket}",
            "--metrics-addr=",
            "--health-addr=",
            "--retry-initial=0.2",
            "--retry-max=1",
            "--reconcile-interval=0",
        ]
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        env.update(nvml_env(backend, config))
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(
                lambda: proc.poll() is not None or check_health(socket, timeout=0.5),
                15,
                "the mig-manager socket",
            )
            assert proc.poll() is None, log.read_text()[-3000:]
            yield Running(
                node_agent.name,
                FakeNvml.from_config_file(config),
                FakeNvmlControl.from_config_file(config),
                log,
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                assert proc.wait(15) == 0, log.read_text()[-3000:]
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)


def label_and_follow(kube: RawApi, node: str, layout: str, until: set[str]) -> list[str]:
    """Set the layout label and return the state label's values from ``pending`` on, in order,
    until one of ``until`` (a watch sees every update, so a short ``pending`` is not missed)."""
    path = resource_path("v1", "nodes", name=node)
    version = kube.get(path)["metadata"]["resourceVersion"]
    stream = kube.watch(
        resource_path("v1", "nodes"),
        resource_version=version,
        field_selector=f"metadata.name={node}",
        timeout_seconds=40,
    )
    guard = threading.Timer(40, stream.close)
    guard.start()
    states: list[str] = []
    try:
        kube.patch(path, {"metadata": {"labels": {LABEL: layout}}})
        for event in stream:
            labels = event.object["metadata"].get("labels") or {}
            state = labels.get(STATE)
            if labels.get(LABEL) != layout or not (states or state == "pending"):
                continue  # before our change, or the previous layout's state
            if state and (not states or states[-1] != state):
                states.append(state)
            if state in until:
                break
    finally:
        guard.cancel()
        stream.close()
    return states


def instance_count(fake: FakeNvml) -> int:
    return sum(len(fake.mig_devices(i)) for i in range(fake.device_count()))


@BOTH_BACKENDS
def test_label_selects_a_layout_pending_then_success(kube: RawApi, mig_manager: Running) -> None:
    started = time.monotonic()
    states = label_and_follow(kube, mig_manager.node, "all-1g.5gb", {"success", "failed"})

    assert states == ["pending", "success"], mig_manager.log.read_text()[-3000:]
    # MIG mode on in effect (the GPUs reset), as the other front end of the node reads it
    modes = [mig_manager.fake.mig_mode(i) for i in range(mig_manager.fake.device_count())]
    assert all(m.current and m.pending for m in modes), modes
    assert instance_count(mig_manager.fake) == 56
    applied = wait_event(kube, "default", mig_manager.node, "MigConfigApplied")
    assert applied["type"] == "Normal"
    assert "applied MIG layout all-1g.5gb: 8 GPUs, 56 instances created" in applied["message"]
    assert applied["involvedObject"]["kind"] == "Node"
    assert applied["source"]["component"] == "gpuslice-mig-manager"

    states = label_and_follow(kube, mig_manager.node, "all-balanced", {"success", "failed"})
    assert states == ["pending", "success"]
    assert instance_count(mig_manager.fake) == 32
    assert time.monotonic() - started < 30


@BOTH_BACKENDS
def test_an_unknown_layout_fails_with_an_event(kube: RawApi, mig_manager: Running) -> None:
    states = label_and_follow(kube, mig_manager.node, "all-9g.99gb", {"success", "failed"})

    assert states == ["pending", "failed"]
    failed = wait_event(kube, "default", mig_manager.node, "MigConfigFailed")
    assert failed["type"] == "Warning"
    assert "no layout named 'all-9g.99gb'" in failed["message"]
    assert "all-balanced" in failed["message"]
    assert instance_count(mig_manager.fake) == 0


def test_a_busy_instance_holds_the_layout_pending_until_free(
    kube: RawApi, mig_manager: Running
) -> None:
    label_and_follow(kube, mig_manager.node, "all-1g.5gb", {"success", "failed"})
    busy = next(d for d in mig_manager.fake.mig_devices(3) if d.placement.start == 4)
    mig_manager.control.add_process(4242, busy.uuid, used_memory_bytes=1 << 30)

    path = resource_path("v1", "nodes", name=mig_manager.node)
    kube.patch(path, {"metadata": {"labels": {LABEL: "all-balanced"}}})

    waiting = wait_event(kube, "default", mig_manager.node, "MigConfigWaiting")
    assert waiting["type"] == "Warning"
    message = waiting["message"]
    assert "GPU 3" in message and "1g.5gb at 4:1" in message and "processes 4242" in message
    assert state_of(kube, mig_manager.node) == "pending"
    assert len(events_for(kube, "default", mig_manager.node, "MigConfigWaiting")) == 1

    mig_manager.control.remove_process(4242)

    wait_for(lambda: state_of(kube, mig_manager.node) == "success", 20, "state success")
    assert instance_count(mig_manager.fake) == 32


def state_of(kube: RawApi, node: str) -> str | None:
    labels = kube.get(resource_path("v1", "nodes", name=node))["metadata"].get("labels") or {}
    state: str | None = labels.get(STATE)
    return state
