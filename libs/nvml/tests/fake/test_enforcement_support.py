"""What the enforcer needs from the fake: driver gating, memory limits per cgroup, real processes
whose SM use honours frozen time. Real processes and real cgroups (root; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_nvml.types import MEMORY_LIMIT_MAX, MIB

pytestmark = pytest.mark.timeout(30)

V2_ROOT = Path("/sys/fs/cgroup/unified")
GIB_1 = 1 << 30
FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")

NODE = """
name: partition-node
driverVersion: "{driver}"
gpus:
  - model: L4
  - model: H100-SXM5-80GB
    migEnabled: true
"""


def _find_v2_root() -> Path | None:
    for candidate in (Path("/sys/fs/cgroup"), V2_ROOT):
        if (candidate / "cgroup.subtree_control").exists() and (
            candidate / "cgroup.procs"
        ).exists():
            return candidate
    return None


def _remove_cgroup(path: Path) -> None:
    if not path.exists():
        return
    procs = path / "cgroup.procs"
    for _ in range(50):
        pids = [int(p) for p in procs.read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                (path.parent / "cgroup.procs").write_text(str(pid))
        time.sleep(0.01)
    freezer_state = path / "freezer.state"
    if freezer_state.exists():
        freezer_state.write_text("THAWED")
    path.rmdir()


@pytest.fixture
def cgroups() -> Iterator[Callable[[Path], Path]]:
    """Make ``gpuslice-test-<random>`` cgroups under a hierarchy root; all removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    made: list[Path] = []

    def make(root: Path) -> Path:
        if not (root / "cgroup.procs").exists():
            pytest.skip(f"no cgroup hierarchy at {root}")
        path = root / f"gpuslice-test-{secrets.token_hex(4)}"
        path.mkdir()
        made.append(path)
        return path

    yield make
    for path in reversed(made):
        _remove_cgroup(path)


@pytest.fixture
def sleeper() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "60"])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _node(write_config: Callable[[str], Path], driver: str) -> Path:
    return write_config(NODE.format(driver=driver))


def test_memory_limit_calls_need_driver_615(write_config: Callable[[str], Path]) -> None:
    fake = FakeNvml.from_config_file(_node(write_config, "580.65.06"))
    with pytest.raises(e.NvmlFunctionNotFound, match=r"driver 580\.65\.06 .* needs 615"):
        fake.set_memory_limits(0, "/sys/fs/cgroup", 0, MIB)
    with pytest.raises(e.NvmlFunctionNotFound):
        fake.memory_limits(0, "/sys/fs/cgroup")


def test_allocation_past_the_hard_limit_is_refused_at_that_byte(
    write_config: Callable[[str], Path],
    cgroups: Callable[[Path], Path],
    sleeper: Callable[[], subprocess.Popen[bytes]],
) -> None:
    root = _find_v2_root()
    if root is None:
        pytest.skip("no cgroup v2 hierarchy")
    config = _node(write_config, "615.20.01")
    fake, control = FakeNvml.from_config_file(config), FakeNvmlControl.from_config_file(config)
    group = cgroups(root)
    proc = sleeper()
    (group / "cgroup.procs").write_text(str(proc.pid))
    hard = 512 * MIB + 7
    fake.set_memory_limits(0, str(group), 256 * MIB, hard)
    limits = fake.memory_limits(0, str(group))
    assert (limits.soft_limit, limits.hard_limit, limits.current_used) == (256 * MIB, hard, 0)

    control.add_process(proc.pid, 0, used_memory_bytes=100 * MIB, real=True)
    control.allocate_memory(proc.pid, 0, hard - 100 * MIB)  # exactly up to the hard limit
    assert fake.memory_limits(0, str(group)).current_used == hard
    with pytest.raises(e.NvmlInsufficientMemory, match="hard limit"):
        control.allocate_memory(proc.pid, 0, 1)
    assert fake.memory_info(0).used == hard  # the refused byte was not taken
    control.allocate_memory(proc.pid, 0, -1)
    control.allocate_memory(proc.pid, 0, 1)  # freeing makes room again

    fake.set_memory_limits(0, str(group), 0, MEMORY_LIMIT_MAX)  # clears
    assert not fake.memory_limits(0, str(group)).limited
    control.allocate_memory(proc.pid, 0, 1)


def test_memory_limit_errors(
    write_config: Callable[[str], Path], cgroups: Callable[[Path], Path]
) -> None:
    config = _node(write_config, "615.20.01")
    fake, control = FakeNvml.from_config_file(config), FakeNvmlControl.from_config_file(config)
    with pytest.raises(e.NvmlInvalidArgument):
        fake.set_memory_limits(0, "relative/path", 0, MIB)
    with pytest.raises(e.NvmlNotFound):
        fake.set_memory_limits(0, "/sys/fs/cgroup/no-such-cgroup-here", 0, MIB)
    with pytest.raises(e.NvmlNotSupported, match="MIG mode"):
        fake.set_memory_limits(1, "/sys/fs/cgroup", 0, MIB)
    if (FREEZER_ROOT / "cgroup.procs").exists() and os.geteuid() == 0:
        with pytest.raises(e.NvmlNotSupported, match="cgroup v2"):
            fake.set_memory_limits(0, str(cgroups(FREEZER_ROOT)), 0, MIB)
    root = _find_v2_root()
    if root is not None and os.geteuid() == 0:
        group = cgroups(root)
        with pytest.raises(e.NvmlInvalidArgument, match="soft <= hard"):
            fake.set_memory_limits(0, str(group), 2 * MIB, MIB)
        fake.set_memory_limits(0, str(group), MIB, MIB)
        assert len(control.memory_limit_records()) == 1
        group.rmdir()  # removing the cgroup clears its limits
        assert control.memory_limit_records() == []


def test_real_process_vanishes_when_it_exits(
    write_config: Callable[[str], Path], sleeper: Callable[[], subprocess.Popen[bytes]]
) -> None:
    config = _node(write_config, "570.158.01")
    fake, control = FakeNvml.from_config_file(config), FakeNvmlControl.from_config_file(config)
    proc = sleeper()
    control.add_process(proc.pid, 0, used_memory_bytes=GIB_1, sm_percent=40, real=True)
    control.add_process(4242, 0, used_memory_bytes=GIB_1)  # not real: stays
    assert {p.pid for p in fake.running_processes(0)} == {proc.pid, 4242}
    proc.kill()
    proc.wait()
    assert [p.pid for p in fake.running_processes(0)] == [4242]
    assert fake.memory_info(0).used == GIB_1
    with pytest.raises(e.NvmlNotFound):
        control.add_process(proc.pid, 0, real=True)  # no such OS process any more


def test_constant_real_process_uses_no_sm_while_frozen(
    write_config: Callable[[str], Path],
    cgroups: Callable[[Path], Path],
    sleeper: Callable[[], subprocess.Popen[bytes]],
) -> None:
    config = _node(write_config, "570.158.01")
    fake, control = FakeNvml.from_config_file(config), FakeNvmlControl.from_config_file(config)
    group = cgroups(FREEZER_ROOT)
    proc = sleeper()
    (group / "cgroup.procs").write_text(str(proc.pid))
    control.add_process(proc.pid, 0, sm_percent=70, real=True)
    assert [s.sm_percent for s in fake.process_utilization(0)] == [70]
    (group / "freezer.state").write_text("FROZEN")
    try:
        assert [s.sm_percent for s in fake.process_utilization(0)] == [0]
        assert fake.utilization(0).gpu_percent == 0
    finally:
        (group / "freezer.state").write_text("THAWED")
    assert fake.utilization(0).gpu_percent == 70


def _freezer(group: Path, state: str) -> None:
    """Set a v1 freezer cgroup's state and return once the kernel reports it: FROZEN passes
    through FREEZING until every task has stopped, which a loaded machine makes take a while
    (a window started before that counted running time as frozen)."""
    (group / "freezer.state").write_text(state)
    deadline = time.monotonic() + 10
    while (group / "freezer.state").read_text().strip() != state:
        assert time.monotonic() < deadline, f"{group} never became {state}"
        time.sleep(0.01)


def _workload(config: Path, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuslice_nvml.fake.workload", "--config", str(config), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise AssertionError(f"workload did not start: {line!r}")
    return proc


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_runnable_accounting_excludes_frozen_time(
    write_config: Callable[[str], Path], cgroups: Callable[[Path], Path]
) -> None:
    config = _node(write_config, "570.158.01")
    fake, control = FakeNvml.from_config_file(config), FakeNvmlControl.from_config_file(config)
    group = cgroups(FREEZER_ROOT)
    proc = _workload(config, "--sm", "80", "--cgroup", str(group))
    try:
        time.sleep(0.3)
        began = time.monotonic()
        _freezer(group, "FROZEN")
        fake.process_utilization(0)  # start this reader's window, frozen
        time.sleep(0.5)
        during = fake.process_utilization(0)
        _freezer(group, "THAWED")
        ended = time.monotonic()
        assert [s.sm_percent for s in during] and during[0].sm_percent <= 10
        acct = control.sm_accounting(proc.pid)
        # frozen at least the window; at most from the FROZEN write to the THAWED read
        assert 0.45 <= acct.frozen_seconds <= ended - began + 0.05
        assert acct.busy_seconds == pytest.approx(0.8 * acct.active_seconds, rel=0.02)
        # Thawed, it accrues SM time again. Not judged over a fixed window: the workload runs
        # at SCHED_IDLE, and the kernel books a waiting task's wait only once it gets a CPU,
        # which on a loaded machine can be more than a second away (2 % over 0.3 s was seen
        # at a load average of 6).
        deadline = time.monotonic() + 10
        while control.sm_accounting(proc.pid).busy_seconds <= acct.busy_seconds:
            assert time.monotonic() < deadline, "the thawed workload never ran again"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert fake.running_processes(0) == []  # it unregistered itself


def test_workload_allocations_hit_the_limit(
    write_config: Callable[[str], Path], cgroups: Callable[[Path], Path]
) -> None:
    root = _find_v2_root()
    if root is None:
        pytest.skip("no cgroup v2 hierarchy")
    config = _node(write_config, "615.20.01")
    fake = FakeNvml.from_config_file(config)
    group = cgroups(root)
    fake.set_memory_limits(0, str(group), 0, 64 * MIB)
    proc = _workload(config, "--memory", "32MiB", "--cgroup", str(group))
    try:
        assert _ask(proc, f"alloc {32 * MIB}") == f"ok {64 * MIB}"
        assert _ask(proc, "alloc 1").startswith("oom ")
        assert _ask(proc, "free 1MiB") == f"ok {63 * MIB}"
        assert _ask(proc, "exit") == "bye"
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
