"""Start-up, live reload and shutdown: NVML, discovery, health, topology, CDI spec, servers,
metrics. The main thread serves until a stop signal and runs the reloads that the watchers
(:mod:`reload`) and SIGHUP ask for, one at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from gpuslice_core import metrics as core_metrics
from gpuslice_core.errors import GpusliceError
from gpuslice_core.health import GrpcServing, threads_alive
from gpuslice_core.health import serve as serve_health
from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.allocate import Topology, container_response
from gpuslice_device_plugin.cdispec import write_spec
from gpuslice_device_plugin.config import CommandLine, ConfigError, Settings
from gpuslice_device_plugin.devices import Resource, discover, unknown_shared_resources
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.mps import EnforcerClient, ReplicaShare, setup_shares
from gpuslice_device_plugin.node import KubeNode, sharing_state
from gpuslice_device_plugin.podresources import PodResourcesClient
from gpuslice_device_plugin.reload import Control, Watchers, load_settings
from gpuslice_device_plugin.server import PluginManager
from gpuslice_device_plugin.usage import (
    ContainerCollector,
    DeviceLimits,
    Sources,
    device_limits,
)
from gpuslice_nvml import Nvml, NvmlError, open_nvml

log = get_logger(__name__)


def _init(args: CommandLine, settings: Settings) -> tuple[Nvml, list[Resource]]:
    nvml = open_nvml(args.nvml, args.fake_nvml_config, args.driver_root)
    try:
        resources = discover(nvml, settings)
    except BaseException:
        nvml.close()
        raise
    return nvml, resources


def _mps_shares(
    args: CommandLine, settings: Settings, nvml: Nvml, resources: list[Resource]
) -> dict[str, ReplicaShare]:
    """The enforcer's share of every MPS replica (idempotent; shares of another configuration
    are released)."""
    if not any(r.sharing == "mps" for r in resources):
        return {}
    if not args.enforcer_socket:  # load_settings refuses sharing.mps without it
        raise ConfigError("sharing.mps needs --enforcer-socket (GPUSLICE_ENFORCER_SOCKET)")
    visibility = {
        d.id: container_response(
            r,
            [d],
            list_strategies=settings.device_list_strategies,
            id_strategy=settings.device_id_strategy,
            pass_device_specs=settings.pass_device_specs,
        )
        for r in resources
        if r.sharing == "mps"
        for d in r.devices
    }
    memory = {g.index: g.memory_total_bytes for g in nvml.gpus()}
    client = EnforcerClient(Path(args.enforcer_socket))
    return setup_shares(client, resources, memory, Path(args.cdi_root), visibility)


def _tell_node(
    node: KubeNode | None, resources: list[Resource], shares: dict[str, ReplicaShare]
) -> None:
    if node is None:
        return
    labels, details = sharing_state(resources, shares)
    try:
        node.set_sharing(labels, details)
    except GpusliceError as exc:  # the plugin serves anyway; the log says what is missing
        log.error("cannot label the node with the sharing modes", error=str(exc))


def _container_metrics(
    args: CommandLine,
    nvml: Nvml,
    resources: list[Resource],
    shares: dict[str, ReplicaShare],
    node: KubeNode | None,
    metrics: Metrics,
) -> tuple[ContainerCollector, PodResourcesClient] | None:
    """Register the per-container collector (docs/device-plugin.md, "Per-container metrics")."""
    if not args.pod_resources_socket or not args.metrics_addr:
        return None
    client = PodResourcesClient(Path(args.pod_resources_socket), {r.name for r in resources})
    sources = Sources(client.list, nvml, pods=node.pods if node is not None else None)
    collector = ContainerCollector(
        sources,
        _device_table(nvml, resources, shares),
        on_error=lambda source: metrics.container_errors.labels(source=source).inc(),
    )
    metrics.registry.register(collector)
    return collector, client


def _device_table(
    nvml: Nvml, resources: list[Resource], shares: dict[str, ReplicaShare]
) -> dict[tuple[str, str], DeviceLimits]:
    gpu_memory = {g.index: g.memory_total_bytes for g in nvml.gpus()}
    mig_memory = {
        m.uuid: m.memory_bytes
        for r in resources
        for gpu in sorted({d.gpu_index for d in r.devices if d.gpu_instance_id is not None})
        for m in nvml.mig_devices(gpu)
    }
    return device_limits(resources, shares, gpu_memory, mig_memory)


@dataclass
class Plugin:
    """The running configuration and what a reload swaps."""

    args: CommandLine
    nvml: Nvml
    node: KubeNode | None
    settings: Settings
    resources: list[Resource]
    shares: dict[str, ReplicaShare]
    manager: PluginManager
    #: The per-container metrics' collector and pod resources client (None: metrics off).
    collector: tuple[ContainerCollector, PodResourcesClient] | None
    watchers: Watchers

    def reload(self, reasons: list[str]) -> bool:
        """Re-read, validate and apply; False when nothing changed or the config was refused
        (the running one keeps serving)."""
        labels, digest = self.watchers.snapshot()
        forced = "SIGHUP" in reasons
        if digest == self.watchers.seen and not forced:
            return False
        self.watchers.handled(digest)
        t0 = time.monotonic()
        log.info("reloading the configuration", why=reasons)
        try:
            settings = load_settings(self.args, labels if self.args.config_dir else None)
            resources = discover(self.nvml, settings)
        except (GpusliceError, NvmlError) as exc:
            self._refuse(exc)
            return False
        if settings == self.settings and resources == self.resources and not forced:
            log.info("configuration unchanged", config=settings.config_name or None)
            return False
        try:
            shares = _mps_shares(self.args, settings, self.nvml, resources)
            cdi_ids = write_spec(self.nvml, Path(self.args.cdi_root), mode=self.args.cdi_spec)
        except (GpusliceError, OSError) as exc:
            self._refuse(exc)
            self._restore_shares()
            return False
        for name in unknown_shared_resources(resources, settings):
            log.warning("a sharing entry names a resource this node does not have", resource=name)
        changed = self.manager.update(resources, settings, shares, cdi_ids)
        self.settings, self.resources, self.shares = settings, resources, shares
        if self.collector is not None:
            collector, client = self.collector
            collector.table = _device_table(self.nvml, resources, shares)
            client.resources = {r.name for r in resources}
        _tell_node(self.node, resources, shares)
        summary = {r.name: len(r.devices) for r in resources}
        log.info(
            "configuration reloaded",
            config=settings.config_name or None,
            resources=summary,
            restarted=changed,
            seconds=round(time.monotonic() - t0, 3),
        )
        if self.node is not None:
            self.node.event(
                "Normal",
                RELOADED_REASON,
                f"device plugin config {settings.config_name or self.args.config_file or '(flags)'}"
                f" applied: {', '.join(f'{k}={v}' for k, v in summary.items())}",
            )
        return True

    def _refuse(self, exc: Exception) -> None:
        log.error("config change refused; the previous config keeps serving", error=str(exc))
        if self.node is not None:
            self.node.event(
                "Warning",
                REFUSED_CONFIG_REASON,
                f"new device plugin config refused, the previous one"
                f" ({self.settings.config_name or 'unnamed'}) keeps serving: {exc}",
            )

    def _restore_shares(self) -> None:
        """An MPS change the enforcer refused half way: ask again for the running config's
        shares (idempotent), so its replicas stay enforced."""
        try:
            self.shares = _mps_shares(self.args, self.settings, self.nvml, self.resources)
        except GpusliceError as exc:
            log.error("cannot restore the MPS shares of the running config", error=str(exc))


REFUSED_CONFIG_REASON = "DevicePluginConfigRefused"
RELOADED_REASON = "DevicePluginConfigReloaded"


class Probes:
    """``/healthz`` and ``/readyz`` (gpuslice_core.health), served from the start of ``run``:
    a plugin still discovering its devices, or waiting without any, answers 503 on /readyz.

    - ``/healthz``: the kubelet watch (re-serves and re-registers the sockets) is alive.
    - ``/readyz``: what ``--probe`` checks — there is a resource and every resource's socket
      answers grpc.health.v1 SERVING — over channels kept open between probes.
    """

    def __init__(self) -> None:
        self.manager: PluginManager | None = None
        self.stopping = False
        self._serving: dict[Path, GrpcServing] = {}

    def live(self) -> list[str]:
        manager = self.manager
        if manager is None or self.stopping:
            return []
        return threads_alive(lambda: [manager.thread])()

    def ready(self) -> list[str]:
        if self.stopping:
            return ["stopping"]
        manager = self.manager
        if manager is None:
            return ["no device served (starting, or none found)"]
        sockets = [manager.socket(ep.resource) for ep in list(manager.endpoints)]
        if not sockets:
            return ["no device served"]
        problems: list[str] = []
        for socket in sockets:
            check = self._serving.get(socket)
            if check is None:
                check = self._serving[socket] = GrpcServing(socket)
            problems += check()
        return problems

    def close(self) -> None:
        for check in self._serving.values():
            check.close()


def run(
    args: CommandLine,
    settings: Settings,
    node: KubeNode | None,
    control: Control,
    labels: dict[str, str] | None = None,
) -> int:
    """The plugin until a stop signal, with its /healthz and /readyz (``--health-addr``)."""
    probes = Probes()
    server = serve_health(args.health_addr, live=probes.live, ready=probes.ready)
    try:
        return _run(args, settings, node, control, labels, probes)
    finally:
        probes.stopping = True
        probes.close()
        if server is not None:
            server.stop()


def _run(
    args: CommandLine,
    settings: Settings,
    node: KubeNode | None,
    control: Control,
    labels: dict[str, str] | None,
    probes: Probes,
) -> int:
    try:
        nvml, resources = _init(args, settings)
    except (GpusliceError, NvmlError) as exc:
        if settings.fail_on_init_error:
            log.error("initialization failed", error=str(exc))
            return 1
        log.warning(
            "initialization failed; failOnInitError is false, so waiting without devices",
            error=str(exc),
        )
        control.wait_for_stop()
        return 0
    for name in unknown_shared_resources(resources, settings):
        log.warning("a sharing entry names a resource this node does not have", resource=name)
    if not resources:
        log.warning("no devices found; waiting indefinitely")
        nvml.close()
        control.wait_for_stop()
        return 0
    try:
        shares = _mps_shares(args, settings, nvml, resources)
        cdi_ids = write_spec(nvml, Path(args.cdi_root), mode=args.cdi_spec)
    except (GpusliceError, OSError) as exc:
        log.error("cannot set up the devices' CDI specs or MPS shares", error=str(exc))
        nvml.close()
        return 1
    _tell_node(node, resources, shares)
    metrics = Metrics()
    collector = _container_metrics(args, nvml, resources, shares, node, metrics)
    http = core_metrics.serve(args.metrics_addr, metrics.registry) if args.metrics_addr else None
    health = HealthTracker(
        nvml,
        ignored_xids=args.ignored_xids,
        quiet_period=args.xid_quiet_period,
        check_interval=args.health_check_interval,
        recovery=args.health_recovery,
        on_event=lambda kind: metrics.health_events.labels(kind=kind).inc(),
    )
    gpus = sorted({g.index for g in nvml.gpus()})
    topology = Topology.from_nvml(nvml, gpus)
    manager = PluginManager(
        Path(args.device_plugins_dir),
        resources,
        settings,
        health,
        topology,
        metrics,
        shared_policy=args.shared_allocation_policy,
        shares=shares,
        cdi_ids=cdi_ids,
    )
    watchers = Watchers(
        args,
        control,
        node.raw if node is not None else None,
        labels,
        poll_interval=args.config_poll_interval,
    )
    plugin = Plugin(args, nvml, node, settings, resources, shares, manager, collector, watchers)
    log.info(
        "starting",
        resources={r.name: len(r.devices) for r in resources},
        mig_strategy=settings.mig_strategy,
        device_list_strategy=list(settings.device_list_strategies),
        device_id_strategy=settings.device_id_strategy,
        config=settings.config_name or None,
        sharing={r.name: r.sharing for r in resources},
    )
    health.start()
    try:
        manager.start()
        probes.manager = manager
        watchers.start()
        while True:
            signum, reasons = control.next()
            if signum is not None:
                log.info("stopping", signal=signum)
                break
            try:
                plugin.reload(reasons)
            except Exception:  # a bug in a reload must not take down what serves
                log.exception("reload failed; the previous config keeps serving")
    finally:
        probes.stopping = True
        watchers.stop()
        manager.stop()
        health.stop()
        if http is not None:
            http.shutdown()
        nvml.close()
    return 0
