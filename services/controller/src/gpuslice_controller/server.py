"""The webhook's HTTPS server, with a serving certificate that can change while it runs.

The standard library's threading HTTP server with ``ssl``: one thread per connection (the API
server keeps a few connections alive and sends reviews over them), the TLS handshake in that
thread rather than in the accept loop, and HTTP/1.1 keep-alive. A new certificate builds a new
``SSLContext`` that the next connection uses; connections already open finish on the old one.
Why not an ASGI stack: a webhook answers a few hundred small requests a second at most, and this
keeps the image free of a web framework and its server (docs/controller.md).

Paths: ``POST /validate`` and ``POST /mutate`` (AdmissionReview v1), ``GET /healthz`` (the
process answers), ``GET /readyz`` (a certificate is loaded and the caches the reviewers need
have synced) and, when a view is given, ``GET /view/...`` (``view.api``: the cluster view as
JSON, for authenticated and authorized callers) and, when the aggregated API is on, ``GET
/apis/...`` (``view.aggregated``: ``gpus.view.gpuslice.dev`` for the API server's front proxy,
whose client certificate the TLS layer verifies; a watch is streamed chunked).

What a client can take is bounded, since the review paths need no credentials (issue 27): a
place among the server's connections and a deadline per phase, held by the handler's own reads
and writes (408 when a request does not arrive in time) and by a reaper behind them
(``connections``); a request line, header lines, their count and their sum within
``Limits`` (414/431 beyond); a body of at most ``Limits.body`` bytes with a valid
``Content-Length`` (411, 400, 413 otherwise, and the connection closed without reading it),
read by at most ``Limits.body_slots`` requests at once. Every malformed request gets a 4xx with
the reason; a bad review a 400 naming the field (``admission.parse``).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import select
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gpuslice_controller.admission import review as admission
from gpuslice_controller.connections import Connection, Connections, Limits
from gpuslice_controller.tls.serving import ServingCert
from gpuslice_controller.view import aggregated
from gpuslice_controller.view import api as viewapi
from gpuslice_core.logging import get_logger

log = get_logger(__name__)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], app: WebhookServer, limits: Limits) -> None:
        self.app = app
        self.limits = limits
        self.connections = Connections(limits)
        self.body_slots = threading.BoundedSemaphore(limits.body_slots)
        # socket id -> its place, from admission (the accept loop) to its thread
        self._admitted: dict[int, Connection] = {}
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        # finish_request builds each _Handler itself, with its Connection
        super().__init__(addr, _Handler)  # type: ignore[arg-type]

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed under its handler (a client gone mid-answer, one the reaper
        cut) is one debug line, not a traceback on stderr; anything else is logged in full."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("connection ended", client=client_address[0], error=str(exc))
        else:
            log.exception("webhook connection failed", client=client_address[0])

    def process_request(self, request: Any, client_address: Any) -> None:
        """Admit the connection (or close it at once) before a thread is spent on it."""
        conn = self.connections.admit(request, str(client_address[0]))
        if conn is None:
            self.shutdown_request(request)
            return
        self._admitted[id(request)] = conn
        super().process_request(request, client_address)

    def finish_request(self, request: Any, client_address: Any) -> None:
        conn = self._admitted.pop(id(request))
        try:
            self._serve(request, client_address, conn)
        finally:
            # The place is released before the socket closes (shutdown_request, after this),
            # so the reaper never cuts a file descriptor another connection reuses.
            self.connections.release(conn)

    def _serve(self, request: Any, client_address: Any, conn: Connection) -> None:
        context = self.app.cert.context()
        if context is None:
            return  # not ready: close without a word, the API server retries
        left = conn.remaining()
        if left <= 0:  # (a thread started late, on a machine out of CPU)
            self.connections.expired(conn)
            return
        # The whole handshake, not each read of it (ssl's do_handshake keeps one deadline).
        request.settimeout(left)
        # A response is small and written at once; without TCP_NODELAY, Nagle's algorithm holds
        # any second segment until the client's delayed ACK (40 ms on Linux), which was 99% of
        # every review's round trip (bench/bench_controller.py, docs/controller.md "Figures").
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            tls = context.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
            conn.sock = tls  # the plain socket object is detached now; the reaper cuts this one
            tls.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            if isinstance(exc, TimeoutError):
                self.connections.expired(conn)
            log.debug("tls handshake failed", client=client_address[0], error=str(exc))
            return
        try:
            handler = _Handler(tls, client_address, self, conn)
            if handler.answered:
                conn.enter("closing")
                _linger(tls, conn)
        finally:
            self.connections.release(conn)
            with contextlib.suppress(OSError):
                tls.close()


def _linger(sock: ssl.SSLSocket, conn: Connection, most: int = 256 * 1024) -> None:
    """Half-close ``sock`` and read what the client still sends until it closes too (at most
    ``most`` bytes, within the ``closing`` deadline). Closing a socket with unread input sends
    a reset at once, which can destroy the answer before the client reads it — a 413 or 408
    to a client still sending. Go's net/http and nginx linger likewise (RFC 9112, 9.6)."""
    with contextlib.suppress(OSError, ValueError):
        socket.socket.shutdown(sock, socket.SHUT_WR)  # the TCP half: the TLS layer is done
        while most > 0 and (left := conn.remaining()) > 0:
            sock.settimeout(left)
            chunk = socket.socket.recv(sock, min(most, 64 * 1024))  # raw: it is thrown away
            if not chunk:
                return
            most -= len(chunk)


def _client_gone(sock: ssl.SSLSocket) -> bool:
    """Whether the client of a streamed answer closed its side: it sends nothing while it reads
    the stream, so anything to read (its close_notify, or EOF) means it has gone."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class _DeadlineIO(io.RawIOBase):
    """A connection's TLS socket as a stream whose every read and write waits only for what is
    left of the connection's current phase: a client sending or reading a byte at a time gains
    nothing by it, and the handler sees the deadline as ``TimeoutError``."""

    def __init__(self, sock: ssl.SSLSocket, conn: Connection) -> None:
        super().__init__()
        self._sock = sock
        self._conn = conn

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def _wait_at_most(self) -> None:
        left = self._conn.remaining()
        if left <= 0:
            raise TimeoutError(f"past the {self._conn.phase} deadline")
        self._sock.settimeout(left)

    def readinto(self, buffer: Any) -> int:
        self._wait_at_most()
        return self._sock.recv_into(buffer)

    def write(self, data: Any) -> int:
        self._wait_at_most()
        return self._sock.send(data)


class _HeaderBudget:
    """The handler's input while it reads a request's headers: ``readline`` fails with
    ``LineTooLong`` once one header line passes ``header_line`` bytes or the request line and
    headers together pass ``header_bytes``, and with ``HTTPException`` after ``header_count``
    header lines (the standard library answers both with 431)."""

    def __init__(self, raw: Any, limits: Limits, used: int) -> None:
        self._raw = raw
        self._limits = limits
        self.left = limits.header_bytes - used
        self.lines = 0

    def readline(self, size: int = -1) -> bytes:
        limits = self._limits
        self.lines += 1
        if self.lines > limits.header_count + 1:  # the empty line that ends them is one more
            raise http.client.HTTPException(f"more than {limits.header_count} header lines")
        line: bytes = self._raw.readline(min(self.left, limits.header_line) + 1)
        if len(line) > limits.header_line:
            raise http.client.LineTooLong(f"a header line over {limits.header_line} bytes")
        self.left -= len(line)
        if self.left < 0:
            raise http.client.LineTooLong(
                f"request line and headers over {limits.header_bytes} bytes"
            )
        return line


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gpuslice-controller"  # (not the Python version, as by default)
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(message)s: %(explain)s\n"
    # Buffered: the status line, headers and body leave in one write (one TLS record), flushed
    # by the handler after each request, instead of one write for the headers and one for the
    # body.
    wbufsize = 64 * 1024
    server: _Server

    def __init__(self, request: Any, client_address: Any, server: _Server, conn: Connection):
        self.conn = conn
        self.answered = False  # a final response of this request is (being) written
        self.expect_100 = False  # the client waits for "100 Continue" before sending the body
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        self.connection = self.request
        self.input = io.BufferedReader(_DeadlineIO(self.request, self.conn))
        self.rfile = self.input
        self.wfile = io.BufferedWriter(_DeadlineIO(self.request, self.conn), self.wbufsize)

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        return  # one structured line per review comes from admission.answer

    def finish(self) -> None:
        with contextlib.suppress(OSError):  # the client left, or the reaper cut the connection
            super().finish()

    def handle_one_request(self) -> None:
        """The standard library's, with the limits: the request line and headers within their
        sizes, the whole request within its deadline, the answer within another."""
        self.close_connection = True  # unless a request is read and answered whole
        self.answered = self.expect_100 = False
        # (what send_error reads, for an answer before the request line is whole: a 408)
        self.raw_requestline = b""
        self.requestline = self.request_version = self.command = ""
        self.conn.enter("idle")
        try:
            if not self.input.peek(1):
                return  # the client closed the connection
        except TimeoutError:
            self.server.connections.expired(self.conn)
            return
        except OSError:  # reset by the client, or cut by the reaper
            return
        self.conn.enter("request")
        try:
            if not self._read_head():
                return
            method = getattr(self, f"do_{self.command}", None)
            if method is None:
                self.close_connection = True
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"method {self.command} is not served")
            elif self.command == "POST":
                method()
            else:
                if self.headers.get("Transfer-Encoding") or self.headers.get(
                    "Content-Length", "0"
                ).strip() not in ("", "0"):
                    self.close_connection = True  # its body is never read, nor taken for a request
                self.conn.enter("response")
                method()
            self.wfile.flush()
        except TimeoutError:
            self._too_slow()
        except OSError:  # reset by the client, or cut by the reaper
            self.close_connection = True

    def _read_head(self) -> bool:
        """Read and parse the request line and headers; False after answering why not."""
        limits = self.server.limits
        line = self.rfile.readline(limits.request_line + 1)
        self.raw_requestline = line
        if len(line) > limits.request_line:
            self.send_error(
                HTTPStatus.REQUEST_URI_TOO_LONG,
                "Request line too long",
                f"a request line over {limits.request_line} bytes",
            )
            return False
        raw = self.rfile
        self.rfile = _HeaderBudget(raw, limits, len(line))  # type: ignore[assignment]
        try:
            parsed = self.parse_request()  # answers 400/431/505 itself
        finally:
            self.rfile = raw
        if not parsed:
            self.close_connection = True
        return parsed

    def send_response(self, code: int, message: str | None = None) -> None:
        self.answered = True
        super().send_response(code, message)

    def handle_expect_100(self) -> bool:
        self.expect_100 = True  # "100 Continue" only once the length is acceptable (_read_body)
        return True

    def _too_slow(self) -> None:
        """The phase's deadline passed: 408 if the request was still arriving and nothing of an
        answer is written yet, and the connection closed."""
        self.close_connection = True
        phase = self.conn.phase
        self.server.connections.expired(self.conn)
        if phase != "request" or self.answered:
            return
        self.conn.enter("response")  # a few seconds to write the 408, held by the socket
        with contextlib.suppress(OSError):
            self.send_error(
                HTTPStatus.REQUEST_TIMEOUT,
                "Request Timeout",
                f"the request did not arrive within {self.server.limits.request_s:g} s",
            )
            self.wfile.flush()

    def _send(self, status: HTTPStatus, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        app = self.server.app
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, b"ok\n")
        elif self.path == "/readyz":
            waiting = app.not_ready()
            if waiting:
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, f"waiting for {waiting}\n".encode())
            else:
                self._send(HTTPStatus.OK, b"ok\n")
        elif app.view is not None and self.path.startswith(viewapi.PREFIX):
            answer = app.view.get(self.path, viewapi.credentials(self.headers))
            self._send(answer.status, answer.body, answer.content_type)
        elif app.aggregated is not None and aggregated.handles(self.path.split("?", 1)[0]):
            # {} unless the client presented a certificate the context verified
            peercert = self.connection.getpeercert()
            found = app.aggregated.get(self.path, self.headers, peercert)
            if isinstance(found, aggregated.Stream):
                self._stream(found)
            else:
                self._send(found.status, found.body, found.content_type)
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n")

    def _stream(self, stream: aggregated.Stream) -> None:
        """Write ``stream`` chunked, each chunk as it comes, within the ``watch`` deadline; stop
        early when the client has gone (looked at on each idle tick). The connection closes
        after it."""
        self.close_connection = True
        self.conn.enter("watch")
        try:
            self.send_response(stream.status)
            self.send_header("Content-Type", stream.content_type)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Cache-Control", "no-cache, private")
            self.end_headers()
            self.wfile.flush()
            for chunk in stream.chunks:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                elif _client_gone(self.connection):
                    return
            self.wfile.write(b"0\r\n\r\n")
        finally:
            close = getattr(stream.chunks, "close", None)
            if close is not None:
                close()
            stream.release()

    def _refuse(self, status: HTTPStatus, reason: str) -> None:
        """Answer and close: the body (if any) is never read."""
        self.close_connection = True
        self._send(status, f"{reason}\n".encode())

    def _body_length(self) -> int | None:
        """The body's length, or None after refusing the request with the reason."""
        limit = self.server.limits.body
        if self.headers.get("Transfer-Encoding"):
            self._refuse(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
            return None
        values = self.headers.get_all("Content-Length") or []
        if not values:
            self._refuse(HTTPStatus.LENGTH_REQUIRED, "an AdmissionReview body is required")
            return None
        text = values[0].strip()
        if len(set(values)) > 1 or not text.isascii() or not text.isdigit():
            shown = ", ".join(v[:20] for v in values)
            self._refuse(
                HTTPStatus.BAD_REQUEST,
                f"Content-Length must be one non-negative integer, got {shown!r}",
            )
            return None
        length = int(text) if len(text) <= 18 else limit + 1  # (int() caps digit counts)
        if length > limit:
            self._refuse(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"Content-Length {text[:20]} is over {limit} bytes, the API server's limit",
            )
            return None
        if length == 0:
            self._refuse(HTTPStatus.BAD_REQUEST, "an AdmissionReview body is required")
            return None
        return length

    def _read_body(self, length: int) -> bytes | None:
        """The body, read while holding one of the body slots; None after refusing the
        request (no slot free within its deadline) or when the client went away.
        ``TimeoutError`` when the body did not arrive within the request's deadline."""
        if not self.server.body_slots.acquire(timeout=self.conn.remaining()):
            self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "too many requests being read; retry")
            return None
        try:
            if self.expect_100:
                self.send_response_only(HTTPStatus.CONTINUE)
                self.end_headers()
                self.wfile.flush()
            body: bytes = self.rfile.read(length)
        finally:
            self.server.body_slots.release()
        if len(body) != length:  # the client went away or the reaper cut it
            self.close_connection = True
            return None
        return body

    def do_POST(self) -> None:
        reviewer = self.server.app.reviewers.get(self.path.split("?", 1)[0].lstrip("/"))
        if reviewer is None:
            self._refuse(HTTPStatus.NOT_FOUND, "no such webhook")
            return
        length = self._body_length()
        if length is None:
            return
        body = self._read_body(length)
        if body is None:
            return
        self.conn.enter("response")
        name, review = reviewer
        try:
            out = admission.answer(name, body, review)
        except admission.BadReviewError as exc:
            self._send(HTTPStatus.BAD_REQUEST, f"{exc}\n".encode())
            return
        self._send(HTTPStatus.OK, out, "application/json")


class WebhookServer:
    """Serves ``reviewers`` (path → (webhook name, reviewer)) over HTTPS on ``addr``."""

    def __init__(
        self,
        addr: tuple[str, int],
        cert: ServingCert,
        reviewers: Mapping[str, tuple[str, admission.Reviewer]],
        readiness: Mapping[str, Callable[[], bool]] | None = None,
        view: viewapi.ViewApi | None = None,
        limits: Limits | None = None,
        aggregated_api: aggregated.AggregatedApi | None = None,
    ) -> None:
        self.cert = cert
        self.view = view
        self.aggregated = aggregated_api
        self.reviewers = dict(reviewers)
        self.readiness = dict(readiness or {})
        self._server = _Server(addr, self, limits or Limits())
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def not_ready(self) -> str:
        """What readiness still waits for ("" when ready)."""
        waiting = [] if self.cert.loaded.is_set() else ["a serving certificate"]
        waiting += [name for name, ready in self.readiness.items() if not ready()]
        return ", ".join(waiting)

    def start(self) -> None:
        self._server.connections.start()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="webhook-server", daemon=True
        )
        self._thread.start()
        log.info("webhook server listening", address=self._server.server_address[0], port=self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._server.connections.stop()
        if self._thread is not None:
            self._thread.join(5)
