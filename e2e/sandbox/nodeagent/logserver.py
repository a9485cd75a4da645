"""The kubelet's ``/containerLogs`` endpoint over HTTPS, so ``kubectl logs`` works.

The API server proxies ``kubectl logs`` to ``https://<node address>:<daemonEndpoints port>/
containerLogs/<namespace>/<pod>/<container>``. This serves that path (with ``previous``,
``tailLines``, ``limitBytes`` and ``follow``) from the runtime's log files, on 127.0.0.1 and a
port of its own, with a self-signed serving certificate (the sandbox's API server does not
verify kubelet certificates). No authentication or authorization: it listens on loopback only.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from gpuslice_core.logging import get_logger
from gpuslice_testkit.certs import TinyCA

log = get_logger(__name__)

# (namespace, pod, container, previous) -> log file, and a "still running" check
LogLocator = Callable[[str, str, str, bool], tuple[Path, Callable[[], bool]] | None]


def serving_cert(directory: Path) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1/localhost from a throwaway CA of this node (the
    sandbox's API server does not verify kubelet certificates)."""
    pair = TinyCA(directory / "kubelet-ca", common_name="kubelet-ca").serving("kubelet-serving")
    return pair.cert, pair.key


class LogServer:
    def __init__(self, locate: LogLocator, cert_dir: Path, node: str) -> None:
        crt, key = serving_cert(cert_dir)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(crt), str(key))
        locator = locate

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return

            def do_GET(self) -> None:
                url = urlparse(self.path)
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                if parts == ["healthz"]:
                    self._send(200, b"ok")
                    return
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self._send(404, b"not found")
                    return
                query = parse_qs(url.query)
                previous = query.get("previous", ["false"])[0] == "true"
                found = locator(parts[1], parts[2], parts[3], previous)
                if found is None:
                    self._send(
                        404, f"container {parts[3]} of pod {parts[1]}/{parts[2]} not found".encode()
                    )
                    return
                path, running = found
                data = path.read_bytes() if path.exists() else b""
                if "tailLines" in query:
                    n = int(query["tailLines"][0])
                    lines = data.splitlines(keepends=True)
                    data = b"".join(lines[-n:]) if n > 0 else b""
                if "limitBytes" in query:
                    data = data[: int(query["limitBytes"][0])]
                follow = query.get("follow", ["false"])[0] == "true"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                if not follow:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                if follow:
                    self._follow(path, path.stat().st_size if path.exists() else 0, running)

            def _follow(self, path: Path, offset: int, running: Callable[[], bool]) -> None:
                try:
                    while True:
                        alive = running()
                        with path.open("rb") as fh:
                            fh.seek(offset)
                            chunk = fh.read()
                        if chunk:
                            offset += len(chunk)
                            self.wfile.write(chunk)
                            self.wfile.flush()
                        if not alive:
                            return
                        time.sleep(0.2)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    return

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"{node}-logs", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
