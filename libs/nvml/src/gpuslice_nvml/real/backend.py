"""``RealNvml``: the :class:`~gpuslice_nvml.interface.Nvml` interface on libnvidia-ml (pynvml).

It never falls back to the fake: when NVML cannot start, the constructor raises the mapped
error (``NvmlLibraryNotFound``, ``NvmlDriverNotLoaded``, ...) with a hint. With a driver root
it loads that root's ``libnvidia-ml.so.1`` (``gpuslice_nvml.real.library``). Facts that cannot
change while the driver is loaded (name, UUID, PCI address, memory size) are read once per GPU
and cached; MIG state, memory use and processes are read on every call.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pynvml

from gpuslice_nvml import errors as e
from gpuslice_nvml.interface import EventWatch, Nvml
from gpuslice_nvml.real import calls as c
from gpuslice_nvml.real import library
from gpuslice_nvml.real import mig as m
from gpuslice_nvml.real.events import RealEventWatch
from gpuslice_nvml.real.topology import NvLinkEnd, nvlink_ends, nvlinks_between
from gpuslice_nvml.types import (
    ComputeInstance,
    ComputeInstanceProfile,
    ComputeMode,
    DeviceRef,
    GpuInfo,
    GpuInstance,
    GpuInstanceProfile,
    GpuLink,
    MemoryInfo,
    MemoryLimits,
    MigDevice,
    MigMode,
    Placement,
    ProcessInfo,
    ProcessUtilization,
    SystemInfo,
    TopologyLevel,
    UtilizationRates,
)


class RealNvml(Nvml):
    backend = "real"

    def __init__(self, driver_root: Path | None = None) -> None:
        """Start NVML on the driver root's library (``driver_root``: the driver's root as
        this process sees it; None or ``/``: the loader's search path). What NVML has no call
        for (reset, time slice) runs the driver root's ``nvidia-smi`` on that library."""
        self._driver_root = driver_root
        try:
            self.library = library.preload(driver_root)
        except OSError as exc:
            raise e.nvml_error(
                e.ERROR_LIBRARY_NOT_FOUND,
                "nvmlInit",
                f"cannot load the driver root's library: {exc}",
            ) from exc
        c.init(self.library.not_found_hint())
        try:
            if not library.pynvml_uses_it():
                raise e.nvml_error(
                    e.ERROR_UNKNOWN,
                    "nvmlInit",
                    f"pynvml uses another libnvidia-ml than {self.library.describe()}: this "
                    "process loaded one before the driver root's",
                )
            count = c.call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
            opened = [self._open(i) for i in range(count)]
        except BaseException:
            c.shutdown()
            raise
        #: ``None`` (and UUID "") for a GPU that was already lost when NVML started.
        self._handles: list[Any | None] = [h for h, _ in opened]
        self._uuids = [uuid for _, uuid in opened]
        self._static: dict[int, GpuInfo] = {}
        self._links: dict[int, list[NvLinkEnd]] = {}
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            c.shutdown()

    # -- lookups --------------------------------------------------------------------------
    @staticmethod
    def _open(index: int) -> tuple[Any | None, str]:
        """(handle, UUID) of a GPU; (None, "") for a lost one, as the services expect to start
        on a node with a GPU off the bus and see NvmlGpuLost for it alone."""
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            return h, c.text(pynvml.nvmlDeviceGetUUID(h))
        except pynvml.NVMLError as exc:
            if c.error_code(exc) == e.ERROR_GPU_IS_LOST:
                return None, ""
            raise c.map_error(exc, f"nvmlDeviceGetHandleByIndex({index})") from exc

    def _handle(self, index: int, what: str) -> Any:
        if not 0 <= index < len(self._handles):
            raise e.nvml_error(
                e.ERROR_INVALID_ARGUMENT, what, f"no GPU {index}; the node has {len(self._handles)}"
            )
        if self._handles[index] is None:  # lost at start: it may answer again after a reset
            self._handles[index], self._uuids[index] = self._open(index)
            if self._handles[index] is None:
                raise e.nvml_error(e.ERROR_GPU_IS_LOST, what, f"GPU {index} is lost")
        return self._handles[index]

    def _resolve(self, device: DeviceRef, what: str) -> tuple[int, Any, m.MigHandle | None]:
        """(GPU index, handle, MIG device) for an index or UUID."""
        if isinstance(device, int):
            return device, self._handle(device, what), None
        if device.startswith("GPU-"):
            if device not in self._uuids:
                raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"no GPU has UUID {device}")
            index = self._uuids.index(device)
            return index, self._handles[index], None
        if not device.startswith("MIG-"):
            raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, what, f"{device!r} is not a GPU/MIG UUID")
        mh = c.call(what, pynvml.nvmlDeviceGetHandleByUUID, device)
        parent = c.call(what, pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, mh)
        index = self._uuids.index(c.text(c.call(what, pynvml.nvmlDeviceGetUUID, parent)))
        mig = m.MigHandle(
            handle=mh,
            uuid=device,
            gpu_instance_id=c.call(what, pynvml.nvmlDeviceGetGpuInstanceId, mh),
            compute_instance_id=c.call(what, pynvml.nvmlDeviceGetComputeInstanceId, mh),
        )
        return index, self._handles[index], mig

    def _total_memory(self, index: int) -> int:
        return self._static_info(index).memory_total_bytes

    # -- node and GPUs --------------------------------------------------------------------
    def system_info(self) -> SystemInfo:
        driver = c.text(c.call("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion))
        cuda = c.call("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion)
        return SystemInfo(driver, int(cuda))

    def device_count(self) -> int:
        return len(self._handles)

    def gpu(self, index: int) -> GpuInfo:
        static = self._static_info(index)
        mode = self._mig_mode_or_none(index)
        return dataclasses.replace(static, mig_capable=mode is not None, mig_mode=mode)

    def gpus(self) -> list[GpuInfo]:
        return [self.gpu(i) for i in range(len(self._handles))]

    def _static_info(self, index: int) -> GpuInfo:
        if index in self._static:
            return self._static[index]
        h = self._handle(index, f"nvmlDeviceGetHandleByIndex({index})")
        pci = c.call("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, h)
        bus_id = c.normalize_bus_id(pci.busId)
        cc = c.call(
            "nvmlDeviceGetCudaComputeCapability", pynvml.nvmlDeviceGetCudaComputeCapability, h
        )
        major, minor = int(cc[0]), int(cc[1])
        info = GpuInfo(
            index=index,
            minor=c.call("nvmlDeviceGetMinorNumber", pynvml.nvmlDeviceGetMinorNumber, h),
            uuid=self._uuids[index],
            name=c.text(c.call("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, h)),
            brand=c.BRANDS.get(
                c.call("nvmlDeviceGetBrand", pynvml.nvmlDeviceGetBrand, h), "Unknown"
            ),
            architecture=c.ARCHITECTURES.get(
                c.call("nvmlDeviceGetArchitecture", pynvml.nvmlDeviceGetArchitecture, h), "Unknown"
            ),
            cuda_compute_capability=(major, minor),
            multiprocessors=self._multiprocessors(h, major, minor),
            memory_total_bytes=int(
                c.call("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, h).total
            ),
            pci_bus_id=bus_id,
            pci_device_id=int(pci.pciDeviceId),
            pcie_root=c.sysfs_pcie_root(bus_id),
            numa_node=self._numa_node(h, bus_id),
            mig_capable=False,
            mig_mode=None,
            addressing_mode=self._addressing_mode(h),
        )
        self._static[index] = info
        return info

    @staticmethod
    def _multiprocessors(h: Any, major: int, minor: int) -> int:
        try:
            return int(pynvml.nvmlDeviceGetAttributes(h).multiprocessorCount)
        except pynvml.NVMLError:
            pass  # only MIG handles answer on many drivers; derive from the core count
        per_sm = c.cores_per_sm(major, minor)
        try:
            cores = int(pynvml.nvmlDeviceGetNumGpuCores(h))
        except pynvml.NVMLError:
            return 0
        return cores // per_sm if per_sm else 0

    @staticmethod
    def _addressing_mode(h: Any) -> str | None:
        """As go-nvlib reads it: absent without the call (older drivers) or where the platform
        does not support it; other errors are real ones."""
        get = getattr(pynvml, "nvmlDeviceGetAddressingMode", None)
        if get is None:
            return None
        try:
            mode = int(get(h))
        except pynvml.NVMLError as exc:
            if c.error_code(exc) in (e.ERROR_NOT_SUPPORTED, e.ERROR_FUNCTION_NOT_FOUND):
                return None
            raise c.map_error(exc, "nvmlDeviceGetAddressingMode") from exc
        return c.ADDRESSING_MODES.get(mode)

    @staticmethod
    def _numa_node(h: Any, bus_id: str) -> int | None:
        try:
            value = int(pynvml.nvmlDeviceGetNumaNodeId(h))
        except pynvml.NVMLError:
            return c.sysfs_numa_node(bus_id)
        return value if 0 <= value < 0xFFFF else None

    def memory_info(self, device: DeviceRef) -> MemoryInfo:
        what = f"nvmlDeviceGetMemoryInfo({device})"
        _, h, mig = self._resolve(device, what)
        info = c.call(what, pynvml.nvmlDeviceGetMemoryInfo, mig.handle if mig else h)
        return MemoryInfo(total=int(info.total), used=int(info.used), free=int(info.free))

    def utilization(self, gpu: int) -> UtilizationRates:
        what = f"nvmlDeviceGetUtilizationRates(GPU {gpu})"
        rates = c.call(what, pynvml.nvmlDeviceGetUtilizationRates, self._handle(gpu, what))
        return UtilizationRates(int(rates.gpu), int(rates.memory))

    def topology(self, gpu_a: int, gpu_b: int) -> GpuLink:
        what = f"nvmlDeviceGetTopologyCommonAncestor(GPU {gpu_a}, GPU {gpu_b})"
        ha, hb = self._handle(gpu_a, what), self._handle(gpu_b, what)
        if gpu_a == gpu_b:
            return GpuLink(TopologyLevel.INTERNAL, 0)
        raw = c.call(what, pynvml.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
        try:
            level = TopologyLevel(int(raw))
        except ValueError:
            level = TopologyLevel.SYSTEM
        ends_a, ends_b = self._nvlink_ends(gpu_a), self._nvlink_ends(gpu_b)
        return GpuLink(level, nvlinks_between(ends_a, ends_b, self._static_info(gpu_b).pci_bus_id))

    def _nvlink_ends(self, index: int) -> list[NvLinkEnd]:
        if index not in self._links:
            self._links[index] = nvlink_ends(index, self._handle(index, "nvmlDeviceGetNvLinkState"))
        return self._links[index]

    # -- MIG ------------------------------------------------------------------------------
    def _mig_mode_or_none(self, gpu: int) -> MigMode | None:
        what = f"nvmlDeviceGetMigMode(GPU {gpu})"
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(self._handle(gpu, what))
        except pynvml.NVMLError as exc:
            if c.error_code(exc) == e.ERROR_NOT_SUPPORTED:
                return None
            raise c.map_error(exc, what) from exc
        return MigMode(current=bool(current), pending=bool(pending))

    def mig_mode(self, gpu: int) -> MigMode:
        mode = self._mig_mode_or_none(gpu)
        if mode is None:
            raise e.nvml_error(e.ERROR_NOT_SUPPORTED, f"nvmlDeviceGetMigMode(GPU {gpu})")
        return mode

    def _require_mig(self, gpu: int, what: str) -> Any:
        if not self.mig_mode(gpu).current:
            raise e.nvml_error(e.ERROR_NOT_SUPPORTED, what, "MIG mode is not enabled")
        return self._handles[gpu]

    def set_mig_mode(self, gpu: int, enabled: bool) -> MigMode:
        what = f"nvmlDeviceSetMigMode(GPU {gpu})"
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        c.call(what, pynvml.nvmlDeviceSetMigMode, self._handle(gpu, what), mode)
        return self.mig_mode(gpu)

    def reset_gpu(self, gpu: int) -> MigMode:
        """NVML has no public reset call; like mig-parted, run ``nvidia-smi -r`` (the driver
        root's, on the library this process loaded, where the root has one)."""
        bus_id = self._static_info(gpu).pci_bus_id
        self._smi("GPU reset", "--gpu-reset", "-i", bus_id, timeout=120)
        return self.mig_mode(gpu)

    def set_compute_time_slice(self, gpu: int, level: int) -> None:
        """NVML has no call for it; like NVIDIA's DRA driver, run ``nvidia-smi compute-policy``
        (the same driver root's ``nvidia-smi`` as :meth:`reset_gpu`)."""
        uuid = self._static_info(gpu).uuid
        self._smi("time slice", "compute-policy", "-i", uuid, f"--set-timeslice={level}")

    def _smi(self, what: str, *args: str, timeout: float = 30) -> None:
        """Run ``nvidia-smi args`` (:func:`library.nvidia_smi`: the driver root's, on the
        library this process loaded); failures as NVML errors (IN_USE when it says so)."""
        smi, env = library.nvidia_smi(self._driver_root, self.library)
        shown = f"nvidia-smi {' '.join(args)}"
        try:
            subprocess.run(
                [smi, *args],
                check=True,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
        except FileNotFoundError as exc:
            raise e.nvml_error(e.ERROR_NOT_SUPPORTED, what, f"{smi} not found") from exc
        except OSError as exc:  # not executable, not a program for this machine (ENOEXEC)
            detail = f"cannot run {smi}: {exc}"
            raise e.nvml_error(e.ERROR_NOT_SUPPORTED, what, detail) from exc
        except subprocess.CalledProcessError as exc:
            detail = (exc.stdout + exc.stderr).strip()
            code = e.ERROR_IN_USE if "in use" in detail.lower() else e.ERROR_UNKNOWN
            raise e.nvml_error(code, shown, detail) from exc
        except subprocess.TimeoutExpired as exc:
            raise e.nvml_error(e.ERROR_TIMEOUT, shown) from exc

    def gpu_instance_profiles(self, gpu: int) -> list[GpuInstanceProfile]:
        self.mig_mode(gpu)  # NOT_SUPPORTED on GPUs without MIG
        return m.gi_profiles(self._handles[gpu], self._total_memory(gpu))

    def _gi_profile(self, gpu: int, profile_id: int, what: str) -> GpuInstanceProfile:
        for profile in self.gpu_instance_profiles(gpu):
            if profile.id == profile_id:
                return profile
        raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, what, f"no profile id {profile_id}")

    def remaining_capacity(self, gpu: int, profile_id: int) -> int:
        what = f"nvmlDeviceGetGpuInstanceRemainingCapacity(GPU {gpu}, profile {profile_id})"
        h = self._require_mig(gpu, what)
        return int(c.call(what, pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity, h, profile_id))

    def gpu_instances(self, gpu: int) -> list[GpuInstance]:
        h = self._require_mig(gpu, f"nvmlDeviceGetGpuInstances(GPU {gpu})")
        return m.gpu_instances(gpu, h, self.gpu_instance_profiles(gpu))

    def create_gpu_instance(
        self, gpu: int, profile_id: int, placement: Placement | None = None
    ) -> GpuInstance:
        what = f"nvmlDeviceCreateGpuInstance(GPU {gpu}, profile {profile_id})"
        h = self._require_mig(gpu, what)
        return m.create_gpu_instance(gpu, h, self._gi_profile(gpu, profile_id, what), placement)

    def destroy_gpu_instance(self, gpu: int, gpu_instance_id: int) -> None:
        what = f"nvmlGpuInstanceDestroy(GPU {gpu}, GPU instance {gpu_instance_id})"
        gi = m.gi_handle(gpu, self._require_mig(gpu, what), gpu_instance_id)
        c.call(what, pynvml.nvmlGpuInstanceDestroy, gi)

    def compute_instance_profiles(
        self, gpu: int, gpu_instance_id: int
    ) -> list[ComputeInstanceProfile]:
        what = f"nvmlGpuInstanceGetComputeInstanceProfileInfoV(GPU {gpu})"
        gi = m.gi_handle(gpu, self._require_mig(gpu, what), gpu_instance_id)
        gi_profile = m.gi_profile_of(gi, self.gpu_instance_profiles(gpu))
        return m.ci_profiles(gi, gi_profile, self._total_memory(gpu))

    def compute_instances(self, gpu: int, gpu_instance_id: int) -> list[ComputeInstance]:
        what = f"nvmlGpuInstanceGetComputeInstances(GPU {gpu})"
        h = self._require_mig(gpu, what)
        gi = m.gi_handle(gpu, h, gpu_instance_id)
        profiles = self.compute_instance_profiles(gpu, gpu_instance_id)
        return m.compute_instances(gpu, gpu_instance_id, gi, profiles, self._mig_uuids(h))

    def create_compute_instance(
        self, gpu: int, gpu_instance_id: int, profile_id: int
    ) -> ComputeInstance:
        what = f"nvmlGpuInstanceCreateComputeInstance(GPU {gpu}, profile {profile_id})"
        h = self._require_mig(gpu, what)
        gi = m.gi_handle(gpu, h, gpu_instance_id)
        profiles = self.compute_instance_profiles(gpu, gpu_instance_id)
        profile = next((p for p in profiles if p.id == profile_id), None)
        if profile is None:
            raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, what, f"no profile id {profile_id}")
        return m.create_compute_instance(
            gpu, gpu_instance_id, gi, profile, lambda: self._mig_uuids(h)
        )

    def destroy_compute_instance(
        self, gpu: int, gpu_instance_id: int, compute_instance_id: int
    ) -> None:
        what = (
            f"nvmlComputeInstanceDestroy(GPU {gpu}, GI {gpu_instance_id}, CI {compute_instance_id})"
        )
        gi = m.gi_handle(gpu, self._require_mig(gpu, what), gpu_instance_id)
        ci = c.call(what, pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, compute_instance_id)
        c.call(what, pynvml.nvmlComputeInstanceDestroy, ci)

    def mig_devices(self, gpu: int) -> list[MigDevice]:
        mode = self._mig_mode_or_none(gpu)
        if mode is None or not mode.current:
            return []
        return m.mig_devices(
            gpu,
            self._handles[gpu],
            self._uuids[gpu],
            self.gpu_instance_profiles(gpu),
            self._total_memory(gpu),
        )

    def _mig_uuids(self, h: Any) -> dict[tuple[int, int], str]:
        return {(mh.gpu_instance_id, mh.compute_instance_id): mh.uuid for mh in m.mig_handles(h)}

    # -- processes ------------------------------------------------------------------------
    def running_processes(self, device: DeviceRef) -> list[ProcessInfo]:
        """The driver's compute list holds MPS clients too (seen on an H100 under MPS); the
        interface lists them with :meth:`mps_processes` only, so they are taken out here."""
        what = f"nvmlDeviceGetComputeRunningProcesses({device})"
        listed = self._processes_of(device, pynvml.nvmlDeviceGetComputeRunningProcesses, what)
        clients = {(p.device_uuid, p.pid) for p in self.mps_processes(device)}
        return [p for p in listed if (p.device_uuid, p.pid) not in clients]

    def mps_processes(self, device: DeviceRef) -> list[ProcessInfo]:
        what = f"nvmlDeviceGetMPSComputeRunningProcesses({device})"
        return self._processes_of(device, pynvml.nvmlDeviceGetMPSComputeRunningProcesses, what)

    def _processes_of(
        self, device: DeviceRef, call: Callable[[Any], Any], what: str
    ) -> list[ProcessInfo]:
        index, h, mig = self._resolve(device, what)
        if mig is not None:
            targets = [mig]
        else:
            mode = self._mig_mode_or_none(index)
            if mode is None or not mode.current:
                return self._processes(index, h, self._uuids[index], None, call, what)
            targets = m.mig_handles(h)
        result = []
        for t in targets:
            result.extend(self._processes(index, t.handle, t.uuid, t, call, what))
        return result

    @staticmethod
    def _processes(
        index: int,
        h: Any,
        uuid: str,
        mig: m.MigHandle | None,
        call: Callable[[Any], Any],
        what: str,
    ) -> list[ProcessInfo]:
        procs = c.call(what, call, h)
        return [
            ProcessInfo(
                pid=int(p.pid),
                gpu_index=index,
                device_uuid=uuid,
                used_memory_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                gpu_instance_id=mig.gpu_instance_id if mig else None,
                compute_instance_id=mig.compute_instance_id if mig else None,
            )
            for p in procs
        ]

    def process_utilization(self, gpu: int, since_us: int = 0) -> list[ProcessUtilization]:
        what = f"nvmlDeviceGetProcessUtilization(GPU {gpu})"
        h = self._handle(gpu, what)
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(h, since_us)
        except pynvml.NVMLError as exc:
            if c.error_code(exc) in (e.SUCCESS, e.ERROR_NOT_FOUND):
                return []  # no samples since ``since_us``
            raise c.map_error(exc, what) from exc
        return [
            ProcessUtilization(int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil))
            for s in samples
        ]

    # -- compute mode ---------------------------------------------------------------------
    def compute_mode(self, gpu: int) -> ComputeMode:
        what = f"nvmlDeviceGetComputeMode(GPU {gpu})"
        h = self._handle(gpu, what)
        return ComputeMode.from_nvml(int(c.call(what, pynvml.nvmlDeviceGetComputeMode, h)))

    def set_compute_mode(self, gpu: int, mode: ComputeMode) -> None:
        what = f"nvmlDeviceSetComputeMode(GPU {gpu}, {mode.value})"
        h = self._handle(gpu, what)
        c.call(what, pynvml.nvmlDeviceSetComputeMode, h, mode.nvml_value)

    # -- memory partitioning (driver 615+) ------------------------------------------------
    def set_memory_limits(self, gpu: int, namespace: str, soft_limit: int, hard_limit: int) -> None:
        what = f"nvmlDeviceSetMemoryLimits_v1(GPU {gpu}, {namespace})"
        h = self._handle(gpu, what)
        limits = pynvml.c_nvmlSetMemoryLimits_v1_t()
        limits.nameSpace = namespace.encode()
        limits.softLimit = soft_limit
        limits.hardLimit = hard_limit
        c.call(what, pynvml.nvmlDeviceSetMemoryLimits_v1, h, limits)

    def memory_limits(self, gpu: int, namespace: str) -> MemoryLimits:
        what = f"nvmlDeviceGetMemoryLimits_v1(GPU {gpu}, {namespace})"
        h = self._handle(gpu, what)
        limits = pynvml.c_nvmlGetMemoryLimits_v1_t()
        limits.nameSpace = namespace.encode()
        c.call(what, pynvml.nvmlDeviceGetMemoryLimits_v1, h, limits)
        return MemoryLimits(
            namespace=namespace,
            soft_limit=int(limits.softLimit),
            hard_limit=int(limits.hardLimit),
            current_used=int(limits.currentUsed),
        )

    # -- health ---------------------------------------------------------------------------
    def watch_events(self, gpus: Sequence[int] | None = None) -> EventWatch:
        indices = range(len(self._handles)) if gpus is None else gpus
        handles, lost = {}, []
        for i in indices:
            try:
                handles[i] = self._handle(i, "nvmlDeviceRegisterEvents")
            except e.NvmlGpuLost:
                lost.append(i)
        return RealEventWatch(handles, dict(enumerate(self._uuids)), lost=lost)
