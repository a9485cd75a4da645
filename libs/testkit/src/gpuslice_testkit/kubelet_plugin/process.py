"""The plugin as a real process (``python -m gpuslice_kubelet_plugin``), for tests and bench/.

plugin = PluginProcess(node="n1", kubeconfig=..., fake_nvml_config=..., state_dir=...,
                       cdi_root=..., registrar_dir=..., plugins_dir=...).start()
PluginProcess(..., backend="mock")   # --nvml=real on the mock library, on the same fake node
plugin.kill9() / plugin.terminate() / plugin.stop()
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from gpuslice_api.names import DRIVER
from gpuslice_draplugin import Sockets, probe
from gpuslice_kubelet_plugin.checkpoint import open_store
from gpuslice_testkit.core import ServiceProcess
from gpuslice_testkit.nvml_mock import NvmlBackend, nvml_env, nvml_flags


class PluginProcess(ServiceProcess):
    def __init__(
        self,
        *,
        node: str,
        kubeconfig: Path,
        fake_nvml_config: Path,
        state_dir: Path,
        cdi_root: Path,
        registrar_dir: Path,
        plugins_dir: Path,
        log: Path,
        extra: tuple[str, ...] = (),
        backend: NvmlBackend = "fake",
    ) -> None:
        self.node = node
        self.state_dir = state_dir
        self.cdi_root = cdi_root
        self.sockets = Sockets.for_driver(
            DRIVER, registrar_dir=registrar_dir, plugins_dir=plugins_dir
        )
        argv = [
            sys.executable,
            "-m",
            "gpuslice_kubelet_plugin",
            "--node-name",
            node,
            "--kubeconfig",
            str(kubeconfig),
            *nvml_flags(backend, fake_nvml_config),
            "--cdi-root",
            str(cdi_root),
            "--registrar-dir",
            str(registrar_dir),
            "--plugins-dir",
            str(plugins_dir),
            "--state-dir",
            str(state_dir),
            "--metrics-addr",
            "",
            "--health-addr",
            "",
            *extra,
        ]
        added = nvml_env(backend, fake_nvml_config)
        # ready when both sockets answer: probe() returns the problems, none when healthy
        super().__init__(
            "gpuslice-kubelet-plugin",
            argv,
            log=log,
            ready=lambda: not probe(self.sockets, timeout=1),
            env={**os.environ, **added} if added else None,
        )

    @property
    def checkpoint(self) -> Path:
        """The checkpoint's base file (commits go to its journal, ``<base>.journal``)."""
        return self.state_dir / "kubelet-plugin.json"

    def checkpoint_claims(self) -> dict[str, dict[str, Any]]:
        """The committed claim records (base and journal, as the plugin reads them), as JSON."""
        state = open_store(self.state_dir).load().state
        return {uid: r.model_dump(mode="json") for uid, r in state.claims.items()}

    def start(self, timeout: float = 60.0) -> PluginProcess:
        """Start and wait until both sockets answer end to end (the probe passes)."""
        return super().start(timeout)
