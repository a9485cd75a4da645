"""Start-up and shutdown: NVML, discovery, health, topology, servers, metrics."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from gpuslice_core import metrics as core_metrics
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.allocate import Topology, container_response
from gpuslice_device_plugin.config import Settings
from gpuslice_device_plugin.devices import Resource, discover, unknown_shared_resources
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.mps import EnforcerClient, ReplicaShare, setup_shares
from gpuslice_device_plugin.node import KubeNode, sharing_state
from gpuslice_device_plugin.podresources import PodResourcesClient
from gpuslice_device_plugin.server import PluginManager
from gpuslice_device_plugin.usage import ContainerCollector, Sources, device_limits
from gpuslice_nvml import Nvml, NvmlError, nvml_from_args

log = get_logger(__name__)


def _init(args: argparse.Namespace, settings: Settings) -> tuple[Nvml, list[Resource]]:
    nvml = nvml_from_args(args)
    try:
        resources = discover(nvml, settings)
    except BaseException:
        nvml.close()
        raise
    return nvml, resources


def _mps_shares(
    args: argparse.Namespace, settings: Settings, nvml: Nvml, resources: list[Resource]
) -> dict[str, ReplicaShare]:
    if not any(r.sharing == "mps" for r in resources):
        return {}
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
    args: argparse.Namespace,
    nvml: Nvml,
    resources: list[Resource],
    shares: dict[str, ReplicaShare],
    node: KubeNode | None,
    metrics: Metrics,
) -> None:
    """Register the per-container collector (docs/device-plugin.md, "Per-container metrics")."""
    if not args.pod_resources_socket or not args.metrics_addr:
        return
    gpu_memory = {g.index: g.memory_total_bytes for g in nvml.gpus()}
    mig_memory = {
        m.uuid: m.memory_bytes
        for r in resources
        for gpu in sorted({d.gpu_index for d in r.devices if d.gpu_instance_id is not None})
        for m in nvml.mig_devices(gpu)
    }
    table = device_limits(resources, shares, gpu_memory, mig_memory)
    client = PodResourcesClient(Path(args.pod_resources_socket), {r.name for r in resources})
    sources = Sources(client.list, nvml, pods=node.pods if node is not None else None)
    name = node.name if node is not None else (args.node_name or "")
    metrics.registry.register(
        ContainerCollector(
            name,
            sources,
            table,
            on_error=lambda source: metrics.container_errors.labels(source=source).inc(),
        )
    )


def run(
    args: argparse.Namespace,
    settings: Settings,
    node: KubeNode | None,
    wait_for_stop: Callable[[], int],
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
        wait_for_stop()
        return 0
    for name in unknown_shared_resources(resources, settings):
        log.warning("a sharing entry names a resource this node does not have", resource=name)
    if not resources:
        log.warning("no devices found; waiting indefinitely")
        nvml.close()
        wait_for_stop()
        return 0
    try:
        shares = _mps_shares(args, settings, nvml, resources)
    except GpusliceError as exc:
        log.error("sharing.mps: the replicas cannot be enforced", error=str(exc))
        nvml.close()
        return 1
    _tell_node(node, resources, shares)
    metrics = Metrics()
    _container_metrics(args, nvml, resources, shares, node, metrics)
    http = core_metrics.serve(args.metrics_addr, metrics.registry) if args.metrics_addr else None
    health = HealthTracker(
        nvml,
        ignored_xids=args.ignored_xids,
        quiet_period=args.xid_quiet_period,
        check_interval=args.health_check_interval,
        recovery=args.health_recovery,
        on_event=lambda kind: metrics.health_events.labels(kind=kind).inc(),
    )
    gpus = sorted({d.gpu_index for r in resources for d in r.devices})
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
    )
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
        signum = wait_for_stop()
        log.info("stopping", signal=signum)
    finally:
        manager.stop()
        health.stop()
        if http is not None:
            http.shutdown()
        nvml.close()
    return 0
