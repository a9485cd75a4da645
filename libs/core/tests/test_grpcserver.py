from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpuslice_core.errors import FailedPreconditionError, ResourceExhaustedError
from gpuslice_core.grpcserver import (
    StopSignals,
    UnixGrpcServer,
    check_health,
    remove_stale_socket,
)

SERVICE = "test.Probe"


def _handlers(entered: threading.Event, release: threading.Event) -> grpc.GenericRpcHandler:
    def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
        kind = request.decode()
        if kind == "busy":
            raise FailedPreconditionError("GPU-1 is in use by pid 42")
        if kind == "full":
            raise ResourceExhaustedError("no 1g.10gb placement left on GPU-1")
        if kind == "abort":
            context.abort(grpc.StatusCode.NOT_FOUND, "claim uid-7 is gone")
        if kind == "slow":
            entered.set()
            release.wait(5)
            return b"finished"
        return {"crash": b""}[kind]  # KeyError for anything else: an unexpected bug

    def count(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"1"
        raise FailedPreconditionError("stream interrupted")

    def hold(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"open"
        while context.is_active() and not release.wait(0.05):
            pass

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Fail": grpc.unary_unary_rpc_method_handler(fail),
            "Count": grpc.unary_stream_rpc_method_handler(count),
            "Hold": grpc.unary_stream_rpc_method_handler(hold),
        },
    )


class Running:
    def __init__(self, tmp_path: Path, **options: Any) -> None:
        self.socket = tmp_path / "plugins" / "probe.sock"
        self.entered = threading.Event()
        self.release = threading.Event()
        self.server = UnixGrpcServer([self.socket], name="probe", **options)

        def add(handler: Any, server: grpc.Server) -> None:
            server.add_generic_rpc_handlers((handler,))

        self.server.add(add, _handlers(self.entered, self.release), SERVICE)

    def call(self, method: str, payload: bytes, timeout: float = 5) -> Any:
        with grpc.insecure_channel(f"unix://{self.socket}") as typed_channel:
            channel: Any = typed_channel  # raw bytes methods: no generated stub to type them
            if method == "Count":
                return list(channel.unary_stream(f"/{SERVICE}/Count")(payload, timeout=timeout))
            return channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=timeout)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    r = Running(tmp_path)
    r.server.start()
    yield r
    r.release.set()
    r.server.stop(grace=1)


@pytest.mark.parametrize(
    ("kind", "code", "details"),
    [
        ("busy", grpc.StatusCode.FAILED_PRECONDITION, "GPU-1 is in use by pid 42"),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, "no 1g.10gb placement left on GPU-1"),
        ("bug", grpc.StatusCode.INTERNAL, "internal error: KeyError: 'bug'"),
        ("abort", grpc.StatusCode.NOT_FOUND, "claim uid-7 is gone"),
    ],
)
def test_domain_errors_become_status_codes(
    running: Running, kind: str, code: grpc.StatusCode, details: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        running.call("Fail", kind.encode())
    assert info.value.code() == code
    assert info.value.details() == details


def test_stream_errors_become_status_codes(running: Running) -> None:
    with pytest.raises(grpc.RpcError) as info:
        running.call("Count", b"")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_health_reports_serving_per_service(running: Running) -> None:
    assert check_health(running.socket)
    assert check_health(running.socket, SERVICE)
    assert not check_health(running.socket, "no.Such")


def test_stop_finishes_in_flight_calls_and_removes_the_socket(running: Running) -> None:
    result: list[bytes] = []
    caller = threading.Thread(target=lambda: result.append(running.call("Fail", b"slow")))
    caller.start()
    assert running.entered.wait(5)
    stopper = threading.Thread(target=running.server.stop, kwargs={"grace": 5})
    stopper.start()
    running.release.set()
    caller.join(5)
    stopper.join(5)
    assert result == [b"finished"]
    assert not running.socket.exists()
    assert not check_health(running.socket, timeout=0.5)


KILLED_SERVER = """
import sys, time
from pathlib import Path
from gpuslice_core.grpcserver import UnixGrpcServer
server = UnixGrpcServer([Path(sys.argv[1])], name="doomed")
server.start()
print("ready", file=sys.stderr, flush=True)
time.sleep(60)
"""


def test_stale_socket_of_a_killed_server_is_replaced(tmp_path: Path) -> None:
    first = Running(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SERVER, str(first.socket)], stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None and proc.stderr.readline().strip() == "ready"
    finally:
        proc.kill()  # SIGKILL: no chance to clean up
        proc.wait(5)
    assert first.socket.is_socket(), "a killed server leaves its socket behind"
    assert not check_health(first.socket, timeout=0.5)
    first.server.start()
    try:
        assert check_health(first.socket)
    finally:
        first.server.stop(grace=0)


def test_a_regular_file_at_the_socket_path_is_never_deleted(tmp_path: Path) -> None:
    path = tmp_path / "important.sock"
    path.write_text("not a socket")
    with pytest.raises(FileExistsError, match="is not a unix socket"):
        remove_stale_socket(path)
    assert path.read_text() == "not a socket"


def test_stop_leaves_a_successors_socket_alone(tmp_path: Path) -> None:
    old = Running(tmp_path)
    old.server.start()
    new = Running(tmp_path)  # a rolling update: the new server takes over the same path
    new.server.start()
    try:
        old.server.stop(grace=0)
        assert new.socket.is_socket(), "the old server removed its successor's socket"
        assert check_health(new.socket)
    finally:
        new.server.stop(grace=0)
    assert not new.socket.exists()


def test_open_streams_never_starve_unary_calls_and_one_past_the_cap_is_refused(
    tmp_path: Path,
) -> None:
    running = Running(tmp_path, max_workers=2, max_streams=3)
    running.server.start()
    try:
        with grpc.insecure_channel(f"unix://{running.socket}") as typed_channel:
            channel: Any = typed_channel
            hold = channel.unary_stream(f"/{SERVICE}/Hold")
            streams = [hold(b"", timeout=10) for _ in range(2)]
            assert [next(s) for s in streams] == [b"open", b"open"]
            health_watch = health_pb2_grpc.HealthStub(typed_channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert next(health_watch).status == health_pb2.HealthCheckResponse.SERVING
            assert running.server.streams is not None and running.server.streams.open == 3
            for _ in range(3):  # more unary calls at once than streams leave threads for
                assert running.call("Fail", b"crash", timeout=2) == b""
            with pytest.raises(grpc.RpcError) as refused:
                next(hold(b"", timeout=5))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.details() == (
                "probe: 3 streams are open, the most it serves at once (max_streams=3); "
                "close one or retry later"
            )
            streams[0].cancel()
            health_watch.cancel()
            deadline = time.monotonic() + 5
            while running.server.streams.open > 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert next(hold(b"", timeout=5)) == b"open"  # a place is free again
    finally:
        running.release.set()
        running.server.stop(grace=1)


def test_every_server_has_a_stream_budget_and_explicit_modes_by_default(tmp_path: Path) -> None:
    """A server built with no options (the MIG manager's, the kubelet plugin's) still caps its
    streams (Health.Watch exists on every server) and sets 0600/0755 under umask 000."""
    running = Running(tmp_path / "run")
    previous = os.umask(0)
    try:
        running.server.start()
    finally:
        os.umask(previous)
    try:
        assert running.server.streams.cap == 16
        assert stat.S_IMODE(running.socket.stat().st_mode) == 0o600
        assert stat.S_IMODE(running.socket.parent.stat().st_mode) == 0o755
    finally:
        running.server.stop(grace=0)


def test_explicit_modes_whatever_the_umask(tmp_path: Path) -> None:
    running = Running(tmp_path, socket_mode=0o600, dir_mode=0o750)
    previous = os.umask(0)
    try:
        running.server.start()
    finally:
        os.umask(previous)
    try:
        assert stat.S_IMODE(running.socket.stat().st_mode) == 0o600
        assert stat.S_IMODE(running.socket.parent.stat().st_mode) == 0o750
        assert stat.S_IMODE(tmp_path.stat().st_mode) != 0o750  # an existing one: left alone
    finally:
        running.server.stop(grace=0)


def test_a_stop_signal_during_start_up_is_kept_and_ends_the_wait_at_once() -> None:
    """The services make ``StopSignals`` before they start: a SIGTERM that comes between
    "ready" and the wait stops them cleanly instead of killing them by the default action."""
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals()
    os.kill(os.getpid(), signal.SIGTERM)  # while "starting"
    assert signals.received == signal.SIGTERM
    assert signals.wait() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_setting_done_ends_the_wait_without_a_signal() -> None:
    done = threading.Event()
    signals = StopSignals(done)
    threading.Timer(0.05, done.set).start()
    assert signals.wait() == 0


@pytest.mark.timeout(10)
def test_a_signal_while_the_main_thread_holds_the_events_lock_does_not_deadlock() -> None:
    """Python runs a handler between two bytecodes of the main thread, also inside
    ``Event.wait`` while that thread holds the event's lock; a handler that set the event
    there waited for itself (a service that logged nothing after SIGTERM, killed 20 s later)."""
    signals = StopSignals()
    with signals.done._cond:  # type: ignore[attr-defined]  # as inside Event.wait
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here
    assert signals.wait() == signal.SIGTERM
    assert signals.done.is_set()
