"""The `kubernetes` Service for pods on real sandbox nodes: a TCP relay from the Service's
ClusterIP (10.0.0.1:443, what in-cluster clients read from KUBERNETES_SERVICE_HOST/PORT) to the
API server on loopback.

A real cluster's kube-proxy programs that ClusterIP with NAT rules; the sandbox changes no
iptables rules and leaves the host's ip_forward alone, so instead every node's bridge carries
the ClusterIP as a local /32 address, the pods' CNI config routes it through the bridge, and
each node runs this relay on it (SO_REUSEPORT: the nodes of one control plane share the port;
any of them may take a connection, since all lead to the same API server). Bytes are copied
unchanged: TLS ends at the API server, whose certificate names 10.0.0.1.

    python -m e2e.sandbox.apiproxy --listen 10.0.0.1:443 --upstream 127.0.0.1:6443
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from collections.abc import Sequence

IP_FREEBIND = 15  # linux/in.h: bind before the address is on an interface


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


async def _serve(listen: tuple[str, int], upstream: tuple[str, int]) -> None:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)
    sock.bind(listen)
    server = await asyncio.start_server(relay, sock=sock)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"apiproxy: {listen[0]}:{listen[1]} -> {upstream[0]}:{upstream[1]}", flush=True)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.sandbox.apiproxy", description=__doc__)
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept connections on.")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the API server.")
    args = parser.parse_args(argv)
    asyncio.run(_serve(_address(args.listen), _address(args.upstream)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
