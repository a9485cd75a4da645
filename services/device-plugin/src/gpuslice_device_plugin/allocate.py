"""Allocate responses and preferred allocations, free of gRPC.

Allocate (per container): every ID must be one of the resource's devices and Healthy, else the
call fails naming the IDs; replicas with ``failRequestsGreaterThanOne`` refuse more than one.
The response carries, per ``deviceListStrategy``:

- ``envvar``: ``NVIDIA_VISIBLE_DEVICES=<uuids or indexes, deduplicated>``;
- ``volume-mounts``: ``NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices`` and one
  ``/dev/null`` mount per device under that directory;
- ``cdi-annotations``: annotation ``cdi.k8s.io/gpuslice-device-plugin_<resource>`` whose value
  lists the CDI names of the devices: those of the plugin's own spec
  (``k8s.gpu.gpuslice.dev/device-plugin-gpu=node-<UUID>``, :mod:`cdispec`) plus
  ``NVIDIA_VISIBLE_DEVICES`` as env, or with ``--cdi-spec=toolkit`` the NVIDIA Container
  Toolkit's ``nvidia.com/gpu=<uuid|index>``;
- ``cdi-cri``: the same names as ``cdi_devices``;
- ``passDeviceSpecs``: device nodes ``/dev/nvidiactl``, ``/dev/nvidia-uvm``,
  ``/dev/nvidia-uvm-tools`` and ``/dev/nvidia<minor>`` per GPU.

GetPreferredAllocation: for whole GPUs the best set of the requested size that contains the
must-include devices, by the sum of pair scores from a topology matrix computed once
(:class:`Topology`); for replicas (and MIG devices) ``distributed`` takes replicas from the GPUs
with the fewest replicas in use, ``packed`` from those with the most.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

from gpuslice_core.errors import FailedPreconditionError, InvalidArgumentError
from gpuslice_core.untrusted import listed
from gpuslice_device_plugin.devices import Device, Resource
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_nvml import Nvml, NvmlError, TopologyLevel
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as pb

CDI_KIND = "nvidia.com/gpu"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
VOLUME_MOUNT_DIR = "/var/run/nvidia-container-devices"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
#: Pair scores as go-gpuallocator gives them: each NVLink 100, then the PCIe ancestor.
LEVEL_SCORE = {
    TopologyLevel.INTERNAL: 60,
    TopologyLevel.SINGLE: 50,
    TopologyLevel.MULTIPLE: 40,
    TopologyLevel.HOSTBRIDGE: 30,
    TopologyLevel.NODE: 20,
    TopologyLevel.SYSTEM: 10,
}
NVLINK_SCORE = 100
#: Above this many candidate sets the search turns greedy (C(16,8) = 12870 stays exhaustive).
MAX_EXHAUSTIVE = 20000


class UnknownDeviceError(InvalidArgumentError):
    """Device IDs that are not devices of this resource."""


class UnhealthyDeviceError(FailedPreconditionError):
    """Device IDs that are Unhealthy."""


class Topology:
    """Pair scores between GPUs, read from NVML once (at start)."""

    def __init__(self, scores: dict[tuple[int, int], int]) -> None:
        self.scores = scores

    @classmethod
    def from_nvml(cls, nvml: Nvml, gpus: Sequence[int]) -> Topology:
        scores: dict[tuple[int, int], int] = {}
        for a, b in itertools.combinations(sorted(set(gpus)), 2):
            try:
                link = nvml.topology(a, b)
            except NvmlError:
                continue  # unknown: scores 0, like a missing link
            score = link.nvlinks * NVLINK_SCORE + LEVEL_SCORE.get(link.level, 0)
            scores[(a, b)] = scores[(b, a)] = score
        return cls(scores)

    def pair(self, a: int, b: int) -> int:
        return self.scores.get((a, b), 0)

    def set_score(self, gpus: Sequence[int]) -> int:
        return sum(self.pair(a, b) for a, b in itertools.combinations(gpus, 2))


def check_request(resource: Resource, ids: Sequence[str], health: HealthTracker) -> list[Device]:
    """The devices behind ``ids``; raises naming unknown or unhealthy IDs (the first few and
    how many: the message goes into a gRPC trailer, which a default client takes up to 8 KB
    of)."""
    by_id = {d.id: d for d in resource.devices}
    if not ids:
        raise InvalidArgumentError(f"{resource.name}: the request names no devices")
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise UnknownDeviceError(f"{resource.name}: unknown device IDs: {listed(unknown)}")
    devices = [by_id[i] for i in ids]
    sick = [f"{d.id} ({'; '.join(health.reasons(d))})" for d in devices if not health.healthy(d)]
    if sick:
        raise UnhealthyDeviceError(
            f"{resource.name}: unhealthy device IDs: {listed(sick, width=200)}"
        )
    if resource.replicas > 1 and resource.fail_requests_greater_than_one and len(ids) > 1:
        raise InvalidArgumentError(
            f"{resource.name}: request for {len(ids)} shared devices refused:"
            " failRequestsGreaterThanOne allows 1 per container"
        )
    return devices


def container_response(
    resource: Resource,
    devices: Sequence[Device],
    *,
    list_strategies: Sequence[str],
    id_strategy: str,
    pass_device_specs: bool,
    cdi_ids: dict[str, list[str]] | None = None,
) -> pb.ContainerAllocateResponse:
    """``cdi_ids``: GPU/MIG UUID → the CDI ids of the plugin's own spec (None: the toolkit's
    names). With our spec the CDI strategies also set ``NVIDIA_VISIBLE_DEVICES``: the spec's
    devices cannot (a runtime keeps one value per variable name, so the last device of a
    two-GPU container would win), the response names all of the container's devices."""
    names = list(dict.fromkeys(d.uuid if id_strategy == "uuid" else d.index for d in devices))
    cdi_strategy = any(s.startswith("cdi-") for s in list_strategies)
    out = pb.ContainerAllocateResponse()
    if "envvar" in list_strategies or (cdi_strategy and cdi_ids is not None):
        out.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(names)
    if "volume-mounts" in list_strategies:
        out.envs["NVIDIA_VISIBLE_DEVICES"] = VOLUME_MOUNT_DIR
        out.mounts.extend(
            pb.Mount(host_path="/dev/null", container_path=f"{VOLUME_MOUNT_DIR}/{n}") for n in names
        )
    if cdi_ids is None:
        cdi_names = [f"{CDI_KIND}={n}" for n in names]
    else:
        uuids = dict.fromkeys(d.uuid for d in devices)
        cdi_names = list(dict.fromkeys(i for u in uuids for i in cdi_ids[u]))
    if "cdi-annotations" in list_strategies:
        key = f"{CDI_ANNOTATION_PREFIX}gpuslice-device-plugin_{resource.name.split('/', 1)[1]}"
        out.annotations[key] = ",".join(cdi_names)
    if "cdi-cri" in list_strategies:
        out.cdi_devices.extend(pb.CDIDevice(name=n) for n in cdi_names)
    if pass_device_specs:
        paths = [*CONTROL_DEVICES, *(f"/dev/nvidia{m}" for m in sorted({d.minor for d in devices}))]
        out.devices.extend(
            pb.DeviceSpec(container_path=p, host_path=p, permissions="rw") for p in paths
        )
    return out


def mps_response(
    response: pb.ContainerAllocateResponse, cdi_id: str
) -> pb.ContainerAllocateResponse:
    """An MPS replica: everything that makes the GPU visible moved into the replica's CDI
    device (next to the enforcer's edits), so a container never gets the GPU without its
    limits; annotations and the toolkit's CDI names stay (they too need CDI)."""
    out = pb.ContainerAllocateResponse()
    out.annotations.update(response.annotations)
    out.cdi_devices.append(pb.CDIDevice(name=cdi_id))
    out.cdi_devices.extend(response.cdi_devices)
    return out


def preferred(
    resource: Resource,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    topology: Topology,
    *,
    policy: str = "distributed",
) -> list[str]:
    """The preferred IDs: ``must_include`` first, ``size`` in all (fewer if not available)."""
    by_id = {d.id: d for d in resource.devices}
    required = [i for i in dict.fromkeys(must_include) if i in by_id]
    pool = [i for i in dict.fromkeys(available) if i in by_id and i not in required]
    if size <= len(required):
        return required[:size] if size > 0 else required
    need = size - len(required)
    if resource.replicas > 1 or not resource.whole_gpus:
        return required + _spread(resource, available, required, pool, need, policy)
    return required + _best_set(by_id, required, pool, need, topology)


def _best_set(
    by_id: dict[str, Device], required: list[str], pool: list[str], need: int, topo: Topology
) -> list[str]:
    if need >= len(pool):
        return pool
    gpu = {i: by_id[i].gpu_index for i in [*required, *pool]}
    base = [gpu[i] for i in required]

    def score(extra: Sequence[str]) -> int:
        return topo.set_score([*base, *(gpu[i] for i in extra)])

    count = math.comb(len(pool), need)
    if count <= MAX_EXHAUSTIVE:
        best = max(itertools.combinations(pool, need), key=score)  # first best: lowest IDs
        return list(best)
    chosen: list[str] = []
    rest = list(pool)
    while len(chosen) < need:
        pick = max(rest, key=lambda i: score([*chosen, i]))
        chosen.append(pick)
        rest.remove(pick)
    return chosen


def _spread(
    resource: Resource,
    available: Sequence[str],
    required: list[str],
    pool: list[str],
    need: int,
    policy: str,
) -> list[str]:
    """Replicas: fewest (distributed) or most (packed) replicas in use per GPU first."""
    by_id = {d.id: d for d in resource.devices}
    free = Counter(by_id[i].uuid for i in available if i in by_id)
    total = Counter(d.uuid for d in resource.devices)
    used = {u: total[u] - free[u] for u in total}
    picked: Counter[str] = Counter(by_id[i].uuid for i in required)
    chosen: list[str] = []
    rest = list(pool)
    sign = 1 if policy == "distributed" else -1
    while len(chosen) < need and rest:

        def key(i: str) -> tuple[int, int, str]:
            u = by_id[i].uuid
            return (sign * (used[u] + picked[u]), by_id[i].gpu_index, i)

        pick = min(rest, key=key)
        chosen.append(pick)
        picked[by_id[pick].uuid] += 1
        rest.remove(pick)
    return chosen
