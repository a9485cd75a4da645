"""Start-up, the running service and graceful stop.

Order matters: the checkpoint is read and every interrupted MIG change settled (``recover``)
and the GPUs reconciled *before* the socket opens, so the kubelet plugin never sees a
half-made instance. Then the gRPC API, the layout controller (when a node name is given) and the
periodic reconciler run until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import structlog
from prometheus_client import REGISTRY

from gpuslice_core import logging as gslog
from gpuslice_core import metrics as gsmetrics
from gpuslice_core.errors import GpusliceError
from gpuslice_core.grpcserver import UnixGrpcServer, wait_for_signal
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import RawApi
from gpuslice_kube.reflector import Reflector
from gpuslice_mig_manager import __version__
from gpuslice_mig_manager.controller import WARNING, Backoff, LayoutController
from gpuslice_mig_manager.kube import (
    KubeNode,
    NodeReporter,
    NullReporter,
    watch_config_map,
    watch_node,
)
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.metrics import Metrics
from gpuslice_mig_manager.reconcile import reconcile, recover
from gpuslice_mig_manager.servicer import SERVICE_NAME, MigManagerServicer
from gpuslice_mig_manager.sources import (
    ConfigMapLayouts,
    FileLayouts,
    LayoutSource,
    parse_config_map_ref,
)
from gpuslice_mig_manager.state import open_store
from gpuslice_nvml import Nvml, nvml_from_args
from gpuslice_protos.gpuslice.v1 import migmanager_pb2_grpc as pbgrpc

log = gslog.get_logger(__name__)

CONFIG_MAP_SYNC_TIMEOUT = 30.0


class Reconciler:
    """Runs :func:`reconcile` every ``interval`` seconds and reports new drift as Events."""

    def __init__(self, manager: MigManager, reporter: NodeReporter, interval: float) -> None:
        self.manager = manager
        self.reporter = reporter
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def once(self) -> None:
        try:
            drifts = reconcile(self.manager)
        except GpusliceError as exc:
            log.error("reconcile failed", error=str(exc))
            return
        for drift in drifts:
            self.reporter.event(WARNING, "MigDrift", drift.message)

    def start(self) -> None:
        if self.interval > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        structlog.contextvars.bind_contextvars(component="mig-manager")  # a thread's own context
        while not self._stop.wait(self.interval):
            self.once()


def _fail(message: str) -> int:
    log.error("start-up failed", error=message)
    print(f"gpuslice-mig-manager: {message}", file=sys.stderr)
    return 2


def _layout_source(args: argparse.Namespace) -> LayoutSource | None:
    if args.config_file and args.config_map:
        raise ValueError("--config-file and --config-map are mutually exclusive; give one")
    if args.config_file:
        source = FileLayouts(args.config_file)
        source.load()  # a malformed file stops start-up, naming the key
        return source
    if args.config_map:
        return ConfigMapLayouts(*parse_config_map_ref(args.config_map))
    return None


def run(args: argparse.Namespace) -> int:
    gslog.configure(component="mig-manager", level=args.log_level)
    log.info("starting", version=__version__, node=args.node_name, dynamic_mig=args.dynamic_mig)
    try:
        source = _layout_source(args)
        if isinstance(source, ConfigMapLayouts) and not args.node_name:
            raise ValueError("--config-map needs --node-name (and Kubernetes access)")
        nvml = nvml_from_args(args)
    except (GpusliceError, ValueError) as exc:
        return _fail(str(exc))
    with nvml:
        return _serve(args, nvml, source)


def _serve(args: argparse.Namespace, nvml: Nvml, source: LayoutSource | None) -> int:
    store = open_store(Path(args.state_dir))
    try:
        loaded = store.load()
    except GpusliceError as exc:
        return _fail(str(exc))
    if loaded.stale_path is not None:
        log.warning("checkpoint from an earlier boot set aside", kept_at=str(loaded.stale_path))
    metrics = Metrics(REGISTRY)
    if args.metrics_addr:
        server = gsmetrics.serve(args.metrics_addr, REGISTRY)
        log.info("metrics served", addr=args.metrics_addr, port=server.server_port)
    manager = MigManager(nvml, store, dynamic=args.dynamic_mig, metrics=metrics)

    reporter: NodeReporter = NullReporter()
    raw: RawApi | None = None
    if args.node_name:
        try:
            client = new_api_client(
                args.kubeconfig, user_agent=f"gpuslice-mig-manager/{__version__}"
            )
            raw = RawApi(client)
        except GpusliceError as exc:
            return _fail(str(exc))
        reporter = KubeNode(raw, args.node_name)

    recovered = recover(manager)
    for line in recovered:
        reporter.event(WARNING, "MigRecovered", f"settled an interrupted MIG change: {line}")
    reconciler = Reconciler(manager, reporter, args.reconcile_interval)
    reconciler.once()

    grpc_server = UnixGrpcServer([Path(args.socket)], name="mig-manager")
    grpc_server.add(
        pbgrpc.add_MigManagerServicer_to_server, MigManagerServicer(manager, source), SERVICE_NAME
    )
    grpc_server.start()

    reflectors: list[Reflector] = []
    controller = LayoutController(
        manager, source, reporter, backoff=Backoff(args.retry_initial, args.retry_max)
    )
    if raw is not None and isinstance(reporter, KubeNode):
        if isinstance(source, ConfigMapLayouts):
            cm = watch_config_map(raw, source)
            cm.start()
            reflectors.append(cm)
            if not cm.synced.wait(CONFIG_MAP_SYNC_TIMEOUT):
                log.warning("layouts ConfigMap not listed yet; layouts follow when it is")
            source.on_change = controller.on_layouts_changed
        controller.start()
        node = watch_node(raw, reporter, controller.on_labels)
        node.start()
        reflectors.append(node)
    reconciler.start()
    log.info("ready", socket=args.socket)
    try:
        signum = wait_for_signal()
        log.info("stopping", signal=signum)
    finally:
        for r in reflectors:
            r.stop()
        controller.stop()
        reconciler.stop()
        grpc_server.stop()
    return 0
