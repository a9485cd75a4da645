from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest

from gpuslice_testkit.core import (
    ServiceExitedError,
    ServiceProcess,
    WaitTimeoutError,
    at_once,
    wait_for,
)


def test_wait_for_returns_the_value_or_names_what_it_waited_for() -> None:
    values = iter([None, 0, "ready"])
    assert wait_for(lambda: next(values), 5, "the third try", interval=0.001) == "ready"
    with pytest.raises(WaitTimeoutError, match=r"waiting for the moon; last: False"):
        wait_for(lambda: False, 0.05, "the moon", interval=0.01)


def test_a_service_that_exits_early_shows_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(2)"]
    service = ServiceProcess("svc", argv, log=tmp_path / "svc.log", ready=lambda: False)
    with pytest.raises(ServiceExitedError, match=r"svc exited with 2:\nbad flag --x"):
        service.start(timeout=10)


def test_ready_then_graceful_stop_or_kill9(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    script = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    service = ServiceProcess(
        "svc", [sys.executable, "-c", script], log=tmp_path / "l", ready=marker.exists
    ).start(timeout=10)
    assert service.alive()
    assert service.terminate() == 0
    marker.unlink()
    crashing = ServiceProcess(
        "svc", [sys.executable, "-c", script], log=tmp_path / "l", ready=marker.exists
    ).start(timeout=10)
    crashing.kill9()
    assert crashing.wait() == -signal.SIGKILL and not crashing.alive()


def test_every_call_runs_together_and_is_timed() -> None:
    inside = threading.Barrier(4, timeout=5)  # passes only if all four are running at once
    latencies, wall = at_once([inside.wait] * 4)
    assert len(latencies) == 4 and wall > 0


def test_a_failed_call_fails_the_burst_after_all_are_done() -> None:
    done: list[int] = []

    def fails() -> None:
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match="1 of 3 calls failed: boom"):
        at_once([fails, lambda: done.append(1), lambda: done.append(2)])
    assert sorted(done) == [1, 2]
