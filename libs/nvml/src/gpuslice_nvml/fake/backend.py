"""``FakeNvml``: the :class:`~gpuslice_nvml.interface.Nvml` interface over a simulated node.

Static facts come from the config (``FakeNode``); everything that changes is read from and
written to the shared state file on every call, so all processes of a fake node agree.
Errors are the NVML error types with the codes NVML returns in the same situation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import mig, partition, procfs
from gpuslice_nvml.fake.activity import UtilizationWindows, live_processes
from gpuslice_nvml.fake.events import FakeEventWatch
from gpuslice_nvml.fake.lookup import (
    Target,
    gpu_by_index,
    live_gpu,
    memory_total,
    memory_used,
    process_info,
    resolve,
)
from gpuslice_nvml.fake.node import FakeGpu, FakeNode, load_node
from gpuslice_nvml.fake.state import GiState, StateStore
from gpuslice_nvml.fake.timeslice import TickListing
from gpuslice_nvml.interface import EventWatch, Nvml
from gpuslice_nvml.types import (
    MIB,
    TIME_SLICES,
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
    UtilizationRates,
)


class FakeNvml(Nvml):
    """NVML for a fake node described by a config file (see docs/nvml.md)."""

    backend = "fake"

    def __init__(
        self,
        node: FakeNode,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wall_clock: Callable[[], float] = time.time,
        poll_interval_s: float = 0.02,
    ) -> None:
        self.node = node
        self.store = StateStore(node.state_path, node.digest, node.initial_state)
        self._clock = clock
        self._sleep = sleep
        self._wall_clock = wall_clock
        self._poll_interval_s = poll_interval_s
        self._windows = UtilizationWindows(lambda: int(self._wall_clock() * 1e9))
        self._ticks = TickListing()

    @classmethod
    def from_config_file(cls, path: str | Path) -> FakeNvml:
        return cls(load_node(path))

    def close(self) -> None:
        """Nothing to release: every call opens and closes the state file."""

    # -- node and GPUs --------------------------------------------------------------------
    def system_info(self) -> SystemInfo:
        return SystemInfo(self.node.driver_version, self.node.cuda_driver_version)

    def device_count(self) -> int:
        return len(self.node.gpus)

    def gpu(self, index: int) -> GpuInfo:
        what = f"nvmlDeviceGetHandleByIndex({index})"
        gpu, gs = live_gpu(self.node, self.store.read(), index, what)
        model = gpu.model
        return GpuInfo(
            index=gpu.index,
            minor=gpu.index,
            uuid=gpu.uuid,
            name=model.product_name,
            brand=model.brand,
            architecture=model.architecture,
            cuda_compute_capability=model.cuda_compute_capability,
            multiprocessors=model.multiprocessors,
            memory_total_bytes=model.memory_bytes,
            pci_bus_id=gpu.pci_bus_id,
            pci_device_id=model.pci_device_id,
            pcie_root=gpu.pcie_root,
            numa_node=gpu.numa_node,
            mig_capable=model.mig_capable,
            mig_mode=MigMode(gs.mig_current, gs.mig_pending) if model.mig_capable else None,
            addressing_mode=gpu.addressing_mode,
        )

    def gpus(self) -> list[GpuInfo]:
        return [self.gpu(i) for i in range(len(self.node.gpus))]

    def memory_info(self, device: DeviceRef) -> MemoryInfo:
        state = self.store.read()
        target = resolve(self.node, state, device, f"nvmlDeviceGetMemoryInfo({device})")
        total = memory_total(state, target)
        used = min(memory_used(state, target), total)
        return MemoryInfo(total=total, used=used, free=total - used)

    def utilization(self, gpu: int) -> UtilizationRates:
        what = f"nvmlDeviceGetUtilizationRates(GPU {gpu})"
        state = self.store.read()
        _, gs = live_gpu(self.node, state, gpu, what)
        if gs.mig_current:
            raise e.nvml_error(e.ERROR_NOT_SUPPORTED, what, "not available in MIG mode")
        procs = [p for p in live_processes(state) if p.gpu == gpu]
        running = [p for p in procs if not (p.real and procfs.frozen(p.pid))]
        return UtilizationRates(
            gpu_percent=min(100, sum(p.sm_percent for p in running)),
            memory_percent=min(100, sum(p.memory_percent for p in procs)),
        )

    def topology(self, gpu_a: int, gpu_b: int) -> GpuLink:
        what = f"nvmlDeviceGetTopologyCommonAncestor(GPU {gpu_a}, GPU {gpu_b})"
        state = self.store.read()
        live_gpu(self.node, state, gpu_a, what)
        live_gpu(self.node, state, gpu_b, what)
        return self.node.link(gpu_a, gpu_b)

    # -- MIG ------------------------------------------------------------------------------
    def mig_mode(self, gpu: int) -> MigMode:
        what = f"nvmlDeviceGetMigMode(GPU {gpu})"
        fake_gpu, gs = live_gpu(self.node, self.store.read(), gpu, what)
        mig.require_capable(fake_gpu, what)
        return MigMode(gs.mig_current, gs.mig_pending)

    def set_mig_mode(self, gpu: int, enabled: bool) -> MigMode:
        with self.store.transaction() as state:
            fake_gpu, gs = live_gpu(self.node, state, gpu, f"nvmlDeviceSetMigMode(GPU {gpu})")
            return mig.set_mode(fake_gpu, gs, enabled)

    def reset_gpu(self, gpu: int) -> MigMode:
        with self.store.transaction() as state:
            fake_gpu, gs = live_gpu(self.node, state, gpu, f"GPU reset (GPU {gpu})")
            return mig.reset(fake_gpu, gs, state.processes)

    def gpu_instance_profiles(self, gpu: int) -> list[GpuInstanceProfile]:
        what = f"nvmlDeviceGetGpuInstanceProfileInfoV(GPU {gpu})"
        fake_gpu, _ = live_gpu(self.node, self.store.read(), gpu, what)
        mig.require_capable(fake_gpu, what)
        return list(fake_gpu.gi_profiles)

    def remaining_capacity(self, gpu: int, profile_id: int) -> int:
        what = f"nvmlDeviceGetGpuInstanceRemainingCapacity(GPU {gpu})"
        fake_gpu, gs = live_gpu(self.node, self.store.read(), gpu, what)
        return mig.remaining_capacity(fake_gpu, gs, profile_id)

    def gpu_instances(self, gpu: int) -> list[GpuInstance]:
        what = f"nvmlDeviceGetGpuInstances(GPU {gpu})"
        fake_gpu, gs = live_gpu(self.node, self.store.read(), gpu, what)
        mig.require_enabled(fake_gpu, gs, what)
        return [self._gpu_instance(fake_gpu, gi) for gi in gs.gpu_instances]

    def create_gpu_instance(
        self, gpu: int, profile_id: int, placement: Placement | None = None
    ) -> GpuInstance:
        with self.store.transaction() as state:
            what = f"nvmlDeviceCreateGpuInstance(GPU {gpu})"
            fake_gpu, gs = live_gpu(self.node, state, gpu, what)
            gi = mig.create_gi(fake_gpu, gs, profile_id, placement)
            return self._gpu_instance(fake_gpu, gi)

    def destroy_gpu_instance(self, gpu: int, gpu_instance_id: int) -> None:
        with self.store.transaction() as state:
            fake_gpu, gs = live_gpu(self.node, state, gpu, f"nvmlGpuInstanceDestroy(GPU {gpu})")
            mig.destroy_gi(fake_gpu, gs, gpu_instance_id, state.processes)

    def compute_instance_profiles(
        self, gpu: int, gpu_instance_id: int
    ) -> list[ComputeInstanceProfile]:
        what = f"nvmlGpuInstanceGetComputeInstanceProfileInfoV(GPU {gpu}, GI {gpu_instance_id})"
        fake_gpu, gs = live_gpu(self.node, self.store.read(), gpu, what)
        return list(mig.ci_profiles(fake_gpu, mig.find_gi(fake_gpu, gs, gpu_instance_id, what)))

    def compute_instances(self, gpu: int, gpu_instance_id: int) -> list[ComputeInstance]:
        what = f"nvmlGpuInstanceGetComputeInstances(GPU {gpu}, GI {gpu_instance_id})"
        fake_gpu, gs = live_gpu(self.node, self.store.read(), gpu, what)
        gi = mig.find_gi(fake_gpu, gs, gpu_instance_id, what)
        return [self._compute_instance(fake_gpu, gi, ci.id) for ci in gi.compute_instances]

    def create_compute_instance(
        self, gpu: int, gpu_instance_id: int, profile_id: int
    ) -> ComputeInstance:
        with self.store.transaction() as state:
            what = f"nvmlGpuInstanceCreateComputeInstance(GPU {gpu})"
            fake_gpu, gs = live_gpu(self.node, state, gpu, what)
            ci = mig.create_ci(fake_gpu, gs, gpu_instance_id, profile_id)
            gi = mig.find_gi(fake_gpu, gs, gpu_instance_id, what)
            return self._compute_instance(fake_gpu, gi, ci.id)

    def destroy_compute_instance(
        self, gpu: int, gpu_instance_id: int, compute_instance_id: int
    ) -> None:
        with self.store.transaction() as state:
            what = f"nvmlComputeInstanceDestroy(GPU {gpu})"
            fake_gpu, gs = live_gpu(self.node, state, gpu, what)
            mig.destroy_ci(fake_gpu, gs, gpu_instance_id, compute_instance_id, state.processes)

    def mig_devices(self, gpu: int) -> list[MigDevice]:
        what = f"nvmlDeviceGetMigDeviceHandleByIndex(GPU {gpu})"
        fake_gpu, gs = live_gpu(self.node, self.store.read(), gpu, what)
        if not fake_gpu.model.mig_capable or not gs.mig_current:
            return []
        devices = []
        for gi in gs.gpu_instances:
            gi_profile = fake_gpu.gi_profile(gi.profile_id)
            assert gi_profile is not None
            ci_profiles = {p.id: p for p in fake_gpu.ci_profiles(gi_profile)}
            for ci in gi.compute_instances:
                devices.append(
                    MigDevice(
                        uuid=fake_gpu.mig_uuid(gi.id, ci.id),
                        parent_uuid=fake_gpu.uuid,
                        gpu_index=gpu,
                        gpu_instance_id=gi.id,
                        compute_instance_id=ci.id,
                        gpu_instance_profile_id=gi.profile_id,
                        compute_instance_profile_id=ci.profile_id,
                        profile=ci_profiles[ci.profile_id].name,
                        placement=Placement(gi.start, gi.size),
                        memory_bytes=gi_profile.memory_mib * MIB,
                        multiprocessors=ci_profiles[ci.profile_id].multiprocessors,
                    )
                )
        return devices

    # -- processes ------------------------------------------------------------------------
    def running_processes(self, device: DeviceRef) -> list[ProcessInfo]:
        return self._processes(device, False, f"nvmlDeviceGetComputeRunningProcesses({device})")

    def mps_processes(self, device: DeviceRef) -> list[ProcessInfo]:
        return self._processes(device, True, f"nvmlDeviceGetMPSComputeRunningProcesses({device})")

    def _processes(self, device: DeviceRef, mps_clients: bool, what: str) -> list[ProcessInfo]:
        state = self.store.read()
        target: Target = resolve(self.node, state, device, what)
        return [
            process_info(self.node, p)
            for p in live_processes(state)
            if target.holds(p) and p.mps_client == mps_clients
        ]

    def process_utilization(self, gpu: int, since_us: int = 0) -> list[ProcessUtilization]:
        what = f"nvmlDeviceGetProcessUtilization(GPU {gpu})"
        state = self.store.read()
        _, gs = live_gpu(self.node, state, gpu, what)
        if gs.mig_current:
            raise e.nvml_error(e.ERROR_NOT_SUPPORTED, what, "not available in MIG mode")
        now_us = int(self._wall_clock() * 1_000_000)
        period_us = self.node.config.utilization_sample_ms * 1000
        procs = [  # MPS clients have no samples of their own: their server's context runs them
            p
            for p in live_processes(state)
            if p.gpu == gpu and not p.mps_client and (p.sm_percent or p.memory_percent)
        ]
        if period_us:  # the driver's last sample, not "now": nothing new between its samples
            self._windows.forget_except({(p.gpu, p.pid) for p in live_processes(state)})
            for p in procs:
                self._windows.observe(p)
            now_us -= now_us % period_us
        if now_us <= since_us:
            return []
        sm = {p.pid: self._windows.sm_percent(p, period_us * 1000) for p in procs}
        listed = self._ticks.pick(gpu, now_us, sm)  # time-sliced: one context per tick
        return [
            ProcessUtilization(p.pid, now_us, listed[p.pid], p.memory_percent)
            for p in procs
            if p.pid in listed
        ]

    # -- compute mode ---------------------------------------------------------------------
    def compute_mode(self, gpu: int) -> ComputeMode:
        what = f"nvmlDeviceGetComputeMode(GPU {gpu})"
        _, gs = live_gpu(self.node, self.store.read(), gpu, what)
        return ComputeMode(gs.compute_mode)

    def set_compute_mode(self, gpu: int, mode: ComputeMode) -> None:
        what = f"nvmlDeviceSetComputeMode(GPU {gpu}, {mode})"
        with self.store.transaction() as state:
            _, gs = live_gpu(self.node, state, gpu, what)
            gs.compute_mode = ComputeMode(mode).value

    def set_compute_time_slice(self, gpu: int, level: int) -> None:
        what = f"nvidia-smi compute-policy --set-timeslice={level} (GPU {gpu})"
        if level not in TIME_SLICES.values():
            raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, what, "level must be 0..3")
        with self.store.transaction() as state:
            _, gs = live_gpu(self.node, state, gpu, what)
            gs.time_slice = level

    # -- memory partitioning (driver 615+) ------------------------------------------------
    def set_memory_limits(self, gpu: int, namespace: str, soft_limit: int, hard_limit: int) -> None:
        what = f"nvmlDeviceSetMemoryLimits_v1(GPU {gpu}, {namespace})"
        partition.require_driver(self.node, what)
        with self.store.transaction() as state:
            _, gs = live_gpu(self.node, state, gpu, what)
            if gs.mig_current:
                raise e.nvml_error(e.ERROR_NOT_SUPPORTED, what, "not available in MIG mode")
            path = partition.check_namespace(namespace, what)
            partition.set_limits(state, gpu, path, soft_limit, hard_limit, what)

    def memory_limits(self, gpu: int, namespace: str) -> MemoryLimits:
        what = f"nvmlDeviceGetMemoryLimits_v1(GPU {gpu}, {namespace})"
        partition.require_driver(self.node, what)
        state = self.store.read()
        _, gs = live_gpu(self.node, state, gpu, what)
        if gs.mig_current:
            raise e.nvml_error(e.ERROR_NOT_SUPPORTED, what, "not available in MIG mode")
        path = partition.check_namespace(namespace, what)
        soft, hard = partition.get_limits(state, gpu, path)
        return MemoryLimits(namespace, soft, hard, partition.used_in(state, gpu, path))

    # -- health ---------------------------------------------------------------------------
    def watch_events(self, gpus: Sequence[int] | None = None) -> EventWatch:
        indices = tuple(range(len(self.node.gpus))) if gpus is None else tuple(gpus)
        for index in indices:
            gpu_by_index(self.node, index, "nvmlDeviceRegisterEvents")
        return FakeEventWatch(
            self.node,
            self.store,
            indices,
            clock=self._clock,
            sleep=self._sleep,
            wall_clock=self._wall_clock,
            poll_interval_s=self._poll_interval_s,
        )

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def _gpu_instance(gpu: FakeGpu, gi: GiState) -> GpuInstance:
        profile = gpu.gi_profile(gi.profile_id)
        assert profile is not None
        return GpuInstance(
            gpu.index, gi.id, gi.profile_id, profile.name, Placement(gi.start, gi.size)
        )

    @staticmethod
    def _compute_instance(gpu: FakeGpu, gi: GiState, ci_id: int) -> ComputeInstance:
        ci = next(c for c in gi.compute_instances if c.id == ci_id)
        profiles = {p.id: p for p in mig.ci_profiles(gpu, gi)}
        return ComputeInstance(
            gpu_index=gpu.index,
            gpu_instance_id=gi.id,
            id=ci.id,
            profile_id=ci.profile_id,
            profile_name=profiles[ci.profile_id].name,
            placement=Placement(ci.start, ci.size),
            uuid=gpu.mig_uuid(gi.id, ci.id),
        )
