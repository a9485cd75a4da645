"""A scripted HTTP server standing in for the API server in unit tests of the raw client.

Each test installs a ``route`` function that answers (method, path, query, body) with
(status, json-able body or list of watch events, hold_open). Tests against the real
kube-apiserver live in e2e/.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client

Route = Callable[[str, str, dict[str, str], Any], tuple[int, Any]]


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client closing a keep-alive connection is normal here, not a traceback."""


class ScriptedServer:
    def __init__(self) -> None:
        self.route: Route = lambda *_: (404, {"message": "no route"})
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.release = threading.Event()
        handler = self._handler_class()
        self.httpd = _QuietServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def _serve(self) -> None:
                # the client may close a watch before the server is done with it
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self._answer()

            def _answer(self) -> None:
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.requests.append((self.command, parts.path, query))
                status, payload = server.route(self.command, parts.path, query, body)
                if query.get("watch") == "true" and status == 200:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for event in payload:
                        line = (json.dumps(event) + "\n").encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    server.release.wait(10)  # hold the watch open like a real server
                    self.wfile.write(b"0\r\n\r\n")
                    return
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve  # noqa: N815

        return Handler


@pytest.fixture
def apiserver() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    server.thread.start()
    yield server
    server.release.set()
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.fixture
def api_client(apiserver: ScriptedServer) -> client.ApiClient:
    configuration = client.Configuration(host=apiserver.url)
    return client.ApiClient(configuration)
