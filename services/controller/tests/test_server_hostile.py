"""The webhook server against hostile and broken clients (issue 27): every probe that once cost
memory, a thread forever or an answer is a test here, over real TLS on loopback."""

from __future__ import annotations

import datetime as dt
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_controller import certs, connections
from gpuslice_controller import server as webhook
from gpuslice_controller.admission import Decision, Request
from gpuslice_controller.server import ServingCert, WebhookServer

NOW = dt.datetime.now(dt.UTC)


def _allow(request: Request) -> Decision:
    return Decision.allow()


@pytest.fixture(scope="module")
def material() -> certs.Material:
    return certs.bootstrap(certs.Policy(hosts=("localhost", "127.0.0.1")), NOW)


@pytest.fixture
def server(tmp_path: Path, material: certs.Material) -> Iterator[WebhookServer]:
    srv = WebhookServer(
        ("127.0.0.1", 0), ServingCert(tmp_path / "certs"), {"validate": ("t", _allow)}
    )
    srv.cert.load(material.cert, material.key)
    srv.start()
    yield srv
    srv.stop()


def _tls(srv: WebhookServer, material: certs.Material) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cadata=material.ca_certs.decode())
    raw = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def _answer(conn: ssl.SSLSocket) -> tuple[int, bytes]:
    """Status and whole answer of one response; the connection is closed after it."""
    data = b""
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


def _closed_within(conn: ssl.SSLSocket, seconds: float) -> float | None:
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


def _review() -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {"uid": "u1", "kind": {"kind": "Thing"}, "object": {}},
        }
    ).encode()


def _head(path: str, length: str | None, extra: str = "") -> bytes:
    length_line = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{length_line}{extra}\r\n".encode()


@pytest.mark.parametrize(
    ("path", "length", "status", "reason"),
    [
        ("/nowhere", "-1", 404, b"no such webhook"),  # was: read to end of stream into memory
        ("/validate", "abc", 400, b"one non-negative integer"),  # was: no answer (ValueError)
        ("/validate", "-1", 400, b"one non-negative integer"),
        ("/validate", str(1 << 40), 413, b"over 3145728 bytes"),
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


def test_chunked_bodies_are_refused(server: WebhookServer, material: certs.Material) -> None:
    conn = _tls(server, material)
    conn.sendall(_head("/validate", None, "Transfer-Encoding: chunked\r\n") + b"5\r\nhello\r\n")
    got, data = _answer(conn)
    assert got == 411 and b"Content-Length" in data


def test_headers_past_their_budget_get_431_and_a_long_line_414(
    server: WebhookServer, material: certs.Material
) -> None:
    conn = _tls(server, material)
    filler = "".join(f"X-Pad-{i}: {'a' * 4000}\r\n" for i in range(10))  # 40 KB of headers
    conn.sendall(_head("/validate", "10", filler))
    assert _answer(conn)[0] == 431
    conn = _tls(server, material)
    conn.sendall(f"POST /{'a' * 9000} HTTP/1.1\r\n\r\n".encode())
    assert _answer(conn)[0] == 414


def test_a_review_of_the_wrong_shape_is_answered(
    server: WebhookServer, material: certs.Material
) -> None:
    """``request.object`` and ``kind`` as strings (was: AttributeError in the log line, no
    answer) and 100,000 nested brackets (was: RecursionError)."""
    odd = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u2", "kind": "Thing", "object": "not an object", "name": ["x"]},
    }
    for body, status in ((json.dumps(odd).encode(), 200), (b"[" * 100_000, 400)):
        conn = _tls(server, material)
        conn.sendall(_head("/validate", str(len(body)), "Connection: close\r\n") + body)
        got, data = _answer(conn)
        assert got == status, data[:300]


def test_a_client_trickling_bytes_is_cut_at_the_request_deadline(
    server: WebhookServer, material: certs.Material, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One byte every 0.2 s resets no timer: the whole request has REQUEST_TIMEOUT (here 1 s;
    was: held a thread forever, each byte resetting the idle timer)."""
    monkeypatch.setattr(webhook, "REQUEST_TIMEOUT", 1.0)
    conn = _tls(server, material)
    conn.sendall(b"POST /validate HTTP/1.1\r\n")
    start = time.monotonic()
    cut = False
    while time.monotonic() - start < 5:
        try:
            conn.sendall(b"X")
        except OSError:
            cut = True
            break
        conn.settimeout(0.2)
        try:
            if conn.recv(1024) == b"":
                cut = True
                break
        except TimeoutError:
            continue
        except OSError:
            cut = True
            break
    elapsed = time.monotonic() - start
    assert cut and elapsed < 2.5, f"still open after {elapsed:.1f} s"


def test_a_silent_client_is_cut_at_the_handshake_deadline(
    server: WebhookServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connections, "HANDSHAKE_TIMEOUT", 0.5)
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # never says hello
    start = time.monotonic()
    assert raw.recv(1) == b""
    assert time.monotonic() - start < 2.0


def test_at_the_cap_the_longest_idle_connection_makes_room_and_a_full_house_refuses(
    server: WebhookServer, material: certs.Material
) -> None:
    server._server.connections.cap = 4
    idle = [_tls(server, material) for _ in range(4)]  # handshakes done, then silent
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        c.phase != "idle" for c in server._server.connections._open.values()
    ):
        time.sleep(0.01)
    fresh = _tls(server, material)  # evicts the oldest idle one
    body = _review()
    fresh.sendall(_head("/validate", str(len(body)), "Connection: close\r\n") + body)
    assert _answer(fresh)[0] == 200
    assert _closed_within(idle[0], 2.0) is not None  # the oldest made room
    assert _closed_within(idle[3], 0.2) is None  # the others stay
    # Every place mid-request (each bounded by the request deadline): a new one is closed.
    busy = [_tls(server, material) for _ in range(4)]
    for conn in busy:
        conn.sendall(b"POST /validate HTTP/1.1\r\n")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        c.phase != "request" for c in server._server.connections._open.values()
    ):
        time.sleep(0.01)
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert raw.recv(1) == b""  # closed before any handshake
    assert len(server._server.connections) <= 4


def test_one_client_cannot_take_every_place(
    server: WebhookServer, material: certs.Material
) -> None:
    """Past its own cap of places, a client's new connection is refused while another
    client's (here 127.0.0.2, as the API server's) is still served."""
    server._server.connections.per_client = 2
    hogs = [_tls(server, material) for _ in range(2)]
    for conn in hogs:
        conn.sendall(b"POST /validate HTTP/1.1\r\n")  # mid-request: no place to take over
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        c.phase != "request" for c in server._server.connections._open.values()
    ):
        time.sleep(0.01)
    third = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert third.recv(1) == b""  # refused before any handshake
    ctx = ssl.create_default_context(cadata=material.ca_certs.decode())
    raw = socket.create_connection(
        ("127.0.0.1", server.port), timeout=5, source_address=("127.0.0.2", 0)
    )
    other = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    body = _review()
    other.sendall(_head("/validate", str(len(body)), "Connection: close\r\n") + body)
    assert _answer(other)[0] == 200
