"""The controller's HTTPS server under hostile clients: memory and threads (issue 27). Prints
figures; asserts nothing. The server runs in a process of its own (``WebhookServer`` with one
allow-all reviewer, as the controller serves /validate) and the probes come from this one.

    .venv/bin/python bench/bench_webhook_hostile.py [--clients 40] [--slow 200]

Probes, each on a fresh server: (1) ``--clients`` connections each sending an unfinished 65 KB
header line, (1b) or whole 65 KB header lines without end; (2) a 256 MiB stream to an unknown
path with ``Content-Length: -1``; (3) ``--slow`` slowloris connections sending a request line,
then one byte every second for 15 s, (3b) or the request line itself a byte a second. For each: the
server's RSS before and at its peak, its threads, and whether a valid review is still answered.
Issue 27's figures before the limits: (1) 84 → 958 MiB with 24 clients (1.48 GB with 40);
(2) 84 → 596 MiB; (3) 212 threads after 36 s, never closed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVER = """
import sys, time
from pathlib import Path
from gpuslice_controller.tls import certs
from gpuslice_controller.admission.review import Decision
from gpuslice_controller.server import WebhookServer
from gpuslice_controller.tls.serving import ServingCert
import datetime as dt
material = certs.bootstrap(certs.Policy(hosts=("127.0.0.1",)), dt.datetime.now(dt.UTC))
Path(sys.argv[1]).write_bytes(material.ca_certs)
srv = WebhookServer(("127.0.0.1", 0), ServingCert(Path(sys.argv[2])),
                    {"validate": ("t", lambda r: Decision.allow())})
srv.cert.load(material.cert, material.key)
srv.start()
Path(sys.argv[3]).write_text(str(srv.port))
time.sleep(3600)
"""


def status(pid: int) -> tuple[float, int]:
    """RSS in MiB and thread count of ``pid``."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])


class Server:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-webhook-"))
        port_file = self.dir / "port"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER,
                *(str(self.dir / n) for n in ("ca.pem", "certs", "port")),
            ],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.ctx = ssl.create_default_context(cadata=(self.dir / "ca.pem").read_text())
        self.peak = 0.0

    def tls(self) -> ssl.SSLSocket:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return self.ctx.wrap_socket(raw, server_hostname="127.0.0.1")

    def sample(self) -> tuple[float, int]:
        rss, threads = status(self.proc.pid)
        self.peak = max(self.peak, rss)
        return rss, threads

    def review_answered(self) -> str:
        body = json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {"uid": "u", "kind": {"kind": "Thing"}, "object": {}},
            }
        ).encode()
        start = time.monotonic()
        try:  # from another address, as the API server is another client than the attacker
            raw = socket.create_connection(
                ("127.0.0.1", self.port), timeout=10, source_address=("127.0.0.2", 0)
            )
            conn = self.ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            conn.sendall(
                b"POST /validate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            answer = conn.recv(100)
        except OSError as exc:
            return f"no ({exc})"
        return (
            f"yes, {(time.monotonic() - start) * 1000:.0f} ms"
            if answer.startswith(b"HTTP/1.1 200")
            else f"no ({answer[:40]!r})"
        )

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def probe(name: str, attack: object, seconds: float) -> None:
    server = Server()
    try:
        before, threads_before = server.sample()
        stop = threading.Event()
        worker = threading.Thread(target=attack, args=(server, stop), daemon=True)  # type: ignore[arg-type]
        worker.start()
        end = time.monotonic() + seconds
        max_threads = threads_before
        answered = ""
        while time.monotonic() < end:
            _, threads = server.sample()
            max_threads = max(max_threads, threads)
            if not answered and time.monotonic() > end - seconds / 2:
                answered = server.review_answered()  # in the middle of the attack
            time.sleep(0.2)
        _, threads_end = server.sample()
        stop.set()
        print(
            f"{name:<44} RSS {before:6.1f} → peak {server.peak:6.1f} MiB   threads "
            f"{threads_before} → max {max_threads}, {threads_end} at the end   "
            f"a review from another client mid-attack: {answered}"
        )
    finally:
        server.close()


def header_flood(clients: int, whole: bool = False) -> object:
    """Header lines of 65 KB to ``clients`` connections: one that never ends, or (``whole``)
    one whole line after another, the head never ending."""

    def attack(server: Server, stop: threading.Event) -> None:
        conns = []
        for _ in range(clients):
            with contextlib.suppress(OSError):
                conn = server.tls()
                conn.sendall(b"POST /validate HTTP/1.1\r\n")
                conns.append(conn)
        line = b"X-Pad: " + b"a" * 65_000 + (b"\r\n" if whole else b"")
        while not stop.is_set():
            for conn in list(conns):
                try:
                    conn.sendall(line)
                except OSError:
                    conns.remove(conn)
            time.sleep(0.1)

    return attack


def body_stream(server: Server, stop: threading.Event) -> None:
    with contextlib.suppress(OSError):
        conn = server.tls()
        conn.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        chunk = b"b" * (1 << 20)
        for _ in range(256):
            if stop.is_set():
                break
            conn.sendall(chunk)


def slowloris(count: int, first: bytes = b"POST /validate HTTP/1.1\r\n") -> object:
    """``count`` connections sending ``first``, then one byte a second."""

    def attack(server: Server, stop: threading.Event) -> None:
        conns = []
        for _ in range(count):
            with contextlib.suppress(OSError):
                raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                conn = server.ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                conn.sendall(first)
                conns.append(conn)
        while not stop.is_set():
            for conn in list(conns):
                try:
                    conn.sendall(b"X")
                except OSError:
                    conns.remove(conn)
            stop.wait(1.0)

    return attack


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--slow", type=int, default=200)
    args = parser.parse_args()
    print(f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC")
    probe(
        f"1. {args.clients} clients, unfinished 65 KB header lines", header_flood(args.clients), 8
    )
    probe(
        f"1b. {args.clients} clients, whole 65 KB header lines",
        header_flood(args.clients, whole=True),
        8,
    )
    probe("2. 256 MiB body, Content-Length: -1, unknown path", body_stream, 8)
    probe(f"3. {args.slow} slowloris connections, 1 byte/s", slowloris(args.slow), 15)
    probe(f"3b. {args.slow} request lines, 1 byte/s", slowloris(args.slow, first=b"P"), 15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
