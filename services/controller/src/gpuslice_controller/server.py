"""The webhook's HTTPS server, with a serving certificate that can change while it runs.

The standard library's threading HTTP server with ``ssl``: one thread per connection (the API
server keeps a few connections alive and sends reviews over them), the TLS handshake in that
thread rather than in the accept loop, and HTTP/1.1 keep-alive. A new certificate builds a new
``SSLContext`` that the next connection uses; connections already open finish on the old one.
Why not an ASGI stack: a webhook answers a few hundred small requests a second at most, and this
keeps the image free of a web framework and its server (docs/controller.md).

Paths: ``POST /validate`` and ``POST /mutate`` (AdmissionReview v1), ``GET /healthz`` (the
process answers), ``GET /readyz`` (a certificate is loaded and the caches the reviewers need
have synced) and, when a view is given, ``GET /view/...`` (``viewapi``: the cluster view as
JSON, for authenticated and authorized callers).
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from gpuslice_controller import admission, viewapi
from gpuslice_core.logging import get_logger

log = get_logger(__name__)

MAX_BODY = 3 * 1024 * 1024
"""The API server's request limit; no AdmissionReview is larger."""
HANDSHAKE_TIMEOUT = 10.0
IDLE_TIMEOUT = 120.0


class ServingCert:
    """The certificate and key the server presents; ``load`` swaps them in."""

    def __init__(self, cert_dir: Path) -> None:
        self.cert_dir = cert_dir
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self.loaded = threading.Event()
        self.fingerprint = ""

    def load(self, cert: bytes, key: bytes) -> bool:
        """Serve ``cert``/``key`` from now on; False when they are what is served already."""
        fingerprint = x509.load_pem_x509_certificate(cert).fingerprint(hashes.SHA256()).hex()
        if fingerprint == self.fingerprint:
            return False
        self.cert_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # ssl loads a chain only from files; these live in a private directory (an emptyDir).
        cert_file, key_file = self.cert_dir / "tls.crt", self.cert_dir / "tls.key"
        for path, data in ((cert_file, cert), (key_file, key)):
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            tmp.replace(path)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(cert_file, key_file)
        with self._lock:
            self._context = context
            self.fingerprint = fingerprint
        self.loaded.set()
        log.info("serving certificate loaded", sha256=fingerprint[:16])
        return True

    def context(self) -> ssl.SSLContext | None:
        with self._lock:
            return self._context


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], app: WebhookServer) -> None:
        self.app = app
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        context = self.app.cert.context()
        if context is None:
            return  # not ready: close without a word, the API server retries
        request.settimeout(HANDSHAKE_TIMEOUT)
        # A response is small and written at once; without TCP_NODELAY, Nagle's algorithm holds
        # any second segment until the client's delayed ACK (40 ms on Linux), which was 99% of
        # every review's round trip (bench/bench_controller.py, docs/controller.md "Figures").
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            tls = context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.debug("tls handshake failed", client=client_address[0], error=str(exc))
            return
        tls.settimeout(IDLE_TIMEOUT)
        try:
            _Handler(tls, client_address, self)
        finally:
            with contextlib.suppress(OSError):
                tls.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Buffered: the status line, headers and body leave in one write (one TLS record), flushed
    # by the handler after each request, instead of one write for the headers and one for the
    # body.
    wbufsize = 64 * 1024
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        return  # one structured line per review comes from admission.answer

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
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n")

    def do_POST(self) -> None:
        reviewer = self.server.app.reviewers.get(self.path.split("?", 1)[0].lstrip("/"))
        length = int(self.headers.get("Content-Length") or 0)
        if reviewer is None:
            self.rfile.read(min(length, MAX_BODY))
            self._send(HTTPStatus.NOT_FOUND, b"no such webhook\n")
            return
        if length <= 0 or length > MAX_BODY:
            self.close_connection = True
            self._send(HTTPStatus.BAD_REQUEST, b"an AdmissionReview body is required\n")
            return
        body = self.rfile.read(length)
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
    ) -> None:
        self.cert = cert
        self.view = view
        self.reviewers = dict(reviewers)
        self.readiness = dict(readiness or {})
        self._server = _Server(addr, self)
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
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="webhook-server", daemon=True
        )
        self._thread.start()
        log.info("webhook server listening", address=self._server.server_address[0], port=self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
