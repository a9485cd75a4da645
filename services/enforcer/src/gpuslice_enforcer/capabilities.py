"""Per-GPU capability probe and the choice of mechanisms for a share.

Each GPU is probed for the mechanisms this node can use on it, strongest first:

* driver memory partitioning: the NVML memory-limit calls exist (``nvmlDeviceGetMemoryLimits_v1``
  answers for the cgroup v2 root instead of FUNCTION_NOT_FOUND) and a cgroup v2 hierarchy is
  mounted; not in MIG mode;
* MPS protocol 3: driver 615+, the MPS control command present, Volta or newer, not MIG;
* legacy MPS: the control command present, Volta (compute capability 7.0) or newer, not MIG;
* the watchdog: always (NVML per-process sampling).

MPS holds only processes that go through the MPS server. Whether every process of a share must
do so is the GPU's compute mode: in EXCLUSIVE_PROCESS only the server may hold a context. The
probe reports it as ``exclusive``: available when the GPU is in that mode, or when the enforcer
will put it there while it serves MPS shares (``--compute-mode=exclusive``, the default). An MPS
mechanism without it is SOFT — a process that ignores the pipe directory runs beside the server,
and only the watchdog's backstop holds it.

Every answer carries its reason, so "why is my share soft" has an answer in GetCapabilities and
in each CreateShare limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_enforcer.cgroups import CgroupView
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.state import Level, Mechanism, Mode, hard, level_of
from gpuslice_nvml import (
    MEMORY_PARTITIONING_MIN_DRIVER,
    ComputeMode,
    GpuInfo,
    Nvml,
    NvmlError,
    driver_major,
)
from gpuslice_nvml.errors import NvmlFunctionNotFound

VOLTA = (7, 0)


@dataclass(frozen=True)
class Capability:
    available: bool
    reason: str


@dataclass(frozen=True)
class GpuCapabilities:
    index: int
    uuid: str
    driver_version: str
    memory_total_bytes: int
    memory_partitioning: Capability
    mps_protocol3: Capability
    mps_legacy: Capability
    mig: Capability
    #: Only the MPS server may hold a context (EXCLUSIVE_PROCESS compute mode, now or while
    #: the GPU serves MPS shares): MPS then holds every process of a share.
    exclusive: Capability

    @property
    def memory_mechanism(self) -> Mechanism:
        if self.memory_partitioning.available:
            return Mechanism.MEMORY_PARTITION
        return self.cores_mechanism if self.cores_mechanism.mps else Mechanism.WATCHDOG

    @property
    def cores_mechanism(self) -> Mechanism:
        if self.mps_protocol3.available:
            return Mechanism.MPS_PROTOCOL3
        if self.mps_legacy.available:
            return Mechanism.MPS_LEGACY
        return Mechanism.WATCHDOG

    @property
    def level(self) -> Level:
        return level_of(
            self.memory_mechanism, self.cores_mechanism, mps_exclusive=self.exclusive.available
        )


def probe_gpu(
    nvml: Nvml, gpu: GpuInfo, config: EnforcerConfig, cgroups: CgroupView
) -> GpuCapabilities:
    driver = nvml.system_info().driver_version
    major = driver_major(driver)
    mig = (
        Capability(True, "the GPU is in MIG mode: MIG devices are isolated by MIG, not by shares")
        if gpu.mig_enabled
        else Capability(False, "MIG mode is off" if gpu.mig_capable else "the GPU cannot do MIG")
    )
    volta = gpu.cuda_compute_capability >= VOLTA
    cc = gpu.cuda_compute_capability_str
    control_missing = config.mps_control_found()

    def mps(protocol3: bool) -> Capability:
        if not config.mps:
            return Capability(False, "MPS is turned off (--mps=off)")
        if gpu.mig_enabled:
            return Capability(False, "the GPU is in MIG mode")
        if not volta:
            return Capability(False, f"needs Volta (compute capability 7.0) or newer, found {cc}")
        if protocol3 and major < MEMORY_PARTITIONING_MIN_DRIVER:
            return Capability(
                False,
                f"needs driver {MEMORY_PARTITIONING_MIN_DRIVER}+, found {driver}",
            )
        if control_missing:
            return Capability(False, f"the MPS control daemon cannot run: {control_missing}")
        what = "protocol 3 namespaces" if protocol3 else "per-client limits"
        return Capability(True, f"driver {driver}, compute capability {cc}: MPS {what}")

    return GpuCapabilities(
        index=gpu.index,
        uuid=gpu.uuid,
        driver_version=driver,
        memory_total_bytes=gpu.memory_total_bytes,
        memory_partitioning=_partitioning(nvml, gpu, config, cgroups, driver),
        mps_protocol3=mps(True),
        mps_legacy=mps(False),
        mig=mig,
        exclusive=_exclusive(nvml, gpu, config),
    )


def _exclusive(nvml: Nvml, gpu: GpuInfo, config: EnforcerConfig) -> Capability:
    try:
        mode = nvml.compute_mode(gpu.index)
    except NvmlError as exc:
        return Capability(False, f"the GPU's compute mode cannot be read: {exc}")
    if mode is ComputeMode.EXCLUSIVE_PROCESS:
        return Capability(
            True, "compute mode EXCLUSIVE_PROCESS: no process can run beside the MPS server"
        )
    if config.manage_compute_mode:
        return Capability(
            True,
            f"compute mode {mode.value}, set to EXCLUSIVE_PROCESS while the GPU serves MPS "
            "shares: no process can run beside the MPS server",
        )
    return Capability(
        False,
        f"compute mode {mode.value} is left as it is (--compute-mode=leave): a process that "
        "does not use the MPS pipe directory runs beside the MPS server, held only by the "
        "watchdog",
    )


def _partitioning(
    nvml: Nvml, gpu: GpuInfo, config: EnforcerConfig, cgroups: CgroupView, driver: str
) -> Capability:
    if not config.memory_partitioning:
        return Capability(False, "memory partitioning is turned off (--memory-partitioning=off)")
    if gpu.mig_enabled:
        return Capability(False, "the GPU is in MIG mode (memory limits need a non-MIG device)")
    root = cgroups.v2_root
    if root is None:
        return Capability(False, "no cgroup v2 hierarchy is mounted (partitioning needs one)")
    try:
        nvml.memory_limits(gpu.index, str(root))
    except NvmlFunctionNotFound:
        return Capability(
            False,
            f"driver {driver} has no nvmlDeviceGetMemoryLimits_v1 "
            f"(memory partitioning needs driver {MEMORY_PARTITIONING_MIN_DRIVER}+)",
        )
    except NvmlError as exc:
        return Capability(False, f"the driver refuses memory limits: {exc}")
    return Capability(True, f"driver {driver} limits memory per cgroup (cgroup v2 at {root})")


def probe(nvml: Nvml, config: EnforcerConfig, cgroups: CgroupView) -> list[GpuCapabilities]:
    """Every GPU's capabilities; a lost GPU is skipped (it has none)."""
    found = []
    for index in range(nvml.device_count()):
        try:
            gpu = nvml.gpu(index)
        except NvmlError:
            continue
        found.append(probe_gpu(nvml, gpu, config, cgroups))
    return found


@dataclass(frozen=True)
class Choice:
    memory: Mechanism
    memory_reason: str
    cores: Mechanism
    cores_reason: str
    #: See ``GpuCapabilities.exclusive``; meaningful for MPS mechanisms.
    mps_exclusive: bool = True


def choose(
    gpus: list[GpuCapabilities],
    *,
    mode: Mode,
    strict: bool,
    cores_percent: int,
    memory_bytes: int,
) -> Choice:
    """The mechanisms for a share on ``gpus`` (all of them must offer what is chosen).

    Raises ``FailedPreconditionError`` for a strict HARD share that a GPU cannot hold hard, and
    for a GPU in MIG mode.
    """
    for gpu in gpus:
        if gpu.mig.available:
            raise FailedPreconditionError(f"GPU {gpu.uuid}: {gpu.mig.reason}")
    whole = cores_percent >= 100 and all(memory_bytes >= g.memory_total_bytes for g in gpus)
    if mode is Mode.OFF:
        reason = "enforcement mode off: usage is accounted only"
        return Choice(Mechanism.NONE, reason, Mechanism.NONE, reason)
    if whole:
        reason = "the share is the whole GPU: nothing to limit"
        return Choice(Mechanism.NONE, reason, Mechanism.NONE, reason)
    if mode is Mode.SOFT:
        reason = "enforcement mode soft: the NVML watchdog"
        return Choice(Mechanism.WATCHDOG, reason, Mechanism.WATCHDOG, reason)

    single = len(gpus) == 1
    cores, cores_reason = Mechanism.WATCHDOG, ""
    if not single:
        cores_reason = "MPS serves one GPU per client pipe directory; the share spans several"
    elif gpus[0].mps_protocol3.available:
        cores, cores_reason = Mechanism.MPS_PROTOCOL3, gpus[0].mps_protocol3.reason
    elif gpus[0].mps_legacy.available:
        cores, cores_reason = Mechanism.MPS_LEGACY, gpus[0].mps_legacy.reason
    else:
        cores_reason = (
            f"MPS protocol 3: {gpus[0].mps_protocol3.reason}; "
            f"legacy MPS: {gpus[0].mps_legacy.reason}"
        )
    if all(g.memory_partitioning.available for g in gpus):
        memory, memory_reason = Mechanism.MEMORY_PARTITION, gpus[0].memory_partitioning.reason
    elif cores.mps:
        memory = cores
        memory_reason = (
            f"memory partitioning: {gpus[0].memory_partitioning.reason}; "
            f"the MPS pinned device-memory limit holds instead"
        )
    else:
        memory = Mechanism.WATCHDOG
        unavailable = next(g for g in gpus if not g.memory_partitioning.available)
        memory_reason = f"memory partitioning: {unavailable.memory_partitioning.reason}"
        if single:
            memory_reason += f"; MPS: {cores_reason}"
    exclusive = all(g.exclusive.available for g in gpus)
    if cores.mps and not exclusive:
        soft = f"; SOFT: {gpus[0].exclusive.reason}"
        cores_reason += soft
        if memory.mps:
            memory_reason += soft
    memory_hard = hard(memory, mps_exclusive=exclusive)
    cores_hard = hard(cores, mps_exclusive=exclusive)
    if mode is Mode.HARD and strict and not (memory_hard and cores_hard):
        weak = []
        if not memory_hard:
            weak.append(f"memory: {memory_reason}")
        if not cores_hard:
            weak.append(f"cores: {cores_reason}")
        raise FailedPreconditionError(
            "strict hard enforcement is not available on "
            f"{', '.join(g.uuid for g in gpus)}: {'; '.join(weak)}"
        )
    if memory is Mechanism.WATCHDOG:
        memory_reason += "; using the watchdog (soft)"
    if cores is Mechanism.WATCHDOG:
        cores_reason += "; using the watchdog (soft)"
    return Choice(memory, memory_reason, cores, cores_reason, mps_exclusive=exclusive)
