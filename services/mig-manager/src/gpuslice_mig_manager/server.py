"""The MIG manager's socket: ``gpuslice.v1.MigManager`` and health on one unix socket."""

from __future__ import annotations

from pathlib import Path

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_mig_manager.servicer import SERVICE_NAME, MigManagerServicer
from gpuslice_protos.gpuslice.v1 import migmanager_pb2_grpc as pbgrpc


def grpc_server(socket: Path, servicer: MigManagerServicer) -> UnixGrpcServer:
    """The server of ``servicer`` on ``socket``, not started (0600 socket, streams capped)."""
    server = UnixGrpcServer([socket], name="mig-manager")
    server.add(pbgrpc.add_MigManagerServicer_to_server, servicer, SERVICE_NAME)
    return server
