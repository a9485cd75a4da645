"""MPS tiers with the stand-in control daemon: protocol 3 namespaces per claim, legacy MPS
environment, and a killed daemon restarted with its namespaces."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslice_nvml.fake import FakeNvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.enforcer import (
    EnforcerProcess,
    remove_tree,
    share_request,
    short_tempdir,
)

NODE = """
name: mps-node
driverVersion: "{driver}"
statePath: state.json
gpus:
  - model: H100-SXM5-80GB
"""
GIB = 1 << 30


@pytest.fixture
def enforcer() -> Iterator[Callable[[str], EnforcerProcess]]:
    started: list[EnforcerProcess] = []
    dirs: list[Path] = []

    def start(driver: str) -> EnforcerProcess:
        directory = short_tempdir()
        dirs.append(directory)
        config = directory / "node.yaml"
        config.write_text(NODE.format(driver=driver))
        proc = EnforcerProcess(config, directory, ["--memory-partitioning=off"]).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
        proc.stop_mps_daemons()
    for directory in dirs:
        remove_tree(directory)


def _daemon_state(pipe: Path) -> dict[str, object]:
    state: dict[str, object] = json.loads((pipe / ".gpuslice-fake-mps.json").read_text())
    return state


def _wait(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_protocol3_namespaces_appear_per_claim_and_vanish_at_release(
    enforcer: Callable[[str], EnforcerProcess],
) -> None:
    proc = enforcer("615.20.01")
    uuid = FakeNvml.from_config_file(proc.config).gpu(0).uuid
    pipe = proc.mps_root / "0"
    with proc.channel() as channel:
        stub = proc.stub(channel)
        a = stub.CreateShare(share_request("uid-a", uuid, cores=30, memory=8 * GIB))
        b = stub.CreateShare(share_request("uid-b", uuid, cores=60, memory=16 * GIB))
        assert [lim.mechanism for lim in a.limits] == [pb.MECHANISM_MPS_PROTOCOL3] * 2
        assert a.level == pb.ENFORCEMENT_LEVEL_HARD
        servers = _daemon_state(pipe)["servers"]
        assert isinstance(servers, dict)
        namespaces = servers["gpuslice"]["namespaces"]
        assert namespaces[a.share_id] == {
            "active_thread_percentage": 30,
            "pinned_memory_limit": "8192M",
            "client_priority": None,
        }
        assert namespaces[b.share_id]["active_thread_percentage"] == 60
        # The claim's containers connect to their namespace's socket.
        mount = a.container_edits.mounts[0]
        assert Path(mount.host_path) == pipe / "gpuslice" / a.share_id
        assert (Path(mount.host_path) / "control").is_socket()
        env = dict(e.split("=", 1) for e in a.container_edits.env)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == mount.container_path

        stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-a"))
        servers = _daemon_state(pipe)["servers"]
        assert isinstance(servers, dict)
        assert list(servers["gpuslice"]["namespaces"]) == [b.share_id]
        assert not (pipe / "gpuslice" / a.share_id).exists()
        stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-b"))
    assert _wait(lambda: not (pipe / "control").exists())  # the last share stops the daemon


@pytest.mark.timeout(60)
def test_a_killed_mps_daemon_is_restarted_with_its_namespaces(
    enforcer: Callable[[str], EnforcerProcess],
) -> None:
    proc = enforcer("615.20.01")
    uuid = FakeNvml.from_config_file(proc.config).gpu(0).uuid
    pipe = proc.mps_root / "0"
    with proc.channel() as channel:
        share = proc.stub(channel).CreateShare(share_request("uid-k", uuid, cores=25))
    first = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    os.kill(first, signal.SIGKILL)

    def restarted() -> bool:
        try:
            state = _daemon_state(pipe)
        except (OSError, ValueError):
            return False
        servers = state.get("servers")
        return (
            state.get("pid") != first
            and isinstance(servers, dict)
            and share.share_id in servers.get("gpuslice", {}).get("namespaces", {})
        )

    assert _wait(restarted)
    assert "mps daemon died; restarting" in proc.tail(50000)


@pytest.mark.timeout(60)
def test_legacy_mps_gives_the_client_its_limits_in_the_environment(
    enforcer: Callable[[str], EnforcerProcess],
) -> None:
    proc = enforcer("570.158.01")  # no protocol 3 before 615
    uuid = FakeNvml.from_config_file(proc.config).gpu(0).uuid
    with proc.channel() as channel:
        stub = proc.stub(channel)
        caps = stub.GetCapabilities(pb.GetCapabilitiesRequest()).gpus[0]
        assert not caps.mps_protocol3.available and "615" in caps.mps_protocol3.reason
        reply = stub.CreateShare(share_request("uid-l", uuid, cores=40, memory=4 * GIB))
    assert [lim.mechanism for lim in reply.limits] == [pb.MECHANISM_MPS_LEGACY] * 2
    env = dict(e.split("=", 1) for e in reply.container_edits.env)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert Path(reply.container_edits.mounts[0].host_path) == proc.mps_root / "0"
    assert _daemon_state(proc.mps_root / "0")["protocol"] == 2


@pytest.mark.timeout(60)
def test_mps_directories_have_explicit_modes_whatever_the_umask() -> None:
    directory = short_tempdir()
    config = directory / "node.yaml"
    config.write_text(NODE.format(driver="570.158.01"))
    proc = EnforcerProcess(config, directory, ["--memory-partitioning=off"])
    previous = os.umask(0)  # inherited by the enforcer and the daemon it starts
    try:
        proc.start()
    finally:
        os.umask(previous)
    try:
        with proc.channel() as channel:
            uuid = FakeNvml.from_config_file(config).gpu(0).uuid
            proc.stub(channel).CreateShare(share_request("uid-modes", uuid, cores=40))
        modes = {
            path.relative_to(proc.mps_root).as_posix(): stat.S_IMODE(path.stat().st_mode)
            for path in (proc.mps_root / "0", proc.mps_root / "log" / "0")
        }
    finally:
        proc.stop()
        proc.stop_mps_daemons()
        remove_tree(directory)
    assert modes == {"0": 0o755, "log/0": 0o700}  # were 0777
