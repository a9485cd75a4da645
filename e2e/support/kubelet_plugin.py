"""Helpers the kubelet-plugin tests share that are not fixtures (those are in
e2e/tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from e2e.sandbox.controlplane import ControlPlane
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_testkit.kubelet_plugin.harness import Node
from gpuslice_testkit.kubelet_plugin.process import PluginProcess


class ClaimMaker(Protocol):
    def __call__(
        self,
        name: str,
        *,
        results: list[Obj] | None = None,
        config: list[Obj] | None = None,
        reserved_for: tuple[tuple[str, str], ...] = (),
    ) -> Obj: ...


class Processes:
    """Plugin processes of one node; all stopped, and the node's slices deleted, after."""

    def __init__(self, sandbox: ControlPlane, root: Path, node: Node, name: str) -> None:
        self.sandbox = sandbox
        self.root = root
        self.node = node
        self.name = name
        self.started: list[PluginProcess] = []

    def start(self, *extra: str) -> PluginProcess:
        plugin = PluginProcess(
            node=self.name,
            kubeconfig=self.sandbox.kubeconfig,
            fake_nvml_config=self.node.config,
            state_dir=self.root / "state",
            cdi_root=self.root / "cdi",
            registrar_dir=self.root / "reg",
            plugins_dir=self.root / "plugins",
            log=self.root / "plugin.log",
            extra=extra,
        )
        self.started.append(plugin)
        return plugin.start()


class RecordingRawApi(RawApi):
    """The real client, remembering the paths it GETs."""

    def __init__(self, raw: RawApi) -> None:
        super().__init__(raw.api_client, deadline=raw.deadline)
        self.gets: list[str] = []

    def get(self, path: str) -> Obj:
        self.gets.append(path)
        return super().get(path)
