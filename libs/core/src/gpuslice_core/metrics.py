"""Prometheus metrics: the names, naming helpers and the HTTP server every service exposes.

Every gpuslice metric is ``gpuslice_<subsystem>_<name>`` (:func:`metric_name`): the namespace
``gpuslice``, then the :class:`Subsystem` of the component that exports it, defined here once
for every service (gpuslice_core is the one library all of them use). Operations follow
``gpuslice_<subsystem>_<op>_total{result}`` and ``gpuslice_<subsystem>_<op>_duration_seconds
{result}``; ``OperationMetrics`` creates both for one operation and times a block, labelling it
``success`` or the error's type name.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

if sys.version_info >= (3, 11):  # noqa: UP036 - kubectl gpuslice runs on 3.10 (below)
    from enum import StrEnum
else:  # the services run on 3.11+; kubectl gpuslice, which imports this module, on 3.10 too
    from enum import Enum

    class StrEnum(str, Enum):  # noqa: UP042 - what enum.StrEnum is from 3.11 on
        def __str__(self) -> str:
            return str(self.value)


# No ``*_created`` series: a gauge of each counter's start time doubles every counter's series
# and nothing of ours reads it (Prometheus itself does not need it to compute rates).
disable_created_metrics()  # type: ignore[no-untyped-call]

#: The first part of every gpuslice metric name.
NAMESPACE = "gpuslice"
#: One series per process, value 1, naming what runs: ``{component, version, python_version}``.
BUILD_INFO = f"{NAMESPACE}_build_info"


class Subsystem(StrEnum):
    """The second part: who exports the series (a service), or, for the series a component
    exports about something else, what they describe."""

    CONTROLLER = "controller"
    DEVICE_PLUGIN = "device_plugin"
    ENFORCER = "enforcer"
    KUBELET_PLUGIN = "kubelet_plugin"
    MIG_MANAGER = "mig_manager"
    #: The controller's cluster view: its own state (``gpuslice_view_*``), and the GPUs and
    #: claims it tells about (``gpuslice_gpu_*``, ``gpuslice_claim_*``).
    VIEW = "view"
    GPU = "gpu"
    CLAIM = "claim"
    #: The device plugin's per-container series (``gpuslice_container_gpu_*``).
    CONTAINER = "container"


#: The subsystems each service's metrics use, by the service's directory under services/.
SERVICE_SUBSYSTEMS: dict[str, tuple[Subsystem, ...]] = {
    "controller": (Subsystem.CONTROLLER, Subsystem.VIEW, Subsystem.GPU, Subsystem.CLAIM),
    "device-plugin": (Subsystem.DEVICE_PLUGIN, Subsystem.CONTAINER),
    "enforcer": (Subsystem.ENFORCER,),
    "kubelet-plugin": (Subsystem.KUBELET_PLUGIN,),
    "mig-manager": (Subsystem.MIG_MANAGER,),
}


def standard_series(registry: CollectorRegistry, *, component: str, version: str) -> None:
    """What every service's registry carries besides its own series: ``gpuslice_build_info``
    and the process's ``process_*`` (CPU, memory, file descriptors), ``python_info`` and
    ``python_gc_*`` series. The default registry has the latter already; registering the build
    info there twice (a second app in one process) keeps the first."""
    if registry is not REGISTRY:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    try:
        info = Gauge(
            BUILD_INFO,
            "Which gpuslice component and version runs in this process (value 1).",
            ["component", "version", "python_version"],
            registry=registry,
        )
    except ValueError:  # already there
        return
    info.labels(component, version, platform.python_version()).set(1)


def metric_name(subsystem: str, name: str) -> str:
    """``gpuslice_<subsystem>_<name>``: the one way a gpuslice metric is named."""
    return f"{NAMESPACE}_{subsystem}_{name}"


# Buckets that resolve node-side operations from sub-millisecond gRPC calls to slow MIG changes.
DURATION_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)


class OperationMetrics:
    """A ``_total`` counter and a ``_duration_seconds`` histogram for one operation."""

    def __init__(
        self,
        component: str,
        op: str,
        description: str,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        base = metric_name(component, op)
        self.total = Counter(
            f"{base}_total", f"{description}, by result.", ["result"], registry=registry
        )
        self.duration = Histogram(
            f"{base}_duration_seconds",
            f"Time spent in {description.lower()}, by result.",
            ["result"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )

    @contextmanager
    def time(self) -> Iterator[None]:
        """Count and time the block; the result label is ``success`` or the error type."""
        start = time.perf_counter()
        result = "success"
        try:
            yield
        except BaseException as exc:
            result = type(exc).__name__
            raise
        finally:
            self.total.labels(result=result).inc()
            self.duration.labels(result=result).observe(time.perf_counter() - start)


def parse_addr(addr: str, flag: str = "--metrics-addr") -> tuple[str, int]:
    """Split ``host:port`` (``:9400`` means all interfaces); raise ValueError naming ``flag``
    (the health server's ``--health-addr`` takes the same form)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag} {addr!r} must be HOST:PORT, e.g. :9400 or 127.0.0.1:9400")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - a node daemon's own port


def serve(addr: str, registry: CollectorRegistry = REGISTRY) -> WSGIServer:
    """Serve ``/metrics`` on ``addr`` in a daemon thread; returns the server (``.server_port``)."""
    host, port = parse_addr(addr)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
