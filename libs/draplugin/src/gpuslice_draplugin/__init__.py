"""The kubelet-facing half of a DRA driver, as one library (the Python counterpart of
k8s.io/dynamic-resource-allocation/kubeletplugin): registration, DRA v1 and v1beta1, the health
stream, the claim cache, resource.k8s.io version detection and ResourceSlice publishing. The
driver implements ``Plugin`` (prepare, unprepare) and, if it has one, a ``HealthSource``.

    helper = gpuslice_draplugin.start(plugin, driver="gpu.example.com", node=node, raw=raw)
    helper.publish({node: Pool(devices=[{"name": "gpu-0", "attributes": {...}}])})
    ...
    helper.stop()

docs/draplugin.md is the guide.
"""

from gpuslice_draplugin.claimcache import ClaimCache
from gpuslice_draplugin.helper import Helper, start
from gpuslice_draplugin.kubeapi import ResourceApi, ServerInfo, detect
from gpuslice_draplugin.metrics import HelperMetrics
from gpuslice_draplugin.plugin import (
    ClaimRef,
    DeviceHealth,
    HealthSource,
    Plugin,
    Pool,
    PreparedDevice,
    PrepareResult,
)
from gpuslice_draplugin.server import Prober, Sockets, probe

__all__ = [
    "ClaimCache",
    "ClaimRef",
    "DeviceHealth",
    "HealthSource",
    "Helper",
    "HelperMetrics",
    "Plugin",
    "Pool",
    "PrepareResult",
    "PreparedDevice",
    "Prober",
    "ResourceApi",
    "ServerInfo",
    "Sockets",
    "detect",
    "probe",
    "start",
]
