"""The /healthz and /readyz server: answers, time bounds, paths and methods."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_core.health import BoundedCheck, GrpcServing, HealthServer, combine, threads_alive


def request(server: HealthServer, path: str, method: str = "GET") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request(method, path)
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


class Flag:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def __call__(self) -> list[str]:
        return list(self.problems)


@pytest.fixture
def flags() -> Iterator[tuple[Flag, Flag, HealthServer]]:
    live, ready = Flag(), Flag()
    server = HealthServer("127.0.0.1:0", live=live, ready=ready, timeout=0.3).start()
    yield live, ready, server
    server.stop()


def test_ok_is_200_and_problems_are_503(flags: tuple[Flag, Flag, HealthServer]) -> None:
    live, ready, server = flags
    assert request(server, "/healthz") == (200, "ok\n")
    assert request(server, "/readyz") == (200, "ok\n")
    ready.problems = ["sockets not served", "not registered"]
    assert request(server, "/readyz") == (503, "sockets not served\nnot registered\n")
    assert request(server, "/healthz") == (200, "ok\n")  # the two are independent
    live.problems = ["dead"]
    assert request(server, "/healthz") == (503, "dead\n")
    assert request(server, "/healthz?verbose") == (503, "dead\n")  # a query is ignored


def test_unknown_path_is_404(flags: tuple[Flag, Flag, HealthServer]) -> None:
    _, _, server = flags
    assert request(server, "/metrics")[0] == 404
    assert request(server, "/")[0] == 404
    assert request(server, "/healthz/x")[0] == 404


def test_only_get_and_head(flags: tuple[Flag, Flag, HealthServer]) -> None:
    _, ready, server = flags
    assert request(server, "/readyz", "HEAD") == (200, "")
    ready.problems = ["no"]
    assert request(server, "/readyz", "HEAD") == (503, "")
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request(method, "/readyz")
        reply = conn.getresponse()
        assert reply.status == 405, method
        assert reply.getheader("Allow") == "GET, HEAD"
        conn.close()


def test_a_stuck_check_answers_503_in_time_and_is_not_started_twice() -> None:
    release = threading.Event()
    runs = []

    def stuck() -> list[str]:
        runs.append(1)
        release.wait(10)
        return []

    server = HealthServer("127.0.0.1:0", live=lambda: [], ready=stuck, timeout=0.2).start()
    try:
        status, body = request(server, "/readyz")
        assert status == 503 and "did not answer within 0.2s" in body
        status, body = request(server, "/readyz")
        assert status == 503 and "previous check has been running for" in body
        assert len(runs) == 1
        assert request(server, "/healthz") == (200, "ok\n")  # liveness is not held up
        release.set()
        for _ in range(50):
            if request(server, "/readyz")[0] == 200:
                break
        assert request(server, "/readyz") == (200, "ok\n")
    finally:
        release.set()
        server.stop()


def test_a_check_that_raises_is_a_problem() -> None:
    def broken() -> list[str]:
        raise RuntimeError("boom")

    assert BoundedCheck("readyz", broken)() == ["readyz: check failed: RuntimeError: boom"]


def test_stop_closes_the_port() -> None:
    server = HealthServer("127.0.0.1:0", live=lambda: [], ready=lambda: []).start()
    port = server.port
    server.stop()
    with pytest.raises(OSError):
        http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()


def test_bad_addr_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--health-addr"):
        HealthServer("9410", live=lambda: [], ready=lambda: [])


def test_grpc_serving_follows_the_server(tmp_path: Path) -> None:
    socket = tmp_path / "s.sock"
    check = GrpcServing(socket, timeout=0.5)
    assert check() and "grpc.health.v1" in check()[0]  # nothing listens yet
    server = UnixGrpcServer([socket], name="t", max_workers=1)
    server.start()
    try:
        assert check() == []
        server.health.enter_graceful_shutdown()
        assert check() == [f"grpc.health.v1 on {socket}: NOT_SERVING"]
    finally:
        server.stop(0)
        check.close()


def test_threads_alive_and_combine() -> None:
    done = threading.Thread(target=lambda: None, name="worker")
    done.start()
    done.join()
    assert threads_alive(lambda: [None])() == []
    assert threads_alive(lambda: [done])() == ["thread worker has died"]
    assert combine(lambda: ["a"], lambda: [], lambda: ["b"])() == ["a", "b"]
