"""The webhook server against hostile and broken clients (issue 27): every probe that once cost
memory, a thread forever or an answer is a test here, over real TLS on loopback. The server
runs with small ``Limits`` (deadlines of a second or less), and every wait has a deadline."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuslice_controller.admission import review as admission
from gpuslice_controller.admission.review import Decision, Request
from gpuslice_controller.connections import Connections, Limits
from gpuslice_controller.server import WebhookServer
from gpuslice_controller.tls import certs
from gpuslice_controller.tls.serving import ServingCert
from gpuslice_testkit.core import wait_for

NOW = dt.datetime.now(dt.UTC)
#: Deadlines short enough for tests, the reaper well behind them (the handler answers 408 even
#: on a loaded machine); sizes as served.
FAST = Limits(handshake_s=2.0, idle_s=2.0, request_s=1.0, response_s=1.0, reap_grace_s=3.0)
#: What a deadline of FAST may take beyond itself on a loaded machine.
SLACK = 2.0


def _allow(request: Request) -> Decision:
    return Decision.allow()


@pytest.fixture(scope="module")
def material() -> certs.Material:
    return certs.bootstrap(certs.Policy(hosts=("localhost", "127.0.0.1")), NOW)


@pytest.fixture
def serve(tmp_path: Path, material: certs.Material) -> Iterator[Callable[[Limits], WebhookServer]]:
    """Starts a server with the given limits (one per test); stops it afterwards."""
    started: list[WebhookServer] = []

    def start(limits: Limits) -> WebhookServer:
        srv = WebhookServer(
            ("127.0.0.1", 0),
            ServingCert(tmp_path / "certs"),
            {"validate": ("t", _allow)},
            limits=limits,
        )
        srv.cert.load(material.cert, material.key)
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def server(serve: Callable[[Limits], WebhookServer]) -> WebhookServer:
    return serve(FAST)


def _tls(srv: WebhookServer, material: certs.Material, source: str = "127.0.0.1") -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cadata=material.ca_certs.decode())
    raw = socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=(source, 0))
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def _answer(conn: ssl.SSLSocket, timeout: float = 5.0) -> tuple[int, bytes]:
    """Status and whole answer of one response; the server must close the connection after it
    (within ``timeout``)."""
    data = b""
    conn.settimeout(timeout)
    while True:
        try:
            chunk = conn.recv(65536)
        except (ConnectionResetError, ssl.SSLError):
            break
        if not chunk:
            break
        data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


def _closed_within(conn: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closes ``conn`` (None if it is still open after ``seconds``)."""
    start = time.monotonic()
    conn.settimeout(seconds)
    try:
        while conn.recv(1024):
            pass
    except TimeoutError:
        return None
    except (ConnectionResetError, ssl.SSLError, OSError):
        pass
    return time.monotonic() - start


def _review(request: object = None) -> bytes:
    default = {"uid": "u1", "kind": {"kind": "Thing"}, "object": {}}
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": default if request is None else request,
        }
    ).encode()


def _head(path: str, length: str | None, extra: str = "") -> bytes:
    length_line = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{length_line}{extra}\r\n".encode()


def _post(body: bytes, extra: str = "Connection: close\r\n") -> bytes:
    return _head("/validate", str(len(body)), extra) + body


@pytest.mark.parametrize(
    ("path", "length", "status", "reason"),
    [
        ("/nowhere", "-1", 404, b"no such webhook"),  # was: read to end of stream into memory
        ("/validate", "abc", 400, b"one non-negative integer"),  # was: no answer (ValueError)
        ("/validate", "-1", 400, b"one non-negative integer"),
        ("/validate", "+5", 400, b"one non-negative integer"),
        ("/validate", str(1 << 40), 413, b"over 3145728 bytes"),
        ("/validate", "9" * 5000, 413, b"over 3145728 bytes"),
        ("/validate", None, 411, b"body is required"),
    ],
)
def test_a_bad_length_is_refused_without_reading_the_body(
    server: WebhookServer,
    material: certs.Material,
    path: str,
    length: str | None,
    status: int,
    reason: bytes,
) -> None:
    conn = _tls(server, material)
    conn.sendall(_head(path, length) + b"x" * 1000)  # a body that is never read
    got, data = _answer(conn)  # the server answers and closes: the stream ends
    assert got == status and reason in data


def test_a_stream_to_an_unknown_path_is_answered_and_cut_not_read(
    server: WebhookServer, material: certs.Material
) -> None:
    """Issue 27 streamed 256 MiB into memory this way (RSS 84 → 596 MiB): now the 404 comes
    before any of the body is read, and sending more than the socket buffers fails."""
    conn = _tls(server, material)
    conn.sendall(_head("/nowhere", "-1"))
    conn.settimeout(5)
    assert conn.recv(200).startswith(b"HTTP/1.1 404 ")
    sent = 0
    with pytest.raises(OSError):
        for _ in range(64):
            conn.sendall(b"b" * (1 << 20))
            sent += 1
    assert sent < 64


def test_chunked_bodies_are_refused(server: WebhookServer, material: certs.Material) -> None:
    conn = _tls(server, material)
    conn.sendall(_head("/validate", None, "Transfer-Encoding: chunked\r\n") + b"5\r\nhello\r\n")
    got, data = _answer(conn)
    assert got == 411 and b"Content-Length" in data


@pytest.mark.parametrize(
    ("head", "status", "reason"),
    [
        (  # 40 KB of headers, each line within its limit
            "".join(f"X-Pad-{i}: {'a' * 4000}\r\n" for i in range(10)),
            431,
            b"request line and headers over 32768 bytes",
        ),
        (f"X-Pad: {'a' * 9000}\r\n", 431, b"a header line over 8192 bytes"),
        ("".join(f"X-{i}: a\r\n" for i in range(65)), 431, b"more than 64 header lines"),
    ],
)
def test_headers_past_their_limits_get_431(
    server: WebhookServer, material: certs.Material, head: str, status: int, reason: bytes
) -> None:
    conn = _tls(server, material)
    with contextlib.suppress(OSError):  # (the server answers when the limit is passed, and closes)
        conn.sendall(_head("/validate", "10", head))
    got, data = _answer(conn)
    assert got == status and reason in data, data[:300]


def test_a_long_request_line_gets_414(server: WebhookServer, material: certs.Material) -> None:
    conn = _tls(server, material)
    conn.sendall(f"POST /{'a' * 9000} HTTP/1.1\r\n\r\n".encode())
    got, data = _answer(conn)
    assert got == 414 and b"over 8192 bytes" in data


def test_many_clients_with_unfinished_header_lines_are_all_answered_and_gone(
    serve: Callable[[Limits], WebhookServer], material: certs.Material
) -> None:
    """Issue 27: 40 clients sending unfinished 65 KB header lines took 1.48 GB. Each now gets a
    431 after its 32 KiB, and every thread and place is given back."""
    srv = serve(Limits(per_client=64))
    threads = threading.active_count()
    conns = [_tls(srv, material) for _ in range(40)]
    for conn in conns:
        with contextlib.suppress(OSError):  # (the server answers after 32 KiB, and closes)
            conn.sendall(b"POST /validate HTTP/1.1\r\nX-Pad: " + b"a" * 65_000)  # never ends
    for conn in conns:
        got, data = _answer(conn)
        assert got == 431, data[:200]
    wait_for(lambda: len(srv._server.connections) == 0, 5, "every place given back", 0.02, 0.05)
    wait_for(lambda: threading.active_count() <= threads, 5, "every thread ended", 0.02, 0.05)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({"uid": {"a": 1}}, b"request.uid: {'a': 1} is not a string"),
        ({"kind": "Thing"}, b"request.uid: missing; request.kind: 'Thing' is not an object"),
        ({"uid": "u", "object": "x"}, b"request.object: 'x' is not an object"),
        ({"uid": "u", "kind": {"kind": 5}}, b"request.kind.kind: 5 is not a string"),
        ({"uid": "u", "operation": ["CREATE"]}, b"request.operation: ['CREATE'] is not a string"),
        ({"uid": "u", "dryRun": "yes"}, b"request.dryRun: 'yes' is not true or false"),
        ("a string", b"AdmissionReview request: 'a string' is not an object"),
    ],
)
def test_a_review_of_the_wrong_shape_gets_400_naming_the_field(
    server: WebhookServer, material: certs.Material, request_: object, field: bytes
) -> None:
    """Was: an AttributeError in the log line and no answer (``request.object`` a string)."""
    conn = _tls(server, material)
    conn.sendall(_post(_review(request_)))
    got, data = _answer(conn)
    assert got == 400 and field in data, data[-300:]


def test_deep_nesting_is_a_400_or_a_denial_that_says_so(
    server: WebhookServer, material: certs.Material
) -> None:
    """100,000 brackets (was: RecursionError, no answer) are a 400; an object nested 1,500
    levels inside a well-formed review is a denial naming the nesting."""
    conn = _tls(server, material)
    conn.sendall(_post(b"[" * 100_000))
    got, data = _answer(conn)
    assert got == 400 and b"nested deeper than 200 levels" in data
    deep = {"uid": "u3", "kind": {"kind": "Thing"}, "object": {"spec": "@"}}
    body = _review(deep).replace(b'"@"', b"[" * 1500 + b"]" * 1500)
    conn = _tls(server, material)
    conn.sendall(_post(body))
    got, data = _answer(conn)
    answer = json.loads(data.split(b"\r\n\r\n", 1)[1])["response"]
    assert got == 200 and answer["uid"] == "u3" and not answer["allowed"]
    assert "nested deeper than 200 levels" in answer["status"]["message"]


def test_a_reviewer_failing_on_odd_objects_logs_one_traceback_a_minute() -> None:
    def fails(request: Request) -> Decision:
        raise AttributeError("'str' object has no attribute 'get'")

    with capture_logs() as logs:
        for uid in ("a", "b", "c"):
            out = json.loads(admission.answer("odd", _review({"uid": uid, "object": {}}), fails))
            assert not out["response"]["allowed"]
    assert [e["event"] for e in logs].count("reviewer failed") == 1
    assert [e["result"] for e in logs if e["event"] == "admission"] == ["error"] * 3


@pytest.mark.parametrize(
    ("start", "trickle"),
    [
        (b"", b"P"),  # the request line itself, a byte at a time
        (b"POST /validate HTTP/1.1\r\n", b"X"),  # a header line
        (_head("/validate", "100"), b"{"),  # the body
    ],
)
def test_a_client_trickling_bytes_gets_408_at_the_request_deadline(
    server: WebhookServer, material: certs.Material, start: bytes, trickle: bytes
) -> None:
    """One byte every 0.1 s resets nothing: the whole request, from its first byte, has
    ``request_s`` (here 1 s; was: a thread held forever, each byte resetting the timer)."""
    conn = _tls(server, material)
    begun = time.monotonic()  # (before the first byte: the server's deadline starts later)
    conn.sendall(start or trickle)
    conn.settimeout(0.1)
    data = b""
    while time.monotonic() - begun < 4:
        try:
            chunk = conn.recv(1024)
        except TimeoutError:
            with contextlib.suppress(OSError):  # (once cut, what it answered is still read)
                conn.sendall(trickle)
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    elapsed = time.monotonic() - begun
    assert data.startswith(b"HTTP/1.1 408 ") and b"within 1 s" in data, data[:200]
    assert 0.9 < elapsed < 1.0 + SLACK, f"closed after {elapsed:.1f} s"


def test_a_kept_alive_connection_is_closed_when_idle(
    server: WebhookServer, material: certs.Material
) -> None:
    conn = _tls(server, material)
    conn.sendall(_post(_review(), extra=""))
    conn.settimeout(5)
    assert conn.recv(1024).startswith(b"HTTP/1.1 200 ")
    closed = _closed_within(conn, 6.0)
    assert closed is not None and 1.0 < closed < 2.0 + SLACK, closed


def test_a_silent_client_is_cut_at_the_handshake_deadline(server: WebhookServer) -> None:
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # never says hello
    closed = _closed_within(raw, 6.0)
    assert closed is not None and closed < 2.0 + SLACK, closed


def test_a_get_with_a_body_is_answered_and_closed_its_body_never_a_request(
    server: WebhookServer, material: certs.Material
) -> None:
    conn = _tls(server, material)
    inner = b"POST /validate HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
    conn.sendall(b"GET /healthz HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(inner) + inner)
    got, data = _answer(conn)
    assert got == 200 and data.count(b"HTTP/1.1") == 1


def test_100_continue_only_for_a_body_that_will_be_read(
    server: WebhookServer, material: certs.Material
) -> None:
    conn = _tls(server, material)
    conn.sendall(_head("/validate", str(1 << 30), "Expect: 100-continue\r\n"))
    got, data = _answer(conn)
    assert got == 413 and b"100 Continue" not in data
    conn = _tls(server, material)
    body = _review()
    conn.sendall(
        _head("/validate", str(len(body)), "Expect: 100-continue\r\nConnection: close\r\n")
    )
    conn.settimeout(5)
    assert conn.recv(100).startswith(b"HTTP/1.1 100 Continue")
    conn.sendall(body)
    assert _answer(conn)[0] == 200


def test_a_slow_body_holds_its_slot_only_until_its_deadline(
    serve: Callable[[Limits], WebhookServer], material: certs.Material
) -> None:
    srv = serve(Limits(request_s=1.0, body_slots=1, reap_grace_s=3.0))
    slow = _tls(srv, material)
    slow.sendall(_head("/validate", "100") + b"{")  # holds the only body slot
    wait_for(lambda: _slot_taken(srv), 5, "the slow body to hold the slot", 0.01, 0.02)
    time.sleep(0.3)  # (so that the two deadlines are well apart, not to wait for something)
    waiting = _tls(srv, material)
    waiting.sendall(_post(_review()))  # whole, but waits for the slot
    assert _answer(slow)[0] == 408
    assert _answer(waiting)[0] == 200


def _slot_taken(srv: WebhookServer) -> bool:
    slots = srv._server.body_slots
    if slots.acquire(blocking=False):
        slots.release()
        return False
    return True


def test_at_the_cap_the_longest_idle_connection_makes_room_and_a_full_house_refuses(
    serve: Callable[[Limits], WebhookServer], material: certs.Material
) -> None:
    srv = serve(Limits(connections=4, request_s=3.0))
    idle = [_tls(srv, material) for _ in range(4)]  # handshakes done, then silent
    for conn in idle:
        _wait_phase(srv, conn, "idle")
    fresh = _tls(srv, material)  # evicts the oldest idle one
    fresh.sendall(_post(_review()))
    assert _answer(fresh)[0] == 200
    fresh.close()
    assert _closed_within(idle[0], 2.0) is not None  # the oldest made room
    assert _closed_within(idle[3], 0.2) is None  # the others stay
    # Every place mid-request (each bounded by the request deadline): a new one is closed.
    busy = [_busy(srv, material) for _ in range(4)]  # each evicts an idle one
    raw = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    assert raw.recv(1) == b""  # closed before any handshake
    assert len(srv._server.connections) == len(busy)


def _busy(srv: WebhookServer, material: certs.Material) -> ssl.SSLSocket:
    """A new connection, once the server has it in the middle of a request."""
    conn = _tls(srv, material)
    conn.sendall(b"POST /validate HTTP/1.1\r\n")
    _wait_phase(srv, conn, "request")
    return conn


def _wait_phase(srv: WebhookServer, conn: socket.socket, phase: str) -> None:
    wait_for(lambda: _phase(srv, conn) == phase, 5, f"the server to have it {phase}", 0.01, 0.02)


def _phase(srv: WebhookServer, conn: socket.socket) -> str | None:
    """The phase the server has ``conn`` in (None when it holds no place)."""
    port = conn.getsockname()[1]
    for held in list(srv._server.connections._open.values()):
        with contextlib.suppress(OSError):
            if held.sock.getpeername()[1] == port:
                return held.phase
    return None


def test_a_slowloris_flood_holds_a_few_threads_for_a_deadline_and_others_are_served(
    serve: Callable[[Limits], WebhookServer], material: certs.Material
) -> None:
    """Issue 27: 200 slowloris connections held 212 threads, never closed. One address now
    holds at most ``per_client`` places (here 8 of 16), each until its request deadline
    (here 3 s), while another address (as the API server) is answered."""
    srv = serve(Limits(connections=16, per_client=8, request_s=3.0))
    threads = threading.active_count()
    most = threads
    slow: list[ssl.SSLSocket] = []
    for _ in range(40):
        with contextlib.suppress(OSError):  # refused: closed before the handshake
            slow.append(_busy(srv, material))
        most = max(most, threading.active_count())
    assert len(slow) == 8 and len(srv._server.connections) == 8
    assert most == threads + 8  # one thread per place; none for the 32 refused
    other = _tls(srv, material, source="127.0.0.2")
    other.sendall(_post(_review()))
    assert _answer(other)[0] == 200
    for conn in slow:  # each cut at its request deadline, with a 408
        assert _answer(conn)[0] == 408
    wait_for(lambda: len(srv._server.connections) == 0, 5, "every place given back", 0.02, 0.05)
    wait_for(lambda: threading.active_count() <= threads, 5, "every thread ended", 0.02, 0.05)


def test_one_client_cannot_take_every_place(
    serve: Callable[[Limits], WebhookServer], material: certs.Material
) -> None:
    """Past its own cap of places, a client's new connection is refused while another
    client's (here 127.0.0.2, as the API server's) is still served."""
    srv = serve(Limits(per_client=2, request_s=3.0))
    hogs = [_busy(srv, material) for _ in range(2)]  # mid-request: no place to take over
    third = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    assert third.recv(1) == b""  # refused before any handshake
    other = _tls(srv, material, source="127.0.0.2")
    other.sendall(_post(_review()))
    assert _answer(other)[0] == 200
    for conn in hogs:
        conn.close()


def test_closes_are_counted_and_logged_at_most_once_per_interval() -> None:
    now = [100.0]
    registry = Connections(Limits(connections=1), clock=lambda: now[0])
    sock = socket.socket()
    busy = registry.admit(sock, "10.0.0.1")
    assert busy is not None
    busy.enter("request")
    with capture_logs() as logs:
        for _ in range(5):
            assert registry.admit(sock, "10.0.0.2") is None
        now[0] += 5
        registry.reap()  # nothing due: the last line is 5 s old
        now[0] += 6  # the request's deadline (10 s) and grace (1 s) passed, and 11 s since
        registry.reap()
    lines = [e for e in logs if e["event"] == "webhook connections closed by the server"]
    assert [(e.get("refused"), e.get("request")) for e in lines] == [(1, None), (4, 1)]
    assert len(registry) == 0
    sock.close()
