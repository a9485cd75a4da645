"""Test helpers shared by the unit tests and the e2e suite: fake node layouts and settings."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import yaml

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_device_plugin.cli import parse
from gpuslice_device_plugin.config import ConfigFile, Settings, parse_config, resolve
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

#: 8 H100s; GPUs 0-3 NVLinked all-to-all, 4-7 too; 4-7 on NUMA node 1.
H100X8_NVLINK: dict[str, Any] = {
    "gpus": [
        {"model": "H100", "count": 4, "numaNode": 0},
        {"model": "H100", "count": 4, "numaNode": 1},
    ],
    "topology": {
        "nvlink": [{"gpus": [0, 1, 2, 3], "links": 18}, {"gpus": [4, 5, 6, 7], "links": 18}]
    },
}
#: 2 plain H100s and 2 in MIG mode.
H100_MIXED: dict[str, Any] = {
    "gpus": [
        {"model": "H100", "count": 2},
        {
            "model": "H100",
            "count": 2,
            "migEnabled": True,
            "migInstances": [{"profile": "3g.40gb"}, {"profile": "1g.10gb", "count": 2}],
        },
    ]
}


def write_node(directory: Path, doc: dict[str, Any], name: str) -> Path:
    """A fake NVML config (``gpus``/``topology`` from ``doc``) with its state file next to it."""
    path = directory / f"{name}-nvml.yaml"
    path.write_text(yaml.safe_dump({"name": name, "statePath": f"{name}-state.json", **doc}))
    return path


def settings(config: str = "", *argv: str) -> Settings:
    """The effective settings for a config file text and command-line flags."""
    args, _ = parse(list(argv))
    file: ConfigFile | None = parse_config(config) if config else None
    return resolve(args, file)


class Kubelet(pb_grpc.RegistrationServicer):
    """A stand-in kubelet Registration service on ``<dir>/kubelet.sock`` that queues every
    RegisterRequest."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.requests: queue.Queue[pb.RegisterRequest] = queue.Queue()
        self.server: UnixGrpcServer | None = None

    def start(self) -> Kubelet:
        self.server = UnixGrpcServer([self.dir / "kubelet.sock"], name="kubelet")
        self.server.add(pb_grpc.add_RegistrationServicer_to_server, self, "v1beta1.Registration")
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0.1)

    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:  # noqa: N802
        self.requests.put(request)
        return pb.Empty()
