"""The plugin as a real process (``python -m gpuslice_kubelet_plugin``), for tests and bench/.

plugin = PluginProcess(node="n1", kubeconfig=..., fake_nvml_config=..., state_dir=...,
                       cdi_root=..., registrar_dir=..., plugins_dir=...).start()
plugin.kill9() / plugin.terminate() / plugin.stop()
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuslice_kubelet_plugin.discovery import DRIVER
from gpuslice_kubelet_plugin.server import Sockets, probe


class PluginProcess:
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
    ) -> None:
        self.node = node
        self.state_dir = state_dir
        self.cdi_root = cdi_root
        self.sockets = Sockets.for_driver(
            DRIVER, registrar_dir=registrar_dir, plugins_dir=plugins_dir
        )
        self.argv = [
            sys.executable,
            "-m",
            "gpuslice_kubelet_plugin",
            "--node-name",
            node,
            "--kubeconfig",
            str(kubeconfig),
            "--nvml",
            "fake",
            "--fake-nvml-config",
            str(fake_nvml_config),
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
            *extra,
        ]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def checkpoint(self) -> Path:
        return self.state_dir / "kubelet-plugin.json"

    def start(self, timeout: float = 60) -> PluginProcess:
        """Start and wait until both sockets answer (the probe passes)."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while probe(self.sockets, timeout=1):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the plugin exited: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the plugin did not come up in {timeout}s: {self.log}")
            time.sleep(0.05)
        return self

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM; the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
