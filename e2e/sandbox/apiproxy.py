"""The `kubernetes` Service for pods on real sandbox nodes: a TCP relay from the Service's
ClusterIP (10.0.0.1:443, what in-cluster clients read from KUBERNETES_SERVICE_HOST/PORT) to the
API server on loopback.

A real cluster's kube-proxy programs that ClusterIP with NAT rules; the sandbox changes no
iptables rules and leaves the host's ip_forward alone, so instead every node's bridge carries
the ClusterIP as a local /32 address, the pods' CNI config routes it through the bridge, and
each node runs this relay on it. All nodes on the machine share the port (SO_REUSEPORT), and
the kernel may hand a connection to any of them, while nodes of different sandboxes lead to
different API servers: so the upstream is chosen by the client's address. Pods of node slot n
have 10.244.n.x, and slot n's record in the node registry (``--registry``) names its API
server; ``--upstream`` serves anything else. Bytes are copied unchanged: TLS ends at the API
server, whose certificate names 10.0.0.1.

    python -m e2e.sandbox.apiproxy --listen 10.0.0.1:443 --upstream 127.0.0.1:6443 \
        --registry /tmp/gpuslice-realnodes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import signal
import socket
from collections.abc import Sequence
from pathlib import Path

IP_FREEBIND = 15  # linux/in.h: bind before the address is on an interface
PODS = ipaddress.ip_network("10.244.0.0/16")  # slot n: 10.244.n.0/24 (e2e/sandbox/nodehost.py)


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


def upstream_for(peer: str, registry: Path | None, default: tuple[str, int]) -> tuple[str, int]:
    """The API server of the node whose pod ``peer`` is (its slot's record), else ``default``."""
    address = ipaddress.ip_address(peer)
    if registry is None or address not in PODS:
        return default
    slot = int(address.packed[2])
    try:
        record = json.loads((registry / f"slot-{slot}.json").read_text())
    except (OSError, ValueError):
        return default
    server = str(record.get("apiserver") or "")
    return _address(server) if server else default


async def _serve(listen: tuple[str, int], upstream: tuple[str, int], registry: Path | None) -> None:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername")[0])
        try:
            up_reader, up_writer = await asyncio.open_connection(
                *upstream_for(peer, registry, upstream)
            )
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
    parser.add_argument(
        "--upstream", required=True, help="HOST:PORT of this node's API server (the default)."
    )
    parser.add_argument(
        "--registry", type=Path, help="The real-node registry: each slot's API server."
    )
    args = parser.parse_args(argv)
    asyncio.run(_serve(_address(args.listen), _address(args.upstream), args.registry))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
