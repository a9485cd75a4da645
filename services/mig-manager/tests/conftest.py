"""Fixtures: an 8x A100-SXM4-40GB fake node, a manager over it, the default layouts, gRPC."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_mig_manager.layouts import LayoutConfig, parse_layouts
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.servicer import SERVICE_NAME, MigManagerServicer
from gpuslice_mig_manager.sources import FileLayouts
from gpuslice_mig_manager.state import open_store
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_protos.gpuslice.v1 import migmanager_pb2_grpc as pbgrpc

REPO = Path(__file__).resolve().parents[3]
MANIFEST = REPO / "e2e" / "manifests" / "mig-configs.yaml"
BOOT_ID = "test-boot"

EIGHT_A100 = """\
name: {name}
statePath: fake-state.json
gpus:
  - model: A100-SXM4-40GB
    count: 8
"""


def default_layouts_text() -> str:
    """The config.yaml of the shipped ConfigMap."""
    manifest = yaml.safe_load(MANIFEST.read_text())
    text: str = manifest["data"]["config.yaml"]
    return text


@pytest.fixture
def node_config(tmp_path: Path) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(EIGHT_A100.format(name=f"a100x8-{tmp_path.name}"))
    return path


@pytest.fixture
def fake(node_config: Path) -> FakeNvml:
    return FakeNvml.from_config_file(node_config)


@pytest.fixture
def control(node_config: Path) -> FakeNvmlControl:
    return FakeNvmlControl.from_config_file(node_config)


@pytest.fixture
def layouts_file(tmp_path: Path) -> Path:
    path = tmp_path / "layouts.yaml"
    path.write_text(default_layouts_text())
    return path


@pytest.fixture
def layouts() -> LayoutConfig:
    return parse_layouts(default_layouts_text(), source=str(MANIFEST))


MakeManager = Callable[..., MigManager]


@pytest.fixture
def make_manager(fake: FakeNvml, tmp_path: Path) -> MakeManager:
    """A manager over the fake node; ``dynamic`` chooses dynamic MIG (state in tmp_path)."""

    def make(*, dynamic: bool = False) -> MigManager:
        return MigManager(fake, open_store(tmp_path / "state", boot_id=BOOT_ID), dynamic=dynamic)

    return make


@pytest.fixture
def manager(make_manager: MakeManager) -> MigManager:
    return make_manager()


@pytest.fixture
def dynamic_manager(make_manager: MakeManager) -> MigManager:
    return make_manager(dynamic=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for unix sockets (paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="gsmm-") as d:
        yield Path(d)


Serve = Callable[[MigManager], pbgrpc.MigManagerStub]


@pytest.fixture
def serve(short_dir: Path, layouts_file: Path) -> Iterator[Serve]:
    """Serve a manager over a real unix socket; returns a stub (servers stop after the test)."""
    servers: list[UnixGrpcServer] = []
    channels: list[grpc.Channel] = []

    def start(manager: MigManager) -> pbgrpc.MigManagerStub:
        socket = short_dir / f"mm-{len(servers)}.sock"
        server = UnixGrpcServer([socket], name="mig-manager-test")
        servicer = MigManagerServicer(manager, FileLayouts(layouts_file))
        server.add(pbgrpc.add_MigManagerServicer_to_server, servicer, SERVICE_NAME)
        server.start()
        servers.append(server)
        channel = grpc.insecure_channel(f"unix://{socket}")
        channels.append(channel)
        return pbgrpc.MigManagerStub(channel)

    yield start
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(grace=1)
