"""The watchdog's loop survives a sample that fails every period, without flooding the log, and
fails open: a share it froze is thawed when the sample that would have thawed it crashes."""

from __future__ import annotations

import time
from pathlib import Path

from structlog.testing import capture_logs

from gpuslice_enforcer.cgroups import CgroupView
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.metrics import EnforcerMetrics
from gpuslice_enforcer.state import ShareRecord
from gpuslice_enforcer.violations import ViolationBus
from gpuslice_enforcer.watchdog import Watchdog, _Runtime
from gpuslice_nvml.fake import FakeNvml


def test_a_sample_failing_every_period_is_logged_once_per_ten_seconds(tmp_path: Path) -> None:
    calls = 0

    def shares() -> tuple[int, list[ShareRecord]]:
        nonlocal calls
        calls += 1
        raise OSError(24, "Too many open files")

    config = EnforcerConfig(socket=tmp_path / "e.sock", state_dir=tmp_path, sample_interval_s=0.005)
    nvml = FakeNvml.__new__(FakeNvml)  # never called: the sample fails before any NVML call
    watchdog = Watchdog(nvml, config, CgroupView(), shares, ViolationBus(), EnforcerMetrics())
    with capture_logs() as logs:
        watchdog.start()
        deadline = time.monotonic() + 10
        while calls < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        watchdog.stop()
    crashed = [entry for entry in logs if entry["event"] == "watchdog sample crashed"]
    assert calls >= 40  # the loop kept sampling
    assert len(crashed) == 1 and crashed[0]["recurred"] == 0


def test_a_share_frozen_when_a_sample_crashes_is_thawed_at_once(tmp_path: Path) -> None:
    """Fail open: the period a share was frozen for ends even when the sample that would have
    thawed it crashes (here every sample does, before any NVML call)."""
    cgroup = tmp_path / "container"
    cgroup.mkdir()
    (cgroup / "cgroup.freeze").write_text("1")  # as the previous period's sample left it
    calls = 0

    def shares() -> tuple[int, list[ShareRecord]]:
        nonlocal calls
        calls += 1
        raise FileNotFoundError(2, "No such file or directory", "/proc/4242/cgroup")

    config = EnforcerConfig(socket=tmp_path / "e.sock", state_dir=tmp_path, sample_interval_s=0.005)
    nvml = FakeNvml.__new__(FakeNvml)  # never called: the sample fails before any NVML call
    watchdog = Watchdog(nvml, config, CgroupView(), shares, ViolationBus(), EnforcerMetrics())
    watchdog._runtime["claim-uid"] = _Runtime(targets={cgroup}, frozen=True)
    watchdog.start()
    try:
        deadline = time.monotonic() + 10
        while calls < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        state = (cgroup / "cgroup.freeze").read_text().strip()
    finally:
        watchdog.stop()
    assert calls >= 2
    assert state == "0", "the crashed sample left the share frozen"
