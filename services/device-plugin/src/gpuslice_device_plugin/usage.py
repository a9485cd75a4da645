"""Per-container GPU metrics, computed at scrape time from the kubelet and NVML.

Every scrape (nothing is kept between scrapes but the plugin's own device table):

1. ``List`` on the kubelet's pod resources API says which container holds which of our device
   IDs; an ID maps back through the device table to its GPU or MIG device (a replica
   ``<id>::<n>`` to its GPU). A container's replicas of one GPU are one series.
2. NVML's running processes (used memory) of every GPU that some container holds, and the
   per-process SM utilization of the last :data:`SM_WINDOW_US` (not in MIG mode: NVML has none).
3. Each process is attributed to a holder of the device it runs on: when one container holds
   that device, every process on it is that container's; when several do (time-slicing or MPS
   replicas of one GPU), the process's ``/proc/<pid>/cgroup`` must name the pod UID (``pod<uid>``
   or systemd's ``pod<uid_with_underscores>``) of exactly one holder — the UIDs and container
   IDs come from one list of this node's pods at the API server — and, when that pod holds the
   GPU from several containers, the container ID too. A process that matches no single holder
   is counted in ``gpuslice_device_plugin_unattributed_processes``, never guessed.
4. Limits: an MPS replica's share (cores, memory) as the enforcer granted it, enforced; a MIG
   device's memory and 100 % of its SMs, enforced by the hardware; a whole GPU or a time-slicing
   replica the GPU's memory and 100 %, not enforced (``..._limit_enforced`` 0).

Labels (docs/metrics.md): the workload as ``namespace``, ``pod``, ``container`` (the kubelet's
and kube-state-metrics' names; the PodMonitor honours them), the device as dcgm-exporter labels
it (``gpu``, ``UUID``, and for MIG ``GPU_I_PROFILE``, ``GPU_I_ID``) and the ``resource``. The
node is not written here: the monitor adds it as ``Hostname`` from the pod's node. SM figures are
ratios, 0..1 of the GPU's SMs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuslice_core.cgroupnames import names_pod
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_core.metrics import Subsystem, metric_name
from gpuslice_device_plugin.devices import Device, Resource
from gpuslice_device_plugin.mps import ReplicaShare
from gpuslice_device_plugin.podresources import Holder
from gpuslice_kube.raw import Obj
from gpuslice_nvml import Nvml, NvmlError, ProcessInfo

log = get_logger(__name__)

#: Per-process SM samples newer than this are read at a scrape (5 s).
SM_WINDOW_US = 5_000_000
#: A device as dcgm-exporter labels it: the GPU's index and UUID (a MIG device's parent GPU's),
#: and a MIG device's GPU instance profile and id (empty, so absent, on a whole GPU).
DEVICE_LABELS = ["gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID"]
#: The workload as kube-state-metrics and the kubelet name it, the device, the resource.
LABELS = ["namespace", "pod", "container", *DEVICE_LABELS, "resource"]
DeviceLabels = tuple[str, str, str, str]
PROC = Path("/proc")


@dataclass(frozen=True)
class DeviceLimits:
    """The device behind a device ID: where it is and what a container may use of it."""

    uuid: str
    index: str
    gpu_index: int
    memory_bytes: int
    sm_percent: int
    enforced: bool
    mig: bool
    gpu_uuid: str = ""
    profile: str = ""
    gpu_instance_id: int | None = None

    @property
    def labels(self) -> DeviceLabels:
        """``DEVICE_LABELS``"""
        gi = "" if self.gpu_instance_id is None else str(self.gpu_instance_id)
        return (str(self.gpu_index), self.gpu_uuid or self.uuid, self.profile, gi)


@dataclass(frozen=True)
class PodIds:
    uid: str
    #: Container name → container ID without the runtime prefix (``containerd://``).
    containers: dict[str, str]


@dataclass
class Usage:
    """One container's use of one GPU or MIG device (all its replicas of it together)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device: DeviceLimits
    memory_limit: int = 0
    sm_limit: int = 0
    memory_used: int = 0
    sm_used: int = 0
    pids: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.namespace, self.pod, self.container, self.resource, self.device.uuid)


def device_limits(
    resources: list[Resource],
    shares: dict[str, ReplicaShare],
    gpu_memory: dict[int, int],
    mig_memory: dict[str, int],
) -> dict[tuple[str, str], DeviceLimits]:
    """(resource, device ID) → the device and one allocation's limits."""
    table: dict[tuple[str, str], DeviceLimits] = {}
    for r in resources:
        for d in r.devices:
            table[(r.name, d.id)] = _limits(d, shares.get(d.id), gpu_memory, mig_memory)
    return table


def _limits(
    d: Device, share: ReplicaShare | None, gpu_memory: dict[int, int], mig_memory: dict[str, int]
) -> DeviceLimits:
    mig = d.gpu_instance_id is not None
    if share is not None:
        memory, sm, enforced = share.memory_bytes, share.cores, True
    elif mig:
        memory, sm, enforced = mig_memory.get(d.uuid, 0), 100, True
    else:
        memory, sm, enforced = gpu_memory.get(d.gpu_index, 0), 100, False
    return DeviceLimits(
        d.uuid,
        d.index,
        d.gpu_index,
        memory,
        sm,
        enforced,
        mig,
        d.gpu_uuid,
        d.profile,
        d.gpu_instance_id,
    )


def usages(
    holders: list[Holder], table: dict[tuple[str, str], DeviceLimits]
) -> dict[tuple[str, str, str, str, str], Usage]:
    """One Usage per (container, device); replicas of one device add their limits (an MPS
    share's cores and memory; a time-slicing replica's limit is the whole device already)."""
    out: dict[tuple[str, str, str, str, str], Usage] = {}
    for h in holders:
        limits = table.get((h.resource, h.device_id))
        if limits is None:
            continue  # an ID of another plugin under the same name, or of an earlier config
        u = Usage(h.namespace, h.pod, h.container, h.resource, limits)
        u = out.setdefault(u.key, u)
        if limits.enforced and not limits.mig:
            u.memory_limit += limits.memory_bytes
            u.sm_limit = min(100, u.sm_limit + limits.sm_percent)
        else:
            u.memory_limit, u.sm_limit = limits.memory_bytes, limits.sm_percent
    return out


def proc_cgroups(pid: int, proc: Path = PROC) -> list[str] | None:
    """The cgroup paths of ``pid`` (every hierarchy), or None when it cannot be read."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    return [line.split(":", 2)[2] for line in lines if line.count(":") >= 2]


def pod_ids(pods: list[Obj]) -> dict[tuple[str, str], PodIds]:
    """(namespace, name) → UID and container IDs, from listed Pod objects."""
    out: dict[tuple[str, str], PodIds] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        containers: dict[str, str] = {}
        for key in ("initContainerStatuses", "containerStatuses"):
            for cs in status.get(key) or []:
                cid = str(cs.get("containerID") or "").partition("://")[2]
                if cid:
                    containers[str(cs.get("name"))] = cid
        out[(str(meta.get("namespace")), str(meta.get("name")))] = PodIds(
            str(meta.get("uid") or ""), containers
        )
    return out


def _container_in(cid: str, uid: str, paths: list[str]) -> bool:
    """The container ID, or its 12-character short form (runc's cgroup names), in a path with
    the pod's UID taken out (a short form must not match inside the UID)."""
    if len(cid) < 12:
        return False
    rest = [p.replace(uid, "").replace(uid.replace("-", "_"), "") for p in paths]
    return any(cid in p or cid[:12] in p for p in rest)


def attribute(
    process: ProcessInfo,
    candidates: list[Usage],
    cgroups: Callable[[int], list[str] | None],
    pods: Callable[[], dict[tuple[str, str], PodIds]],
) -> Usage | None:
    """The one holder a process belongs to, or None when that cannot be told."""
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        return None
    paths = cgroups(process.pid)
    if not paths:
        return None
    index = pods()
    matched = []
    for u in candidates:
        ids = index.get((u.namespace, u.pod))
        if ids and names_pod(paths, ids.uid):
            matched.append(u)
    if len(matched) > 1:  # one pod holds the device from several containers
        kept = []
        for u in matched:
            ids = index[(u.namespace, u.pod)]
            if _container_in(ids.containers.get(u.container, ""), ids.uid, paths):
                kept.append(u)
        matched = kept
    return matched[0] if len(matched) == 1 else None


@dataclass
class Sources:
    """Where a scrape's inputs come from (fakes in unit tests)."""

    holders: Callable[[], list[Holder]]
    nvml: Nvml
    #: This node's pods from the API server; None: no API access (shared GPUs not attributed).
    pods: Callable[[], list[Obj]] | None = None
    cgroups: Callable[[int], list[str] | None] = proc_cgroups
    wall_clock: Callable[[], float] = time.time


@dataclass
class Scrape:
    usages: list[Usage]
    #: (device index, device uuid) → processes that could not be attributed.
    unattributed: dict[DeviceLabels, int]
    errors: list[str]


def scrape(sources: Sources, table: dict[tuple[str, str], DeviceLimits]) -> Scrape:
    """One scrape's figures; a source that fails leaves its part out and names itself in
    ``errors`` (``podresources``, ``nvml``, ``apiserver``)."""
    errors: list[str] = []
    try:
        held = usages(sources.holders(), table)
    except GpusliceError as exc:
        log.warning("container metrics: the pod resources API failed", error=str(exc))
        return Scrape([], {}, ["podresources"])
    by_device: dict[str, list[Usage]] = defaultdict(list)
    for u in held.values():
        by_device[u.device.uuid].append(u)
    limits_by_uuid = {u.device.uuid: u.device for u in held.values()}
    pod_cache: list[dict[tuple[str, str], PodIds]] = []

    def pods() -> dict[tuple[str, str], PodIds]:
        if not pod_cache:
            listed: list[Obj] = []
            if sources.pods is not None:
                try:
                    listed = sources.pods()
                except GpusliceError as exc:
                    log.warning("container metrics: cannot list this node's pods", error=str(exc))
                    errors.append("apiserver")
            pod_cache.append(pod_ids(listed))
        return pod_cache[0]

    unattributed: dict[DeviceLabels, int] = defaultdict(int)
    gpus = sorted({d.gpu_index for d in limits_by_uuid.values()})
    now_us = int(sources.wall_clock() * 1_000_000)
    for gpu in gpus:
        try:
            processes = sources.nvml.running_processes(gpu)
        except NvmlError as exc:
            log.warning("container metrics: NVML processes failed", gpu=gpu, error=str(exc))
            errors.append("nvml")
            continue
        whole = any(d.gpu_index == gpu and not d.mig for d in limits_by_uuid.values())
        sm = _sm_by_pid(sources.nvml, gpu, now_us, whole)
        for p in processes:
            owner = attribute(p, by_device.get(p.device_uuid, []), sources.cgroups, pods)
            if owner is None:
                if p.device_uuid in limits_by_uuid:
                    d = limits_by_uuid[p.device_uuid]
                    unattributed[d.labels] += 1
                continue
            owner.pids.append(p.pid)
            owner.memory_used += p.used_memory_bytes or 0
            owner.sm_used = min(100, owner.sm_used + sm.get(p.pid, 0))
    return Scrape(list(held.values()), dict(unattributed), errors)


def _sm_by_pid(nvml: Nvml, gpu: int, now_us: int, wanted: bool) -> dict[int, int]:
    """The latest SM percent per PID in the window (empty in MIG mode, where NVML has none)."""
    if not wanted:
        return {}
    try:
        samples = nvml.process_utilization(gpu, since_us=now_us - SM_WINDOW_US)
    except NvmlError:
        return {}
    latest: dict[int, tuple[int, int]] = {}
    for s in samples:
        if s.pid not in latest or s.timestamp_us >= latest[s.pid][0]:
            latest[s.pid] = (s.timestamp_us, s.sm_percent)
    return {pid: sm for pid, (_, sm) in latest.items()}


class ContainerCollector(Collector):
    """``gpuslice_container_gpu_*`` per (container, device), computed at every scrape."""

    def __init__(
        self,
        sources: Sources,
        table: dict[tuple[str, str], DeviceLimits],
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.sources = sources
        self.table = table
        self.on_error = on_error

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())  # names only: no scrape at registration

    def _families(self) -> list[GaugeMetricFamily]:
        def gauge(name: str, doc: str, labels: list[str] = LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        return [
            gauge(
                metric_name(Subsystem.CONTAINER, "gpu_memory_used_bytes"),
                "Device memory used by the container's processes on the GPU or MIG device.",
            ),
            gauge(
                metric_name(Subsystem.CONTAINER, "gpu_memory_limit_bytes"),
                "Device memory the container may use there (the device's, or its MPS share's).",
            ),
            gauge(
                metric_name(Subsystem.CONTAINER, "gpu_sm_ratio"),
                "SM utilization of the container's processes, 0..1 of the GPU's SMs (not in MIG"
                " mode).",
            ),
            gauge(
                metric_name(Subsystem.CONTAINER, "gpu_sm_limit_ratio"),
                "The share of the GPU's SMs the container may use, 0..1 (1, or its MPS share's"
                " cores).",
            ),
            gauge(
                metric_name(Subsystem.CONTAINER, "gpu_limit_enforced"),
                "1 when the limits are enforced (an MPS share, a MIG device), 0 when they are"
                " only the device's size (a whole GPU, a time-slicing replica).",
            ),
            gauge(
                metric_name(Subsystem.CONTAINER, "gpu_processes"),
                "Processes of the container on the GPU or MIG device.",
            ),
            gauge(
                metric_name(Subsystem.DEVICE_PLUGIN, "unattributed_processes"),
                "Processes on a device held by containers that could not be attributed to one"
                " of them (several holders and no cgroup match).",
                DEVICE_LABELS,
            ),
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        result = scrape(self.sources, self.table)
        if self.on_error is not None:
            for source in result.errors:
                self.on_error(source)
        used, limit, sm, sm_limit, enforced, procs, lost = self._families()
        for u in sorted(result.usages, key=lambda u: u.key):
            labels = [u.namespace, u.pod, u.container, *u.device.labels, u.resource]
            used.add_metric(labels, u.memory_used)
            limit.add_metric(labels, u.memory_limit)
            if not u.device.mig:
                sm.add_metric(labels, u.sm_used / 100)
            sm_limit.add_metric(labels, u.sm_limit / 100)
            enforced.add_metric(labels, 1 if u.device.enforced else 0)
            procs.add_metric(labels, len(u.pids))
        for device, count in sorted(result.unattributed.items()):
            lost.add_metric(list(device), count)
        yield from (used, limit, sm, sm_limit, enforced, procs, lost)
