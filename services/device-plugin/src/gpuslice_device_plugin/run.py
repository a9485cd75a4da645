"""Start-up and shutdown: NVML, discovery, health, topology, servers, metrics."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from gpuslice_core import metrics as core_metrics
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_device_plugin.allocate import Topology
from gpuslice_device_plugin.config import Settings
from gpuslice_device_plugin.devices import Resource, discover, unknown_shared_resources
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.server import PluginManager
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


def run(args: argparse.Namespace, settings: Settings, wait_for_stop: Callable[[], int]) -> int:
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
        log.warning("sharing.timeSlicing names a resource this node does not have", resource=name)
    if not resources:
        log.warning("no devices found; waiting indefinitely")
        nvml.close()
        wait_for_stop()
        return 0
    metrics = Metrics()
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
    )
    log.info(
        "starting",
        resources={r.name: len(r.devices) for r in resources},
        mig_strategy=settings.mig_strategy,
        device_list_strategy=list(settings.device_list_strategies),
        device_id_strategy=settings.device_id_strategy,
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
