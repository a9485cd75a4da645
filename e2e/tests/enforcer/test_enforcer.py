"""The enforcer's API, capability probe, CDI hook and restart, over its real unix socket.

Each enforcer is a real ``gpuslice-enforcer`` process with the fake NVML; the CDI hook is run by
the sandbox node agent's runtime code (OCI state on stdin, as runc does), on real processes in
real ``gpuslice-test-<random>`` cgroups.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from e2e.sandbox.nodeagent.runtime import CreateContainerError, run_hooks
from gpuslice_core.cdi import Hook
from gpuslice_nvml import MEMORY_LIMIT_MAX
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.enforcer import (
    Cgroups,
    EnforcerProcess,
    Workload,
    cgroup2_root,
    hook_missing,
    remove_tree,
    run_hook,
    run_hook_command,
    share_request,
    short_tempdir,
)

MIB = 1 << 20
NODE = """
name: enforcer-node
driverVersion: "{driver}"
statePath: state.json
gpus:
  - model: L4
  - model: A100-SXM4-40GB
"""
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups")


@pytest.fixture
def make_node() -> Iterator[Callable[[str], Path]]:
    dirs: list[Path] = []

    def make(driver: str) -> Path:
        directory = short_tempdir()
        dirs.append(directory)
        config = directory / "node.yaml"
        config.write_text(NODE.format(driver=driver))
        return config

    yield make
    for directory in dirs:
        remove_tree(directory)


@pytest.fixture
def enforcers() -> Iterator[list[EnforcerProcess]]:
    started: list[EnforcerProcess] = []
    yield started
    for proc in started:
        proc.stop()
        proc.stop_mps_daemons()


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


def _start(
    config: Path, enforcers: list[EnforcerProcess], *args: str, hook: str = "python"
) -> EnforcerProcess:
    proc = EnforcerProcess(config, config.parent, list(args), hook=hook).start()
    enforcers.append(proc)
    return proc


def _cdi_hooks(reply: pb.CreateShareResponse) -> list[Hook]:
    return [
        Hook(
            hook_name=h.hook_name,
            path=h.path,
            args=list(h.args),
            env=list(h.env),
            timeout=h.timeout_seconds if h.HasField("timeout_seconds") else None,
        )
        for h in reply.container_edits.hooks
    ]


def _oci_state(container_id: str, pid: int) -> dict[str, object]:
    return {
        "ociVersion": "1.2.0",
        "id": container_id,
        "status": "created",
        "pid": pid,
        "bundle": "/",
        "annotations": {},
    }


@pytest.mark.timeout(30)
def test_capabilities_say_what_each_gpu_can_do_and_why(
    make_node: Callable[[str], Path], enforcers: list[EnforcerProcess]
) -> None:
    old = _start(make_node("570.158.01"), enforcers, "--mps=off")
    new = _start(make_node("615.20.01"), enforcers)
    with old.channel() as channel:
        soft = old.stub(channel).GetCapabilities(pb.GetCapabilitiesRequest()).gpus
    with new.channel() as channel:
        hard = new.stub(channel).GetCapabilities(pb.GetCapabilitiesRequest()).gpus
    assert [g.level for g in soft] == [pb.ENFORCEMENT_LEVEL_SOFT] * 2
    assert not soft[0].memory_partitioning.available
    assert "615" in soft[0].memory_partitioning.reason
    assert "--mps=off" in soft[0].mps_protocol3.reason
    assert soft[0].driver_version == "570.158.01"
    assert (soft[0].memory_mechanism, soft[0].cores_mechanism) == (
        pb.MECHANISM_WATCHDOG,
        pb.MECHANISM_WATCHDOG,
    )
    assert [g.level for g in hard] == [pb.ENFORCEMENT_LEVEL_HARD] * 2
    assert hard[0].memory_partitioning.available == (cgroup2_root() is not None)
    assert hard[0].mps_protocol3.available and hard[0].mps_legacy.available
    assert hard[0].cores_mechanism == pb.MECHANISM_MPS_PROTOCOL3


@pytest.mark.timeout(30)
def test_shares_are_idempotent_validated_and_strict_ones_refused_on_soft_gpus(
    make_node: Callable[[str], Path], enforcers: list[EnforcerProcess]
) -> None:
    config = make_node("570.158.01")
    proc = _start(config, enforcers, "--mps=off")
    uuid = FakeNvml.from_config_file(config).gpu(0).uuid
    with proc.channel() as channel:
        stub = proc.stub(channel)
        strict = share_request("uid-strict", uuid, mode=pb.ENFORCEMENT_MODE_HARD, strict=True)
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateShare(strict)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "strict hard enforcement is not available" in str(refused.value.details())
        assert "615" in str(refused.value.details())

        lenient = share_request("uid-1", uuid, cores=40, mode=pb.ENFORCEMENT_MODE_HARD)
        first = stub.CreateShare(lenient)
        again = stub.CreateShare(lenient)
        assert first.created and not again.created and first.share_id == again.share_id
        assert first.level == pb.ENFORCEMENT_LEVEL_SOFT
        assert "using the watchdog" in first.limits[1].reason
        assert [limit.mechanism for limit in first.limits] == [pb.MECHANISM_WATCHDOG] * 2
        assert list(first.container_edits.env) == []  # the plugin names the limits per device
        assert [h.hook_name for h in first.container_edits.hooks] == [
            "createContainer",
            "poststop",
        ]
        assert "uid-1" in first.container_edits.hooks[0].args
        changed = share_request("uid-1", uuid, cores=41)
        with pytest.raises(grpc.RpcError) as conflict:
            stub.CreateShare(changed)
        assert conflict.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        bad = {
            "cores_percent": share_request("uid-bad", uuid, cores=0),
            "memory_bytes": share_request("uid-bad", uuid, memory=100),
        }
        for field, request in bad.items():
            with pytest.raises(grpc.RpcError) as invalid:
                stub.CreateShare(request)
            assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in str(invalid.value.details())
        with pytest.raises(grpc.RpcError) as unknown:
            stub.CreateShare(share_request("uid-bad", "GPU-00000000-0000-0000-0000-000000000000"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        usage = stub.GetUsage(pb.GetUsageRequest())
        assert [s.claim_uid for s in usage.shares] == ["uid-1"]
        released = stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-1"))
        assert released.released and released.share_id == first.share_id
        assert not stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-1")).released


@needs_root
@pytest.mark.timeout(60)
@pytest.mark.skipif(cgroup2_root() is None, reason="memory partitioning needs cgroup v2")
def test_hook_blocks_until_the_limit_is_set_and_one_byte_past_it_is_refused(
    make_node: Callable[[str], Path],
    enforcers: list[EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
    hook_kind: str,
) -> None:
    config = make_node("615.20.01")
    proc = _start(config, enforcers, "--mps=off", hook=hook_kind)
    fake = FakeNvml.from_config_file(config)
    limit = 256 * MIB + 3
    with proc.channel() as channel:
        reply = proc.stub(channel).CreateShare(
            share_request("uid-part", fake.gpu(0).uuid, memory=limit)
        )
    assert reply.limits[0].mechanism == pb.MECHANISM_MEMORY_PARTITION
    dirs = cgroups.container()
    v2_dir = next(d for d in dirs if not (d / "freezer.state").exists())
    workload = Workload(config, cgroup_dirs=dirs)  # the container's init, created, not started
    workloads.append(workload)

    proc.stop()  # the enforcer is restarting when the container is created
    outcome: list[BaseException | None] = []

    def create_container() -> None:
        try:
            run_hooks("createContainer", _cdi_hooks(reply), _oci_state("ctr-1", workload.pid))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    hook = threading.Thread(target=create_container)
    hook.start()
    time.sleep(1.0)
    assert hook.is_alive() and not outcome  # blocked: the limit is not in force yet
    assert not fake.memory_limits(0, str(v2_dir)).limited
    proc.start()
    hook.join(timeout=20)
    assert outcome == [None]
    limits = fake.memory_limits(0, str(v2_dir))  # in force the moment the hook returned
    assert (limits.soft_limit, limits.hard_limit) == (limit, limit)

    assert workload.ask(f"alloc {limit}") == f"ok {limit}"  # exactly the limit fits
    refused = workload.ask("alloc 1")
    assert refused.startswith("oom ") and "hard limit" in refused
    assert workload.ask("free 1") == f"ok {limit - 1}"

    with proc.channel() as channel:
        proc.stub(channel).ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-part"))
    assert fake.memory_limits(0, str(v2_dir)).hard_limit == MEMORY_LIMIT_MAX


@needs_root
@pytest.mark.timeout(60)
@pytest.mark.skipif(cgroup2_root() is None, reason="memory partitioning needs cgroup v2")
def test_hook_fails_the_container_when_the_limit_cannot_be_set(
    make_node: Callable[[str], Path],
    enforcers: list[EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
    hook_kind: str,
) -> None:
    config = make_node("615.20.01")
    proc = _start(config, enforcers, "--mps=off", "--hook-timeout=2", hook=hook_kind)
    fake = FakeNvml.from_config_file(config)
    with proc.channel() as channel:
        reply = proc.stub(channel).CreateShare(share_request("uid-f", fake.gpu(0).uuid))
    hooks = _cdi_hooks(reply)
    # A container without a cgroup v2 directory of its own cannot be partitioned.
    rootless = Workload(config)
    workloads.append(rootless)
    with pytest.raises(CreateContainerError, match="no cgroup v2 directory of its own"):
        run_hooks("createContainer", hooks, _oci_state("ctr-root", rootless.pid))
    # A claim the enforcer does not know (its share was released).
    boxed = Workload(config, cgroup_dirs=cgroups.container())
    workloads.append(boxed)
    with proc.channel() as channel:
        proc.stub(channel).ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-f"))
    with pytest.raises(CreateContainerError, match="NOT_FOUND"):
        run_hooks("createContainer", hooks, _oci_state("ctr-2", boxed.pid))
    # No enforcer at all: the hook gives up after its timeout and fails.
    proc.stop()
    started = time.monotonic()
    with pytest.raises(CreateContainerError, match=r"DEADLINE_EXCEEDED|UNAVAILABLE"):
        run_hooks("createContainer", hooks, _oci_state("ctr-3", boxed.pid))
    assert time.monotonic() - started < 10


@needs_root
@pytest.mark.timeout(60)
def test_the_python_hook_attaches_through_grpc_when_the_enforcer_has_no_attach_socket(
    make_node: Callable[[str], Path],
    enforcers: list[EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
) -> None:
    """An enforcer older than the attach socket serves only gRPC: the Python hook falls back to
    it (the static hook does not; see the next test)."""
    config = make_node("570.158.01")
    proc = _start(config, enforcers, "--mps=off")
    fake = FakeNvml.from_config_file(config)
    with proc.channel() as channel:
        reply = proc.stub(channel).CreateShare(share_request("uid-old", fake.gpu(0).uuid))
    attach_socket = proc.socket.with_name(proc.socket.name + ".attach")
    assert attach_socket.is_socket()  # the fast path the hook takes otherwise
    attach_socket.unlink()
    workload = Workload(config, cgroup_dirs=cgroups.container())
    workloads.append(workload)
    attach, detach = _cdi_hooks(reply)
    for hook, pid, said in (
        (attach, workload.pid, "attached ctr-old ("),
        (detach, 0, "detached ctr-old"),
    ):
        ran = subprocess.run(
            hook.args,
            executable=hook.path,
            input=json.dumps(_oci_state("ctr-old", pid)),
            env={},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.startswith(said)
    assert not attach_socket.exists()


@pytest.mark.timeout(60)
def test_the_static_hook_says_why_an_enforcer_without_attach_socket_is_out_of_reach(
    make_node: Callable[[str], Path], enforcers: list[EnforcerProcess]
) -> None:
    """It does not speak gRPC: it waits for an attach socket until its timeout, then fails the
    container, naming the cause (docs/enforcer.md, "The CDI hook")."""
    if hook_missing("go"):
        pytest.skip(hook_missing("go") or "")
    config = make_node("570.158.01")
    proc = _start(config, enforcers, "--mps=off", "--hook-timeout=1", hook="go")
    fake = FakeNvml.from_config_file(config)
    with proc.channel() as channel:
        reply = proc.stub(channel).CreateShare(share_request("uid-old", fake.gpu(0).uuid))
    attach_socket = proc.socket.with_name(proc.socket.name + ".attach")
    attach_socket.unlink()
    attach = next(h for h in reply.container_edits.hooks if h.hook_name == "createContainer")
    started = time.monotonic()
    ran = run_hook_command("go", attach.args[1:], _oci_state("ctr-old", os.getpid()))
    assert 0.9 < time.monotonic() - started < 4  # --hook-timeout=1
    assert ran.returncode == 1
    assert ran.stderr == (
        f"gpuslice-enforcer-hook: attach ctr-old of claim uid-old failed: UNAVAILABLE: no "
        f"enforcer listened on {attach_socket} (No such file or directory) until the timeout; "
        f"{proc.socket} has no attach socket beside it: an enforcer that old is reached only "
        "through gRPC, which this hook does not speak\n"
    )


@needs_root
@pytest.mark.timeout(60)
def test_a_restart_keeps_every_share_and_never_interrupts_workloads(
    make_node: Callable[[str], Path],
    enforcers: list[EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
    hook_kind: str,
) -> None:
    config = make_node("570.158.01")
    proc = _start(config, enforcers, "--mps=off", hook=hook_kind)
    fake, control = FakeNvml.from_config_file(config), FakeNvmlControl.from_config_file(config)
    uuids = [fake.gpu(0).uuid, fake.gpu(1).uuid]
    requests = [
        share_request("uid-a", uuids[0], cores=30, mode=pb.ENFORCEMENT_MODE_SOFT),
        share_request("uid-b", uuids[1], cores=50, memory=512 * MIB),
    ]
    with proc.channel() as channel:
        stub = proc.stub(channel)
        replies = [stub.CreateShare(r) for r in requests]
    hog = Workload(config, sm=90, cgroup_dirs=cgroups.container())
    workloads.append(hog)
    hook = next(h for h in replies[0].container_edits.hooks if h.hook_name == "createContainer")
    run_hook(hook, "ctr-hog", hog.pid)
    time.sleep(1.0)  # throttled by now, frozen part of the time

    proc.kill9()  # possibly while the hog's cgroup is frozen
    proc.start()
    with proc.channel() as channel:
        stub = proc.stub(channel)
        usage = stub.GetUsage(pb.GetUsageRequest())
        assert [s.claim_uid for s in usage.shares] == ["uid-a", "uid-b"]
        again = [stub.CreateShare(r) for r in requests]
        assert [a.created for a in again] == [False, False]
        assert [a.share_id for a in again] == [r.share_id for r in replies]
        time.sleep(0.5)
        before = control.sm_accounting(hog.pid)
        time.sleep(2.5)
        after = control.sm_accounting(hog.pid)
    assert hog.alive()
    achieved = (after.busy_seconds - before.busy_seconds) / (
        after.wall_seconds - before.wall_seconds
    )
    assert 0.2 <= achieved <= 0.4  # running again, and throttled again, after the restart
    assert "shares restored" in proc.tail(50000)
