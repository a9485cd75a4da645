"""Test support shared by every service's tests, the e2e suites and bench/.

``ServiceProcess`` runs a gpuslice service as a real process (its log kept in a file and shown
when it fails to come up), waits until it is ready, and stops it gracefully (SIGTERM) or as a
crash would (SIGKILL). ``wait_for`` polls a condition with a deadline instead of sleeping and
hoping. ``preserved_logging`` undoes what a service's ``main`` run in-process did to logging.
``at_once`` starts calls together, as a burst of clients would, and times each.
``http_probe`` asks a service's ``/healthz`` or ``/readyz`` as the kubelet's httpGet would.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Self, TypeVar

import structlog

T = TypeVar("T")


def http_probe(port: int, path: str = "/readyz", host: str = "127.0.0.1") -> int | None:
    """The status ``GET path`` answers (gpuslice_core.health), None when nothing listens (or
    the server went away mid-answer, as a stopping one does)."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        reply.read()
        return reply.status
    except ConnectionError:
        return None
    finally:
        conn.close()


def at_once(calls: Sequence[Callable[[], object]]) -> tuple[list[float], float]:
    """Run every call at the same moment, one thread each (released by one barrier): the
    per-call latencies and the wall time of the whole burst. Raises after every thread is done
    if any call failed, naming how many and the first error."""
    latencies: list[float] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(calls) + 1)
    lock = threading.Lock()

    def run(call: Callable[[], object]) -> None:
        barrier.wait()
        start = time.perf_counter()
        try:
            call()
        except Exception as exc:  # reported below, once every thread is done
            with lock:
                errors.append(exc)
        with lock:
            latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(calls)} calls failed: {errors[0]}")
    return latencies, wall


@contextlib.contextmanager
def preserved_logging() -> Iterator[None]:
    """Put the process's logging set-up (root handlers and level, structlog's configuration)
    back afterwards. A service's ``main`` configures logging for the whole process; run from a
    test, it would route every later test's log lines, from every thread, its way."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.configure(**config)


class WaitTimeoutError(AssertionError):
    """What was waited for did not happen in time (the message names it and the last value)."""


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.05,
    max_interval: float = 0.5,
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; fail after
    ``timeout`` seconds with a message naming ``what`` and the last value seen. A predicate may
    raise AssertionError to explain why it is not satisfied yet."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except AssertionError as exc:
            value, last = None, exc
        else:
            last = value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(
                f"timed out after {timeout:g}s waiting for {what}; last: {last!r}"
            )
        time.sleep(interval)
        interval = min(interval * 1.5, max_interval)


class ServiceExitedError(RuntimeError):
    """The service exited (or never became ready); the message carries its log's tail."""


class ServiceProcess:
    """One service process with its output in ``log``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log: Path,
        ready: Callable[[], bool],
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        self.ready = ready
        self.env = dict(env) if env is not None else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Self:
        """Start and wait until ``ready()``; raise with the log's tail if it exits first."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        deadline = time.monotonic() + timeout
        interval = 0.02
        while not self.ready():
            if self.proc.poll() is not None:
                raise ServiceExitedError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise ServiceExitedError(
                    f"{self.name} was not ready within {timeout:g}s:\n{self.tail()}"
                )
            time.sleep(interval)
            interval = min(interval * 1.5, 0.2)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return f"(no log at {self.log})"

    def wait(self, timeout: float = 10.0) -> int:
        """Wait for the process to end; its exit status (negative: the signal)."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.wait(timeout)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait: the exit status of a graceful stop."""
        assert self.proc is not None, f"{self.name} was never started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        """SIGKILL, as a crash: nothing is cleaned up."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, and SIGKILL if it is still there after ``grace`` seconds."""
        if not self.alive():
            return
        try:
            self.terminate(grace)
        except subprocess.TimeoutExpired:
            self.kill9()
