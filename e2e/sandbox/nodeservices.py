"""The node DaemonSet pod on the sandbox: the real enforcer and MIG manager next to a GPU node's
real kubelet plugin.

In a cluster the node pod runs three containers that meet over unix sockets in a directory they
share (docs/architecture.md, "Services"): ``gpuslice-kubelet-plugin``, ``gpuslice-enforcer`` and
``gpuslice-mig-manager``. Here each is a local process on the fake NVML of one sandbox GPU node
(e2e/sandbox/gpunode.py), all three reading the same fake NVML config and state file::

    pod = start_node_pod(sandbox, gpus, enforcer=True, mig_manager=True, dynamic_mig=True,
                         nvml={"driverVersion": "615.20"})
    pod.node            # the GpuNode: agent + kubelet plugin with --enforcer-socket,
                        # --mig-manager-socket (and --dynamic-mig) pointing at the services
    with pod.services.enforcer() as stub: stub.GetUsage(...)
    stop_node_pod(pod, kube)

``backend="mock"`` runs every process of the pod with ``--nvml=real`` on the mock
libnvidia-ml, driven by the same fake node (docs/nvml-mock.md); ``nvml_config=`` starts the
services on a node another pod (e.g. one on the fake) already wrote.

``NodeServices.start`` alone starts just the services (``plugin_flags()`` gives the plugin's
flags for them), e.g. for ``gpunode.start_gpu_node(..., extra=services.plugin_flags())`` when
the default fake NVML config suffices.

Layout under the node's root (a short /tmp path: unix socket paths are limited to 107 bytes):
``run/`` the shared socket directory (``enforcer.sock``, ``mig-manager.sock``), ``mps/`` the
enforcer's MPS root, ``enforcer/`` and ``mig-manager/`` the state directories,
``logs/<service>.log``. Processes run in their own sessions, die with the test process
(PDEATHSIG), and ``stop()`` SIGTERMs then SIGKILLs each group and reports any that survived.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from e2e.sandbox import procs
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import GpuNode, start_gpu_node, stop_gpu_node
from e2e.sandbox.nodeagent.testing import unique
from e2e.sandbox.procs import Proc
from gpuslice_core.grpcserver import check_health
from gpuslice_kube.raw import RawApi
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc, migmanager_pb2_grpc
from gpuslice_testkit.core import http_probe
from gpuslice_testkit.enforcer import stop_mps_daemons
from gpuslice_testkit.kubelet_plugin.harness import write_node
from gpuslice_testkit.nvml_mock import NvmlBackend, enforcer_flags, nvml_env, nvml_flags

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


class ServiceStartError(RuntimeError):
    """A node service exited or did not become healthy; the message holds its log's tail."""


def _console(script: str, module: str) -> list[str]:
    """The console script from the virtualenv, else ``python -m <module>``."""
    path = BIN / script
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


@dataclass
class NodeServices:
    """The enforcer and MIG manager processes of one sandbox GPU node."""

    name: str
    root: Path
    nvml_config: Path
    kubeconfig: Path
    enforcer_args: list[str] = field(default_factory=list)
    mig_manager_args: list[str] = field(default_factory=list)
    backend: NvmlBackend = "fake"
    running: dict[str, Proc] = field(default_factory=dict)
    #: Each running service's /healthz and /readyz port on loopback (gpuslice_core.health).
    health_ports: dict[str, int] = field(default_factory=dict)

    # -- paths ----------------------------------------------------------------------------
    @property
    def socket_dir(self) -> Path:
        return self.root / "run"

    @property
    def enforcer_socket(self) -> Path:
        return self.socket_dir / "enforcer.sock"

    @property
    def mig_manager_socket(self) -> Path:
        return self.socket_dir / "mig-manager.sock"

    @property
    def hook_path(self) -> Path:
        return BIN / "gpuslice-enforcer-hook"

    def log(self, service: str) -> Path:
        return self.root / "logs" / f"{service}.log"

    # -- start ----------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        sandbox: ControlPlane,
        gpus: list[dict[str, Any]],
        *,
        enforcer: bool = True,
        mig_manager: bool = False,
        dynamic_mig: bool = False,
        enforcer_args: tuple[str, ...] = (),
        mig_manager_args: tuple[str, ...] = (),
        nvml: dict[str, Any] | None = None,
        name: str | None = None,
        root: Path | None = None,
        timeout: float = 30,
        backend: NvmlBackend = "fake",
        nvml_config: Path | None = None,
    ) -> NodeServices:
        """Write the node's fake NVML config (the file ``start_gpu_node`` writes for the same
        name and root; ``nvml`` adds top-level keys such as ``driverVersion``), or take the one
        ``nvml_config`` names, and start the services asked for on ``backend``, each healthy on
        its socket before this returns."""
        name = name or unique("gpu-node")
        root = root or Path(tempfile.mkdtemp(prefix="gkn-"))
        config = nvml_config or write_node(root, gpus, name)
        if nvml:
            doc = yaml.safe_load(config.read_text())
            doc.update(nvml)
            config.write_text(yaml.safe_dump(doc))
        services = cls(
            name,
            root,
            config,
            sandbox.kubeconfig,
            list(enforcer_args),
            list(mig_manager_args) + (["--dynamic-mig"] if dynamic_mig else []),
            backend,
        )
        services.socket_dir.mkdir(parents=True, exist_ok=True)
        try:
            if enforcer:
                services.start_enforcer(timeout)
            if mig_manager:
                services.start_mig_manager(timeout)
        except BaseException:
            services.stop()
            raise
        return services

    def _common(self, service: str) -> list[str]:
        self.health_ports[service] = procs.free_port()
        return [
            f"--node-name={self.name}",
            *nvml_flags(self.backend, self.nvml_config),
            "--metrics-addr=",
            f"--health-addr={procs.LOOPBACK}:{self.health_ports[service]}",
            "--log-level=debug",
        ]

    def start_enforcer(self, timeout: float = 30) -> Proc:
        argv = [
            *_console("gpuslice-enforcer", "gpuslice_enforcer"),
            *self._common("enforcer"),
            f"--socket={self.enforcer_socket}",
            f"--state-dir={self.root / 'enforcer'}",
            f"--mps-root={self.root / 'mps'}",
            f"--hook-path={self.hook_path}",
            *enforcer_flags(self.backend, self.nvml_config),
            *self.enforcer_args,
        ]
        return self._start("enforcer", argv, self.enforcer_socket, timeout)

    def start_mig_manager(self, timeout: float = 30) -> Proc:
        argv = [
            *_console("gpuslice-mig-manager", "gpuslice_mig_manager"),
            *self._common("mig-manager"),
            f"--kubeconfig={self.kubeconfig}",
            f"--socket={self.mig_manager_socket}",
            f"--state-dir={self.root / 'mig-manager'}",
            *self.mig_manager_args,
        ]
        return self._start("mig-manager", argv, self.mig_manager_socket, timeout)

    def _start(self, service: str, argv: list[str], socket: Path, timeout: float) -> Proc:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("KUBECONFIG", "NODE_NAME", "GPUSLICE_NODE_NAME")
        }
        env["PYTHONUNBUFFERED"] = "1"
        env.update(nvml_env(self.backend, self.nvml_config))
        proc = procs.start(
            service, argv, self.log(service), env, cwd=REPO_ROOT, die_with_parent=True
        )
        self.running[service] = proc
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            if not proc.alive():
                raise ServiceStartError(
                    f"{service} exited with {proc.returncode()}:\n{proc.log_tail()}"
                )
            # ready as the chart's start-up probe sees it: /readyz (the socket SERVING) is 200
            if http_probe(self.health_ports[service], "/readyz") == 200:
                assert check_health(socket, timeout=1), f"{service}: /readyz 200, socket not"
                return proc
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"{service} did not become healthy on {socket} within {timeout}s:\n"
                    f"{proc.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def plugin_flags(self, *, dynamic_mig: bool = False) -> tuple[str, ...]:
        """The kubelet plugin's flags that point it at the running services."""
        flags: list[str] = []
        if "enforcer" in self.running:
            flags += ["--enforcer-socket", str(self.enforcer_socket)]
        if "mig-manager" in self.running:
            flags += ["--mig-manager-socket", str(self.mig_manager_socket)]
        if dynamic_mig:
            flags.append("--dynamic-mig")
        return tuple(flags)

    # -- clients --------------------------------------------------------------------------
    @contextlib.contextmanager
    def enforcer(self) -> Iterator[enforcer_pb2_grpc.EnforcerStub]:
        with grpc.insecure_channel(f"unix://{self.enforcer_socket}") as channel:
            yield enforcer_pb2_grpc.EnforcerStub(channel)

    @contextlib.contextmanager
    def mig_manager(self) -> Iterator[migmanager_pb2_grpc.MigManagerStub]:
        with grpc.insecure_channel(f"unix://{self.mig_manager_socket}") as channel:
            yield migmanager_pb2_grpc.MigManagerStub(channel)

    # -- diagnostics and stop -------------------------------------------------------------
    def alive(self) -> dict[str, bool]:
        return {name: p.alive() for name, p in self.running.items()}

    def logs(self, lines: int = 60) -> str:
        """The tail of every service's log, for a failure report."""
        parts = []
        for service, proc in self.running.items():
            state = "running" if proc.alive() else f"exited {proc.returncode()}"
            parts.append(f"===== {service} ({state}, {proc.log}) =====\n{proc.log_tail(lines)}")
        return "\n".join(parts)

    def stop(self, grace: float = 10) -> list[str]:
        """SIGTERM every service's process group, SIGKILL what is left after ``grace``;
        returns the processes still alive afterwards (normally none). The MPS daemons the
        enforcer leaves running for its clients are stopped too: nothing outlives the node."""
        left = procs.stop(list(self.running.values()), grace)
        stop_mps_daemons(self.root / "mps")
        return left


@dataclass
class NodePod:
    """A GPU node whose kubelet plugin runs with the real enforcer and/or MIG manager."""

    node: GpuNode
    services: NodeServices

    @property
    def name(self) -> str:
        return self.node.name

    def logs(self, lines: int = 60) -> str:
        plugin = self.node.plugin.log
        try:
            tail = "\n".join(plugin.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            tail = "(no log)"
        return f"===== kubelet-plugin ({plugin}) =====\n{tail}\n{self.services.logs(lines)}"


def start_node_pod(
    sandbox: ControlPlane,
    gpus: list[dict[str, Any]],
    *,
    enforcer: bool = True,
    mig_manager: bool = False,
    dynamic_mig: bool = False,
    enforcer_args: tuple[str, ...] = (),
    mig_manager_args: tuple[str, ...] = (),
    plugin_args: tuple[str, ...] = (),
    nvml: dict[str, Any] | None = None,
    backend: NvmlBackend = "fake",
    nvml_config: Path | None = None,
) -> NodePod:
    """Services first (the plugin asks the enforcer for capabilities as it starts), then the
    GPU node: the node agent and the kubelet plugin pointed at the services' sockets."""
    services = NodeServices.start(
        sandbox,
        gpus,
        enforcer=enforcer,
        mig_manager=mig_manager,
        dynamic_mig=dynamic_mig,
        enforcer_args=enforcer_args,
        mig_manager_args=mig_manager_args,
        nvml=nvml,
        backend=backend,
        nvml_config=nvml_config,
    )
    try:
        node = start_gpu_node_for(
            sandbox, services, services.plugin_flags(dynamic_mig=dynamic_mig) + plugin_args
        )
    except BaseException as exc:
        logs = services.logs()
        services.stop()
        shutil.rmtree(services.root, ignore_errors=True)
        raise ServiceStartError(f"the GPU node did not start: {exc}\n{logs}") from exc
    return NodePod(node, services)


def start_gpu_node_for(
    sandbox: ControlPlane, services: NodeServices, extra: tuple[str, ...]
) -> GpuNode:
    """The node agent and the kubelet plugin (with ``extra`` flags) of a node whose fake NVML
    config the services already wrote."""
    return start_gpu_node(
        sandbox,
        [],
        extra=extra,
        name=services.name,
        root=services.root,
        nvml_config=services.nvml_config,
        backend=services.backend,
    )


def stop_node_pod(pod: NodePod, kube: RawApi, *, keep: bool = False) -> list[str]:
    """Stop the plugin and the agent, then the services (the reverse of start); the root is
    kept with ``keep`` (for a failed test). Returns the processes that outlived the stop."""
    try:
        stop_gpu_node(pod.node, kube, keep=True)
    finally:
        left = pod.services.stop()
        if keep:
            print(f"node pod {pod.name}: kept {pod.services.root}")
        else:
            shutil.rmtree(pod.services.root, ignore_errors=True)
    return left


def serve_node_pod(pod: NodePod, kube: RawApi, testsfailed: Callable[[], int]) -> Iterator[NodePod]:
    """The body of a test fixture (``yield from``): hand out ``pod``, then stop it and check the
    stop; when a test that used it failed (``testsfailed``: the session's failure count), print
    the services' logs and keep the pod's files."""
    before = testsfailed()
    yield pod
    failed = testsfailed() > before
    if failed:
        print(pod.logs())
    left = stop_node_pod(pod, kube, keep=failed)
    assert not left, f"node services outlived their stop: {left}"
