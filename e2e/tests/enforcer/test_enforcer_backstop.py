"""No way out of an MPS share (issue 26): compute mode EXCLUSIVE_PROCESS while a GPU serves MPS
shares, honest levels where the mode is left alone, and the watchdog's backstop that freezes or
kills a process of an MPS share that does not go through the MPS server. The fake NVML models
MPS clients, bypassing processes and compute mode (``gpuslice_nvml.fake.contexts``); the MPS
daemons are the stand-in; processes and cgroups are real."""

from __future__ import annotations

import os
import queue
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.sandbox.procs import free_port
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_nvml.types import ComputeMode
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.core import wait_for
from gpuslice_testkit.enforcer import (
    Cgroups,
    EnforcerProcess,
    Workload,
    remove_tree,
    run_hook,
    share_request,
    short_tempdir,
    watch_violations,
)

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and the freezer"),
    pytest.mark.skipif(
        not Path("/sys/fs/cgroup/freezer/cgroup.procs").exists()
        and not Path("/sys/fs/cgroup/cgroup.freeze").exists(),
        reason="no cgroup freezer (v1 freezer hierarchy or cgroup v2)",
    ),
]

MIB, GIB = 1 << 20, 1 << 30
NODE = """
name: backstop-node
driverVersion: "580.159.04"
statePath: state.json
gpus:
  - model: NVIDIA H100 80GB HBM3
"""
PID_FILE = "nvidia-cuda-mps-control.pid"


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tempdir()
    yield path
    remove_tree(path)


@pytest.fixture
def node(workdir: Path) -> Path:
    config = workdir / "node.yaml"
    config.write_text(NODE)
    return config


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    made = Cgroups()
    yield made
    made.close()


@pytest.fixture
def workloads() -> Iterator[list[Workload]]:
    started: list[Workload] = []
    yield started
    for workload in started:
        workload.stop()


@pytest.fixture
def enforcer(node: Path, workdir: Path) -> Iterator[Callable[..., EnforcerProcess]]:
    started: list[EnforcerProcess] = []

    def start(*args: str, hook: str = "python") -> EnforcerProcess:
        """``hook``: the hook kind the share's edits name (test_enforcer.py tests both)."""
        proc = EnforcerProcess(node, workdir, list(args), hook=hook).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
    if started:
        started[-1].stop_mps_daemons()


def _next(violations: queue.Queue[pb.Violation], action: int, timeout: float = 5.0) -> pb.Violation:
    deadline = time.monotonic() + timeout
    while True:
        violation = violations.get(timeout=max(0.01, deadline - time.monotonic()))
        if violation.action == action:
            return violation


def _container(reply: pb.CreateShareResponse, workload: Workload, container_id: str) -> None:
    hook = next(h for h in reply.container_edits.hooks if h.hook_name == "createContainer")
    run_hook(hook, container_id, workload.pid)


def _daemon_gone(pipe: Path, pid: int) -> bool:
    return not (pipe / PID_FILE).exists() and not Path(f"/proc/{pid}").exists()


@pytest.mark.timeout(60)
def test_exclusive_compute_mode_while_mps_shares_exist_and_restored_after(
    node: Path,
    workdir: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
) -> None:
    fake = FakeNvml.from_config_file(node)
    uuid = fake.gpu(0).uuid
    proc = enforcer()
    pipe = proc.mps_root / "0"
    with proc.channel() as channel:
        stub = proc.stub(channel)
        gpu = stub.GetCapabilities(pb.GetCapabilitiesRequest()).gpus[0]
        assert gpu.exclusive_compute.available, gpu.exclusive_compute.reason
        assert gpu.level == pb.ENFORCEMENT_LEVEL_HARD
        assert fake.compute_mode(0) is ComputeMode.DEFAULT  # nothing changed before a share
        reply = stub.CreateShare(share_request("uid-x", uuid, cores=30, memory=4 * GIB))
        assert [lim.mechanism for lim in reply.limits] == [pb.MECHANISM_MPS_LEGACY] * 2
        assert reply.level == pb.ENFORCEMENT_LEVEL_HARD
        assert fake.compute_mode(0) is ComputeMode.EXCLUSIVE_PROCESS

        client = Workload(node, sm=20, cgroup_dirs=cgroups.container(), mps_pipe_dir=pipe)
        workloads.append(client)
        _container(reply, client, "ctr-client")
        assert [p.pid for p in fake.mps_processes(0)] == [client.pid]
        with pytest.raises(RuntimeError, match=r"unavailable.*EXCLUSIVE_PROCESS"):
            Workload(node, sm=80, cgroup_dirs=cgroups.container())  # no pipe directory
    daemon = int((pipe / PID_FILE).read_text())

    proc.stop()  # an enforcer restart (or upgrade) interrupts nothing
    assert client.alive() and not _daemon_gone(pipe, daemon)
    proc = enforcer()
    assert int((pipe / PID_FILE).read_text()) == daemon  # adopted, not restarted
    assert fake.compute_mode(0) is ComputeMode.EXCLUSIVE_PROCESS
    assert [p.pid for p in fake.mps_processes(0)] == [client.pid]

    with proc.channel() as channel:
        proc.stub(channel).ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-x"))
    assert fake.compute_mode(0) is ComputeMode.DEFAULT  # the mode it found
    wait_for(lambda: _daemon_gone(pipe, daemon), 10, "no control daemon left")


def _watchdog_samples(port: int) -> float:
    """How many samples the enforcer's watchdog has taken (its metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "gpuslice_enforcer_watchdog_sample"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


@pytest.mark.timeout(60)
def test_with_the_mode_left_alone_mps_is_soft_and_a_bypassing_process_is_killed(
    node: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
) -> None:
    fake = FakeNvml.from_config_file(node)
    port = free_port()
    proc = enforcer("--compute-mode=leave", f"--metrics-addr=127.0.0.1:{port}")
    pipe = proc.mps_root / "0"
    with proc.channel() as channel:
        stub = proc.stub(channel)
        gpu = stub.GetCapabilities(pb.GetCapabilitiesRequest()).gpus[0]
        assert not gpu.exclusive_compute.available
        assert "--compute-mode=leave" in gpu.exclusive_compute.reason
        assert gpu.level == pb.ENFORCEMENT_LEVEL_SOFT
        reply = stub.CreateShare(share_request("uid-b", fake.gpu(0).uuid, cores=30, memory=GIB))
        assert reply.level == pb.ENFORCEMENT_LEVEL_SOFT
        assert all("SOFT: compute mode DEFAULT" in lim.reason for lim in reply.limits)
        assert fake.compute_mode(0) is ComputeMode.DEFAULT
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            metrics = page.read().decode()
        assert 'gpuslice_enforcer_share_level{claim_uid="uid-b",level="soft"} 1.0' in metrics
        assert "claim-uid-b" not in metrics, "the claim's name is tenant data (issue 27)"
        violations, stop_watch = watch_violations(channel)

        # The legitimate client and the bypasser share one container (one cgroup): freezing
        # it would hold the client too, so the bypasser alone is killed.
        container = cgroups.container()
        client = Workload(node, sm=30, cgroup_dirs=container, mps_pipe_dir=pipe)
        workloads.append(client)
        _container(reply, client, "ctr-client")
        bypass = Workload(node, sm=80)  # no pipe directory; joins the container once ready
        workloads.append(bypass)
        # The watchdog sees it outside any share first: a cached "no share" must not outlive
        # the move into the container (it did, and the bypass then ran unharmed).
        seen = _watchdog_samples(port)
        while _watchdog_samples(port) < seen + 2:
            time.sleep(0.05)
        for directory in container:
            (directory / "cgroup.procs").write_text(str(bypass.pid))
        ready = time.monotonic()
        bypass.proc.wait(timeout=5)
        reaction = time.monotonic() - ready
        killed = _next(violations, pb.ACTION_KILLED)
        reported = stub.GetUsage(pb.GetUsageRequest(claim_uid="uid-b")).shares[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            caught = page.read().decode()
        before = FakeNvmlControl.from_config_file(node).sm_accounting(client.pid)
        time.sleep(1)
        after = FakeNvmlControl.from_config_file(node).sm_accounting(client.pid)
        stop_watch()
    print(f"bypass killed {reaction * 1000:.0f} ms after it started")
    assert bypass.proc.returncode == -9
    assert reaction <= 0.2 + 0.1  # two sampling periods (+ slack on a busy machine)
    assert "not a client of the MPS server" in killed.message and killed.pid == bypass.pid
    assert killed.mechanism == pb.MECHANISM_WATCHDOG
    assert reported.devices[0].violations >= 1 and reported.devices[0].kills == 1
    bypasses = (
        f'gpuslice_enforcer_share_bypasses_total{{UUID="{gpu.uuid}",claim_uid="uid-b",gpu="0"}}'
    )
    assert f"{bypasses} 1.0" in caught  # what the alert GpusliceShareBypass fires on
    assert client.alive()  # a legitimate client is never killed for another's bypass
    assert after.frozen_seconds - before.frozen_seconds < 0.05  # nor frozen


@pytest.mark.timeout(60)
def test_a_bypassing_process_over_the_memory_limit_is_killed(
    node: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
    hook_kind: str,
) -> None:
    fake = FakeNvml.from_config_file(node)
    proc = enforcer("--compute-mode=leave", "--sm-action=report", hook=hook_kind)  # SM: kept
    with proc.channel() as channel:
        stub = proc.stub(channel)
        reply = stub.CreateShare(
            share_request("uid-m", fake.gpu(0).uuid, cores=50, memory=256 * MIB)
        )
        violations, stop_watch = watch_violations(channel)
        bypass = Workload(node, memory=200 * MIB, cgroup_dirs=cgroups.container())
        workloads.append(bypass)
        _container(reply, bypass, "ctr-bypass")
        assert bypass.ask(f"alloc {100 * MIB}") == f"ok {300 * MIB}"
        over_at = time.monotonic()
        bypass.proc.wait(timeout=5)
        reaction = time.monotonic() - over_at
        killed = _next(violations, pb.ACTION_KILLED)
        stop_watch()
    assert bypass.proc.returncode == -9
    assert reaction <= 0.2 + 0.1
    assert killed.pid == bypass.pid and killed.mechanism == pb.MECHANISM_WATCHDOG
    assert "not a client of the MPS server" in killed.message


@pytest.mark.timeout(60)
def test_an_mps_daemon_the_checkpoint_does_not_know_is_stopped_at_start(
    node: Path, workdir: Path, enforcer: Callable[..., EnforcerProcess]
) -> None:
    proc = enforcer()
    with proc.channel() as channel:
        proc.stub(channel).CreateShare(
            share_request("uid-o", FakeNvml.from_config_file(node).gpu(0).uuid, cores=30)
        )
    pipe = proc.mps_root / "0"
    daemon = int((pipe / PID_FILE).read_text())
    proc.stop()
    remove_tree(proc.state_dir)  # the checkpoint is lost: nothing will ever use that daemon
    proc = enforcer()
    wait_for(lambda: _daemon_gone(pipe, daemon), 10, "the orphan daemon to be stopped")
    assert "stopping an MPS daemon no share uses" in proc.tail(50000)
