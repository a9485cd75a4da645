"""One simulated kubelet: ``NodeAgent(config, kubeconfig).start()`` … ``stop()``.

Start order follows the kubelet: directories, checkpoints, the Node and its Lease, the
deletion of this node's ResourceSlices left from before, the device-plugin Registration
socket, the plugin watcher on ``plugins_registry/``, then the pods bound to the node.
Several agents (nodes) can live in one process; each has its own root dir and API client.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from e2e.sandbox.nodeagent.config import NodeConfig
from e2e.sandbox.nodeagent.devicemanager import VERSION, DeviceManager, is_extended_resource_name
from e2e.sandbox.nodeagent.dra_manager import DraManager, open_store
from e2e.sandbox.nodeagent.dra_plugins import DraPlugins
from e2e.sandbox.nodeagent.health import Key, NodeHealth
from e2e.sandbox.nodeagent.kubeapi import KubeletApi
from e2e.sandbox.nodeagent.logserver import LogServer
from e2e.sandbox.nodeagent.node import NodeReporter
from e2e.sandbox.nodeagent.podresources import PodResourcesServer, Sources
from e2e.sandbox.nodeagent.pods import PodManager
from e2e.sandbox.nodeagent.registration import PluginWatcher, RegistrationError
from e2e.sandbox.nodeagent.runtime import Runtime
from gpuslice_core.logging import get_logger
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import RawApi
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as dp_pb2

log = get_logger(__name__)

STARTUP_WIPE_DEADLINE = 300.0


class NodeAgent:
    def __init__(self, config: NodeConfig, kubeconfig: str | Path) -> None:
        self.config = config
        self.raw = RawApi(
            new_api_client(kubeconfig, user_agent=f"gpuslice-nodeagent/{config.name}")
        )
        self.api = KubeletApi(self.raw, config.name)
        self.runtime = Runtime(config.pods_dir, config.name)
        self.plugins = DraPlugins(config.root, config.timings, self._wipe_driver, config.name)
        self.health: NodeHealth | None = None
        self._started = False
        self._lock = threading.Lock()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> NodeAgent:
        cfg = self.config
        cfg.make_dirs()
        version = cfg.kubelet_version or self._server_version()
        self.devices = DeviceManager(cfg, self._devices_changed)
        self.dra = DraManager(self.api, self.plugins, open_store(str(cfg.dra_checkpoint)))
        if cfg.resource_health:
            self.health = NodeHealth(
                node=cfg.name,
                retry=cfg.timings.health_retry,
                default_timeout=cfg.timings.health_timeout,
                on_change=self._health_changed,
            )
        self.plugins.health = self.health
        self.logs: LogServer | None = None
        port = cfg.kubelet_port
        if cfg.serve_logs:
            self.logs = LogServer(self._locate_log, cfg.root / "pki", cfg.name)
            self.logs.start()
            port = self.logs.port
        self.node = NodeReporter(self.api, cfg, self.devices.resources, version, port)
        self.node.start()
        self._wipe_all_slices()
        self.devices.start()
        self.watcher = PluginWatcher(
            cfg.registry_dir,
            {"DRAPlugin": self.plugins, "DevicePlugin": _DevicePluginHandler(self)},
            cfg.timings,
            cfg.name,
        )
        self.watcher.start()
        self.pods = PodManager(
            cfg, self.raw, self.api, self.dra, self.devices, self.runtime, self.health
        )
        self.pods.start()
        self.pod_resources = PodResourcesServer(
            cfg.pod_resources_dir,
            Sources(
                active_pods=self.pods.active_pods,
                find_pod=self.pods.find_pod,
                claim_devices=self.dra.driver_devices,
                container_devices=self.devices.container_devices,
                allocatable=self.devices.allocatable,
            ),
            cfg.name,
        )
        self.pod_resources.start()
        self._started = True
        log.info("node agent started", node=cfg.name, root=str(cfg.root))
        return self

    def stop(self, *, kill_containers: bool = True) -> None:
        """Stop like a kubelet that dies: Lease and status stop, nothing is cleaned up in the
        API. ``kill_containers=False`` leaves the containers running for a restarted agent."""
        if not self._started:
            return
        self._started = False
        self.pod_resources.stop()
        self.pods.stop(kill_containers=kill_containers)
        self.watcher.stop()
        self.devices.stop()
        self.plugins.stop()
        self.node.stop()
        if self.logs is not None:
            self.logs.stop()
        log.info("node agent stopped", node=self.config.name)

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- helpers for tests -------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    def pod_log(self, pod_uid: str, container: str, previous: bool = False) -> str:
        """What a container printed (stdout and stderr), '' before it wrote anything."""
        path = self.runtime.log_path(pod_uid, container, previous)
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def container_edits(self, pod_uid: str, container: str) -> dict[str, object]:
        """The CDI/device-plugin edits the runtime applied (mounts and device nodes included)."""
        path = self.config.pods_dir / pod_uid / ".containers" / container / "edits.json"
        result: dict[str, object] = json.loads(path.read_text())
        return result

    def container_cdi_devices(self, pod_uid: str, container: str) -> list[str]:
        """The CDI device ids the runtime resolved the container's edits from (deduplicated,
        in the kubelet's order: what containerd logs as the container's CDI devices)."""
        path = self.config.pods_dir / pod_uid / ".containers" / container / "cdi-devices.json"
        ids: list[str] = json.loads(path.read_text())
        return ids

    def registered_drivers(self) -> list[str]:
        return self.plugins.drivers()

    @property
    def pod_resources_socket(self) -> Path:
        """``<root>/pod-resources/kubelet.sock`` (``v1.PodResourcesLister``)."""
        return self.config.pod_resources_dir / "kubelet.sock"

    def device_plugin_resources(self) -> list[str]:
        return sorted(self.devices.endpoints)

    # ---- internals ---------------------------------------------------------------------------
    def _locate_log(
        self, namespace: str, pod: str, container: str, previous: bool
    ) -> tuple[Path, Callable[[], bool]] | None:
        obj = self.pods.reflector.cache.get(f"{namespace}/{pod}")
        if obj is None:
            return None
        uid = obj["metadata"]["uid"]
        path = self.runtime.log_path(uid, container, previous)
        if not path.exists() and not previous:
            return None

        def running() -> bool:
            worker = self.pods.worker(uid)
            return not previous and worker is not None and worker.containers.running(container)

        return path, running

    def _server_version(self) -> str:
        info = self.raw.get("/version")
        return str(info.get("gitVersion") or "v0.0.0")

    def _devices_changed(self) -> None:
        node = getattr(self, "node", None)
        if node is not None:
            node.poke()

    def _health_changed(self, devices: list[Key]) -> None:
        pods = getattr(self, "pods", None)
        if pods is not None:
            pods.poke(self.dra.pods_using(devices))

    def device_health(self, driver: str, pool: str, device: str) -> tuple[str, str]:
        """(health, message) of a device as this node sees it now (Unknown without a stream)."""
        if self.health is None:
            return "Unknown", ""
        return self.health.cache.get(driver, pool, device)

    def _wipe_driver(self, driver: str) -> None:
        self.api.delete_slices(driver)

    def _wipe_all_slices(self) -> None:
        """At start the kubelet deletes every ResourceSlice of its node (retried up to 5 min)."""
        deadline = time.monotonic() + STARTUP_WIPE_DEADLINE
        delay = 1.0
        while True:
            try:
                self.api.delete_slices()
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("startup ResourceSlice wipe failed; retrying", error=str(exc))
                time.sleep(delay)
                delay = min(delay * 2, 30.0)


class _DevicePluginHandler:
    """Device plugins found through ``plugins_registry/`` (type DevicePlugin): the name is the
    resource, the endpoint the plugin's socket; registered like a ``Register`` call."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    def validate_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        if VERSION not in versions:
            raise RegistrationError(f"device plugin {name} supports none of [{VERSION!r}]")
        if not is_extended_resource_name(name):
            raise RegistrationError(f"the ResourceName {name!r} is invalid")

    def register_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        # an absolute endpoint stays absolute when joined to device-plugins/
        self.agent.devices.register(
            dp_pb2.RegisterRequest(version=VERSION, endpoint=endpoint, resource_name=name)
        )

    def deregister_plugin(self, name: str, endpoint: str) -> None:
        log.info("device plugin registration socket removed", resource=name)
