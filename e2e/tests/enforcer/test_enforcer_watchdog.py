"""The NVML watchdog against real processes in real cgroups (fake NVML, real freezer).

The enforcer runs as its own process on a unix socket; fake-GPU workloads are real processes
(``gpuslice_nvml.fake.workload``) placed in ``gpuslice-test-<random>`` cgroups and attached to
their share by the real CDI hook, run the way runc runs it. Throttling is measured from the
fake's accounting of each workload's runnable time (kernel ``schedstat``), not from the
enforcer's own bookkeeping.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_nvml.fake.timeslice import TimeSlicedGpu
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
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

MIB = 1 << 20
NODE = """
name: watchdog-node
driverVersion: "{driver}"
statePath: state.json
gpus:
  - model: L4
    count: 2
"""


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tempdir()
    yield path
    remove_tree(path)


@pytest.fixture
def node(workdir: Path) -> Path:
    config = workdir / "node.yaml"
    config.write_text(NODE.format(driver="570.158.01"))
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
        proc = EnforcerProcess(node, workdir, ["--mps=off", *args], hook=hook).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
        proc.stop_mps_daemons()


def _attach(reply: pb.CreateShareResponse, workload: Workload, container_id: str) -> None:
    """Run the share's createContainer hook for a workload, as the runtime would."""
    hook = next(h for h in reply.container_edits.hooks if h.hook_name == "createContainer")
    run_hook(hook, container_id, workload.pid)


@pytest.mark.timeout(40)
def test_sm_use_of_80_against_30_converges_to_30(
    node: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
) -> None:
    proc = enforcer()
    fake, control = FakeNvml.from_config_file(node), FakeNvmlControl.from_config_file(node)
    with proc.channel() as channel:
        stub = proc.stub(channel)
        reply = stub.CreateShare(
            share_request("uid-sm", fake.gpu(0).uuid, cores=30, mode=pb.ENFORCEMENT_MODE_SOFT)
        )
        assert [lim.mechanism for lim in reply.limits] == [pb.MECHANISM_WATCHDOG] * 2
        violations, stop_watch = watch_violations(channel)
        workload = Workload(node, sm=80, cgroup_dirs=cgroups.container())
        workloads.append(workload)
        _attach(reply, workload, "ctr-sm")
        time.sleep(0.6)  # the burst credit (30 % x 0.5 s) is spent in 0.3 s at 80 %
        start = control.sm_accounting(workload.pid)
        time.sleep(10.0)  # the measured window
        end = control.sm_accounting(workload.pid)
        achieved = (end.busy_seconds - start.busy_seconds) / (end.wall_seconds - start.wall_seconds)
        frozen = (end.frozen_seconds - start.frozen_seconds) / (
            end.wall_seconds - start.wall_seconds
        )
        usage = stub.GetUsage(pb.GetUsageRequest(claim_uid="uid-sm")).shares[0].devices[0]
        stop_watch()
    print(f"achieved SM {achieved * 100:.1f}% (limit 30%), frozen {frozen * 100:.1f}% of the time")
    assert 25.0 <= achieved * 100 <= 35.0
    assert usage.throttled_seconds > 4.0
    throttled = violations.get(timeout=5)
    assert (throttled.action, throttled.resource) == (pb.ACTION_THROTTLED, pb.RESOURCE_CORES)
    assert throttled.claim_uid == "uid-sm"


@pytest.mark.timeout(40)
def test_sm_is_held_when_the_driver_samples_less_often_than_the_watchdog(
    workdir: Path, cgroups: Cgroups, workloads: list[Workload]
) -> None:
    """A real driver takes per-process samples on its own cadence (issue 26: a 30 % share ran
    at ~70 % on an H100 when polls without a sample counted as idle). Here it samples every
    300 ms while the watchdog polls every 100 ms."""
    node = workdir / "slow-node.yaml"
    node.write_text(NODE.format(driver="570.158.01") + "utilizationSampleMs: 300\n")
    proc = EnforcerProcess(node, workdir, ["--mps=off"]).start()
    control = FakeNvmlControl.from_config_file(node)
    try:
        with proc.channel() as channel:
            reply = proc.stub(channel).CreateShare(
                share_request(
                    "uid-slow",
                    FakeNvml.from_config_file(node).gpu(0).uuid,
                    cores=30,
                    mode=pb.ENFORCEMENT_MODE_SOFT,
                )
            )
            workload = Workload(node, sm=80, cgroup_dirs=cgroups.container())
            workloads.append(workload)
            _attach(reply, workload, "ctr-slow")
            time.sleep(1.0)  # the burst credit is spent
            start = control.sm_accounting(workload.pid)
            time.sleep(6.0)
            end = control.sm_accounting(workload.pid)
    finally:
        proc.stop()
    achieved = (end.busy_seconds - start.busy_seconds) / (end.wall_seconds - start.wall_seconds)
    print(f"achieved SM {achieved * 100:.1f}% (limit 30%) with 300 ms driver samples")
    assert 25.0 <= achieved * 100 <= 35.0


@pytest.mark.timeout(40)
def test_time_sliced_shares_of_30_and_70_get_30_and_70(
    node: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
) -> None:
    """Two shares' processes with contexts of their own are time-sliced by the GPU, and NVML
    reports each at its full demand (~99 % each on an H100, issue 26: the 30 % share got 13 %).
    What each really got is measured by splitting the GPU between the runnable ones."""
    proc = enforcer()
    uuid = FakeNvml.from_config_file(node).gpu(0).uuid
    with proc.channel() as channel:
        stub = proc.stub(channel)
        replies = {
            limit: stub.CreateShare(
                share_request(f"uid-{limit}", uuid, cores=limit, mode=pb.ENFORCEMENT_MODE_SOFT)
            )
            for limit in (30, 70)
        }
        running = {}
        for limit, reply in replies.items():
            running[limit] = Workload(node, sm=100, cgroup_dirs=cgroups.container())
            workloads.append(running[limit])
            _attach(reply, running[limit], f"ctr-{limit}")
        time.sleep(1.5)  # the burst credits are spent
        with TimeSlicedGpu({w.pid: 100 for w in running.values()}) as gpu:
            time.sleep(8.0)
    got = {limit: gpu.share(w.pid) * 100 for limit, w in running.items()}
    print(f"time-sliced: 30 % share got {got[30]:.1f} %, 70 % share got {got[70]:.1f} %")
    assert abs(got[30] - 30) <= 5 and abs(got[70] - 70) <= 5, got


@pytest.mark.timeout(30)
def test_watchdog_kills_a_process_over_its_memory_limit_within_two_periods(
    node: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
    hook_kind: str,
) -> None:
    proc = enforcer(hook=hook_kind)
    fake = FakeNvml.from_config_file(node)
    with proc.channel() as channel:
        stub = proc.stub(channel)
        reply = stub.CreateShare(
            share_request("uid-mem", fake.gpu(0).uuid, cores=50, memory=256 * MIB)
        )
        assert reply.limits[0].mechanism == pb.MECHANISM_WATCHDOG
        assert "615" in reply.limits[0].reason  # says why there is no partitioning
        violations, stop_watch = watch_violations(channel)
        workload = Workload(node, memory=200 * MIB, cgroup_dirs=cgroups.container())
        workloads.append(workload)
        _attach(reply, workload, "ctr-mem")
        time.sleep(0.3)
        assert workload.alive()  # under its limit: untouched
        assert workload.ask(f"alloc {100 * MIB}") == f"ok {300 * MIB}"
        over_at = time.monotonic()
        workload.proc.wait(timeout=5)
        reaction = time.monotonic() - over_at
        killed = violations.get(timeout=5)
        usage = stub.GetUsage(pb.GetUsageRequest(claim_uid="uid-mem")).shares[0].devices[0]
        stop_watch()
    print(f"killed {reaction * 1000:.0f} ms after the breach (sampling period 100 ms)")
    assert workload.proc.returncode == -9
    assert reaction <= 0.2 + 0.1  # two sampling periods (+ scheduling slack on a busy machine)
    assert (killed.action, killed.resource, killed.pid) == (
        pb.ACTION_KILLED,
        pb.RESOURCE_MEMORY,
        workload.pid,
    )
    assert killed.observed == 300 * MIB and killed.limit == 256 * MIB
    assert "over its limit" in killed.message and f"killed pid {workload.pid}" in killed.message
    assert usage.kills == 1 and usage.violations >= 1


@pytest.mark.timeout(40)
def test_other_claims_and_unknown_processes_are_never_touched(
    node: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
) -> None:
    proc = enforcer()
    fake, control = FakeNvml.from_config_file(node), FakeNvmlControl.from_config_file(node)
    uuid = fake.gpu(0).uuid
    with proc.channel() as channel:
        stub = proc.stub(channel)
        greedy = stub.CreateShare(share_request("uid-greedy", uuid, cores=20, memory=512 * MIB))
        modest = stub.CreateShare(share_request("uid-modest", uuid, cores=60, memory=512 * MIB))
        # The greedy claim overuses SM (throttled), the modest one stays within its limits.
        hog = Workload(node, sm=90, cgroup_dirs=cgroups.container())
        calm = Workload(node, sm=30, memory=100 * MIB, cgroup_dirs=cgroups.container())
        # Unknown: in a cgroup nobody attached, and one in no cgroup of its own, both far over
        # any limit in memory and SM.
        stranger = Workload(node, sm=90, memory=4096 * MIB, cgroup_dirs=cgroups.container())
        loner = Workload(node, sm=50, memory=2048 * MIB)
        workloads.extend([hog, calm, stranger, loner])
        _attach(greedy, hog, "ctr-hog")
        _attach(modest, calm, "ctr-calm")
        start = {w.pid: control.sm_accounting(w.pid) for w in (hog, calm, stranger, loner)}
        time.sleep(2.0)
        end = {w.pid: control.sm_accounting(w.pid) for w in (hog, calm, stranger, loner)}
        # Now the greedy claim goes over its memory limit: only its process dies.
        assert hog.ask(f"alloc {600 * MIB}").startswith("ok")
        hog.proc.wait(timeout=5)
        time.sleep(0.5)
    frozen = {pid: end[pid].frozen_seconds - start[pid].frozen_seconds for pid in start}
    # Four contexts time-sliced: the hog gets 90/260 of the GPU unthrottled, 35 % against 20 %,
    # so it is frozen about 40 % of the time once its burst credit is spent.
    assert frozen[hog.pid] > 0.4  # throttled
    for other in (calm, stranger, loner):
        assert frozen[other.pid] < 0.1, f"pid {other.pid} was frozen for {frozen[other.pid]} s"
        assert other.alive()
    assert hog.proc.returncode == -9


@pytest.mark.timeout(30)
def test_a_lone_work_conserving_share_is_not_throttled(
    node: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
) -> None:
    proc = enforcer()
    fake, control = FakeNvml.from_config_file(node), FakeNvmlControl.from_config_file(node)
    with proc.channel() as channel:
        stub = proc.stub(channel)
        reply = stub.CreateShare(
            share_request("uid-wc", fake.gpu(1).uuid, cores=30, work_conserving=True)
        )
        lone = Workload(node, device="1", sm=80, cgroup_dirs=cgroups.container())
        workloads.append(lone)
        _attach(reply, lone, "ctr-wc")
        first = control.sm_accounting(lone.pid)
        time.sleep(1.5)
        alone = control.sm_accounting(lone.pid)
        # Another process starts working on the GPU: now the share is held to its 30%.
        rival = Workload(node, device="1", sm=70)
        workloads.append(rival)
        time.sleep(0.8)
        with TimeSlicedGpu({lone.pid: 80, rival.pid: 70}) as gpu:  # what each really gets
            time.sleep(2.5)
    assert alone.frozen_seconds - first.frozen_seconds < 0.1
    assert 0.2 <= gpu.share(lone.pid) <= 0.4


@pytest.mark.timeout(30)
def test_an_nvml_error_kills_nothing_and_report_mode_only_reports(
    node: Path,
    enforcer: Callable[..., EnforcerProcess],
    cgroups: Cgroups,
    workloads: list[Workload],
) -> None:
    proc = enforcer("--memory-action=report")
    fake, control = FakeNvml.from_config_file(node), FakeNvmlControl.from_config_file(node)
    with proc.channel() as channel:
        stub = proc.stub(channel)
        reply = stub.CreateShare(share_request("uid-rep", fake.gpu(0).uuid, memory=64 * MIB))
        violations, stop_watch = watch_violations(channel)
        over = Workload(node, memory=128 * MIB, cgroup_dirs=cgroups.container())
        workloads.append(over)
        _attach(reply, over, "ctr-rep")
        reported = violations.get(timeout=5)
        assert (reported.action, reported.resource) == (pb.ACTION_REPORTED, pb.RESOURCE_MEMORY)
        control.mark_gpu_lost(0)  # every NVML call on GPU 0 now fails
        time.sleep(0.5)
        stop_watch()
        control.mark_gpu_recovered(0)
    assert over.alive()
    assert "watchdog sample failed" in proc.tail(20000)
