"""The watchdog's pidfd tracking: a tracked process is reported once it exits, and only then."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuslice_enforcer.watchdog import LiveProcesses

pytestmark = pytest.mark.timeout(30)


def test_an_exited_process_is_reported_once_and_forgotten() -> None:
    live = LiveProcesses()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ending = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert live.track(running.pid) and live.track(ending.pid)
        ending.wait(10)  # exited (and reaped): its pid may be reused from now on
        assert live.exited() == [ending.pid]
        assert live.exited() == []  # reported once
        assert not live.tracking(ending.pid) and live.tracking(running.pid)
    finally:
        running.kill()
        running.wait(10)
    assert live.exited() == [running.pid]
    live.close()


def test_a_pid_that_does_not_exist_cannot_be_tracked() -> None:
    live = LiveProcesses()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    assert not live.track(gone.pid)
    assert not live.tracking(gone.pid)
