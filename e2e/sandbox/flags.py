"""What the pinned binaries support, read from their own --help (an unknown feature gate or
controller name makes a component exit, so nothing is passed that a release lacks)."""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

# DRA features gpuslice uses (docs/sandbox.md, "API versions and feature gates"). Each is set
# to true only where the binary lists the gate in --help: GA gates are hidden from --help and
# already on (setting a locked gate to false is fatal, setting it to true only warns), gates a
# release lacks are fatal.
DRA_GATES = (
    "DynamicResourceAllocation",  # the API itself (GA 1.34, locked on since 1.35)
    "DRAConsumableCapacity",  # allowMultipleAllocations, capacity request policies
    "DRAPartitionableDevices",  # sharedCounters / consumesCounters (MIG)
    "DRADeviceTaints",  # taints in slices, tolerations, eviction controller
    "DRADeviceTaintRules",  # the DeviceTaintRule kind (1.35+)
    "DRAExtendedResource",  # DeviceClass extendedResourceName (nvidia.com/gpu mapping)
    "DRAAdminAccess",  # adminAccess requests
    "DRAResourceClaimDeviceStatus",  # claim status.devices
    "DRAPrioritizedList",  # firstAvailable
    "ResourceHealthStatus",  # device health in pod status
)

_GATE_RE = re.compile(
    r"(?:\bkube:)?\b([A-Z][A-Za-z0-9]+)=true\|false "
    r"\((ALPHA|BETA|GA|DEPRECATED) - default=(true|false)\)"
)


@dataclass(frozen=True)
class Gate:
    name: str
    stage: str  # ALPHA | BETA | GA | DEPRECATED
    default: bool


def _help(binary: Path) -> str:
    out = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    return out.stdout + out.stderr


@functools.cache
def listed_gates(binary: Path) -> dict[str, Gate]:
    """The feature gates `binary --help` lists (alpha, beta and deprecated ones)."""
    return {
        m.group(1): Gate(m.group(1), m.group(2), m.group(3) == "true")
        for m in _GATE_RE.finditer(_help(binary))
    }


def dra_gates(binary: Path, wanted: tuple[str, ...] = DRA_GATES) -> dict[str, bool]:
    """The `--feature-gates` entries to pass to `binary`: every wanted gate it lists, on."""
    listed = listed_gates(binary)
    return {name: True for name in wanted if name in listed}


def gate_flag(gates: dict[str, bool]) -> list[str]:
    if not gates:
        return []
    value = ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(gates.items()))
    return [f"--feature-gates={value}"]


def runtime_config(minor: int) -> str:
    """resource.k8s.io/v1 (GA 1.34) plus v1beta2 and v1beta1 served (off by default since beta
    APIs are off by default). DeviceTaintRule lives in v1alpha3 on 1.34-1.35 (v1beta2 on 1.36,
    v1 on 1.37), so v1alpha3 is served up to 1.36 for the components' DeviceTaintRule informers."""
    versions = ["v1", "v1beta2", "v1beta1"]
    if minor <= 36:
        versions.append("v1alpha3")
    return ",".join(f"resource.k8s.io/{v}=true" for v in versions)


# kube-controller-manager: what a DRA sandbox without kubelets needs (the rest of `*` is
# storage, networking, cloud and certificate machinery that only costs CPU here).
KCM_CONTROLLERS = (
    "resourceclaim-controller",
    "device-taint-eviction-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
    "replicaset-controller",
    "deployment-controller",
    "daemonset-controller",
    "job-controller",
    # EndpointSlices of Services: the API server's service resolver (--enable-aggregator-routing)
    # reads them to call a webhook Service at its pods' IPs, as there is no kube-proxy.
    "endpointslice-controller",
    # Endpoints of Services, as every cluster has them: Prometheus's `endpoints` discovery
    # role (what Prometheus Operator writes for a ServiceMonitor) reads them.
    "endpoints-controller",
)


@functools.cache
def known_controllers(binary: Path) -> frozenset[str]:
    """Controller names from `kube-controller-manager --help` ("All controllers: ...")."""
    text = " ".join(_help(binary).split())
    m = re.search(r"All controllers: (.*?)(?:Disabled-by-default controllers:|$)", text)
    if m is None:
        return frozenset()
    return frozenset(n.strip(" .") for n in m.group(1).split(",") if n.strip(" ."))


def kcm_controllers(binary: Path, wanted: tuple[str, ...] = KCM_CONTROLLERS) -> str:
    known = known_controllers(binary)
    if not known:  # help format not recognised: fall back to the defaults
        return "*"
    return ",".join(n for n in wanted if n in known)
