"""The plugin running in-process on a fake node (fake NVML) against a real API server (the
e2e sandbox's: pass its admin kubeconfig), for tests and bench/.

harness = Harness(short_dir, sandbox.kubeconfig, nvml, node_name=unique_node)
running = harness.start(dynamic_mig=True)      # Settings overrides
running.client.prepare([...])
harness.stop_all()
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import RawApi
from gpuslice_kubelet_plugin.app import KubeletPluginApp
from gpuslice_kubelet_plugin.cli import Settings
from gpuslice_kubelet_plugin.state import DeviceState
from gpuslice_nvml import Nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_testkit.kubelet_plugin.dra import DraClient

# two whole H100s and one in MIG mode (1g.10gb at 0, 3g.40gb at 4)
H100X2_MIG: list[dict[str, Any]] = [
    {"model": "H100", "count": 2},
    {
        "model": "H100",
        "migEnabled": True,
        "migInstances": [{"profile": "3g.40gb"}, {"profile": "1g.10gb", "placement": 0}],
    },
]


def write_node(directory: Path, gpus: list[dict[str, Any]], name: str) -> Path:
    """A fake NVML config whose state file lives next to it."""
    path = directory / f"{name}-nvml.yaml"
    path.write_text(yaml.safe_dump({"name": name, "statePath": f"{name}-state.json", "gpus": gpus}))
    return path


@dataclass
class Node:
    config: Path
    nvml: Nvml
    control: FakeNvmlControl


@dataclass
class Running:
    app: KubeletPluginApp
    settings: Settings
    client: DraClient

    @property
    def state(self) -> DeviceState:
        return self.app.state

    def stop(self) -> None:
        self.client.close()
        if not self.app.stopped:
            self.app.stop()


class Harness:
    def __init__(self, root: Path, kubeconfig: Path, nvml: Nvml, *, node_name: str) -> None:
        self.root = root
        self.kubeconfig = kubeconfig
        self.nvml = nvml
        self.node_name = node_name
        self.running: list[Running] = []

    def settings(self, **overrides: Any) -> Settings:
        base = Settings(
            node_name=self.node_name,
            state_dir=self.root / "state",
            cdi_root=self.root / "cdi",
            registrar_dir=self.root / "reg",
            plugins_dir=self.root / "plugins",
            health_check_interval=0.2,
            gc_interval=3600,
            rescan_interval=3600,
            shutdown_grace=2.0,
            boot_id="boot-1",
            orphan_grace=0.0,
        )
        return replace(base, **overrides)

    def raw(self, deadline: float = 5.0) -> RawApi:
        """A client of the harness' API server (what ``start`` gives the plugin by default)."""
        return RawApi(
            new_api_client(self.kubeconfig, user_agent="gpuslice-test"), deadline=deadline
        )

    def start(
        self, nvml: Nvml | None = None, *, raw: RawApi | None = None, **overrides: Any
    ) -> Running:
        """Start the plugin with ``Settings`` overrides; ``raw`` replaces its API client."""
        settings = self.settings(**overrides)
        app = KubeletPluginApp(settings, nvml or self.nvml, raw or self.raw())
        app.start()
        running = Running(app, settings, DraClient(settings.sockets.dra))
        self.running.append(running)
        return running

    def stop_all(self) -> None:
        for running in self.running:
            running.stop()
