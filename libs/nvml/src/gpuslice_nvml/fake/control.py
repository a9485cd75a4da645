"""``FakeNvmlControl``: drive a fake node the way the world drives a real one.

Tests and the ``ctl`` command use it to start and stop "processes" on GPUs and MIG devices
(with memory and SM use), to inject XID errors and to make GPUs fall off the bus. Every change
goes through the shared state file, so the services reading the same fake node see it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import activity, contexts, partition
from gpuslice_nvml.fake.activity import SmAccounting, live_processes
from gpuslice_nvml.fake.lookup import gpu_by_index, memory_total, memory_used, resolve
from gpuslice_nvml.fake.lookup import process_info as _process_info
from gpuslice_nvml.fake.node import FakeNode, load_node
from gpuslice_nvml.fake.state import (
    EventState,
    MemoryLimitState,
    NodeState,
    ProcessState,
    StateStore,
)
from gpuslice_nvml.types import DeviceRef, HealthEvent, HealthEventKind, ProcessInfo


class FakeNvmlControl:
    """Changes a fake node's state from outside the NVML interface."""

    def __init__(self, node: FakeNode, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self.store = StateStore(node.state_path, node.digest, node.initial_state)
        self._wall_clock = wall_clock

    @classmethod
    def from_config_file(cls, path: str | Path) -> FakeNvmlControl:
        return cls(load_node(path))

    # -- processes ------------------------------------------------------------------------
    def add_process(
        self,
        pid: int,
        device: DeviceRef,
        *,
        used_memory_bytes: int = 0,
        sm_percent: int = 0,
        memory_percent: int = 0,
        real: bool = False,
        accounting: str = "constant",
        mps_pipe_dir: str | None = None,
    ) -> ProcessInfo:
        """Start (or update) process ``pid`` on a GPU or MIG device.

        On a GPU in MIG mode processes run on MIG devices, so ``device`` must be a MIG UUID.
        The memory must fit in what the device has free (``NvmlInsufficientMemory``).

        ``real=True`` binds the fake process to the live OS process ``pid`` (see
        ``gpuslice_nvml.fake.activity``): it vanishes when that process exits, its memory counts
        against the memory-partitioning limits of its cgroup (an allocation past a hard limit is
        ``NvmlInsufficientMemory``), and it uses no SM while frozen; ``accounting="runnable"``
        measures its SM use from its runnable time (for processes that spin).

        ``mps_pipe_dir`` is the process's ``CUDA_MPS_PIPE_DIRECTORY`` (``None``: unset, CUDA's
        default). Where a live MPS control daemon serving the GPU answers there, the process is
        an MPS client; otherwise it has a context of its own, which the GPU's compute mode may
        refuse (``NvmlInUse``; see ``gpuslice_nvml.fake.contexts``).
        """
        what = f"add process {pid} on {device}"
        _check_percent(sm_percent, "sm_percent", what)
        _check_percent(memory_percent, "memory_percent", what)
        if pid <= 0 or used_memory_bytes < 0:
            raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, what, "pid must be > 0, memory >= 0")
        with self.store.transaction() as state:
            target = resolve(self.node, state, device, what)
            if target.gpu_instance_id is None and state.gpus[target.gpu.index].mig_current:
                raise e.nvml_error(
                    e.ERROR_INVALID_ARGUMENT,
                    what,
                    f"GPU {target.gpu.index} is in MIG mode; start the process on a MIG device",
                )
            old = [p for p in state.processes if p.pid == pid and target.holds(p)]
            state.processes = [p for p in state.processes if not (p.pid == pid and target.holds(p))]
            free = memory_total(state, target) - memory_used(state, target)
            if used_memory_bytes > free:
                raise e.nvml_error(
                    e.ERROR_MEMORY, what, f"{used_memory_bytes} bytes asked, {free} free"
                )
            process = ProcessState(
                pid=pid,
                gpu=target.gpu.index,
                gpu_instance_id=target.gpu_instance_id,
                compute_instance_id=target.compute_instance_id,
                used_memory=0,
                sm_percent=sm_percent,
                memory_percent=memory_percent,
                mps_client=(
                    target.gpu_instance_id is None
                    and contexts.serving_daemon(mps_pipe_dir, target.gpu.uuid)
                ),
            )
            if old and activity.live(old[0]):
                process.mps_client = old[0].mps_client  # an update keeps the context it has
            else:
                contexts.admit(state, process, what)
            if real:
                activity.attach_real(process, accounting, self._now_ns(), what)
                if old and activity.live(old[0]):
                    activity.carry_over(old[0], process)
                partition.check_allocation(state, process, used_memory_bytes, what)
            process.used_memory = used_memory_bytes
            state.processes.append(process)
            return _process_info(self.node, process)

    def allocate_memory(self, pid: int, device: DeviceRef, nbytes: int) -> ProcessInfo:
        """Process ``pid`` allocates ``nbytes`` more on ``device`` (``cudaMalloc``).

        Fails with ``NvmlInsufficientMemory`` when the device has less free, or when it would
        take the process's cgroup past a memory-partitioning hard limit; nothing changes then.
        A negative ``nbytes`` frees memory.
        """
        what = f"process {pid} allocates {nbytes} bytes on {device}"
        with self.store.transaction() as state:
            target = resolve(self.node, state, device, what)
            process = next(
                (p for p in live_processes(state) if p.pid == pid and target.holds(p)), None
            )
            if process is None:
                raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"no process {pid} on {device}")
            new_used = process.used_memory + nbytes
            if new_used < 0:
                raise e.nvml_error(
                    e.ERROR_INVALID_ARGUMENT, what, f"it holds only {process.used_memory} bytes"
                )
            free = memory_total(state, target) - memory_used(state, target)
            if nbytes > free:
                raise e.nvml_error(e.ERROR_MEMORY, what, f"{nbytes} bytes asked, {free} free")
            partition.check_allocation(state, process, new_used, what)
            process.used_memory = new_used
            return _process_info(self.node, process)

    def sm_accounting(self, pid: int, device: DeviceRef | None = None) -> SmAccounting:
        """The SM use a runnable-accounted process achieved since it was registered, measured
        from the kernel's runnable time (so frozen time counts as no SM use)."""
        what = f"SM accounting of process {pid}"
        state = self.store.read()
        target = None if device is None else resolve(self.node, state, device, what)
        process = next(
            (
                p
                for p in live_processes(state)
                if p.pid == pid and (target is None or target.holds(p))
            ),
            None,
        )
        if process is None:
            raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"no live process {pid}")
        return activity.accounting(process, self._now_ns(), what)

    def memory_limit_records(self) -> list[MemoryLimitState]:
        """Every memory-partitioning limit set through NVML (cgroups that still exist)."""
        state = self.store.read()
        partition.prune(state)
        return list(state.memory_limits)

    def _now_ns(self) -> int:
        return int(self._wall_clock() * 1e9)

    def remove_process(self, pid: int, device: DeviceRef | None = None) -> int:
        """End process ``pid`` (on one device, or everywhere); returns how many were removed."""
        with self.store.transaction() as state:
            target = None if device is None else resolve(self.node, state, device, "remove")
            kept = [
                p
                for p in state.processes
                if not (p.pid == pid and (target is None or target.holds(p)))
            ]
            removed = len(state.processes) - len(kept)
            state.processes = kept
            return removed

    def set_process_utilization(
        self, pid: int, device: DeviceRef, *, sm_percent: int, memory_percent: int = 0
    ) -> None:
        """Set the SM/memory utilization samples NVML reports for a running process."""
        what = f"set utilization of process {pid} on {device}"
        _check_percent(sm_percent, "sm_percent", what)
        _check_percent(memory_percent, "memory_percent", what)
        with self.store.transaction() as state:
            target = resolve(self.node, state, device, what)
            matches = [p for p in state.processes if p.pid == pid and target.holds(p)]
            if not matches:
                raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"no process {pid} on {device}")
            for p in matches:
                activity.fold(p, p.sm_percent)
                p.sm_percent = sm_percent
                p.memory_percent = memory_percent

    def processes(self) -> list[ProcessInfo]:
        """Every process on the node."""
        return [_process_info(self.node, p) for p in live_processes(self.store.read())]

    # -- health ---------------------------------------------------------------------------
    def inject_xid(
        self,
        gpu: int,
        code: int,
        *,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> HealthEvent:
        """Raise an XID critical error on a GPU (or one of its MIG instances)."""
        what = f"inject XID {code} on GPU {gpu}"
        if code <= 0:
            raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, what, "XID codes are positive")
        if compute_instance_id is not None and gpu_instance_id is None:
            raise e.nvml_error(
                e.ERROR_INVALID_ARGUMENT, what, "a compute instance needs its GPU instance"
            )
        with self.store.transaction() as state:
            fake_gpu = gpu_by_index(self.node, gpu, what)
            if gpu_instance_id is not None:
                gis = {gi.id: gi for gi in state.gpus[gpu].gpu_instances}
                gi = gis.get(gpu_instance_id)
                if gi is None or (
                    compute_instance_id is not None
                    and all(ci.id != compute_instance_id for ci in gi.compute_instances)
                ):
                    raise e.nvml_error(
                        e.ERROR_NOT_FOUND, what, "no such GPU/compute instance on the GPU"
                    )
            return self._emit(
                state,
                HealthEvent(
                    HealthEventKind.XID,
                    gpu,
                    fake_gpu.uuid,
                    xid=code,
                    gpu_instance_id=gpu_instance_id,
                    compute_instance_id=compute_instance_id,
                    timestamp=self._wall_clock(),
                ),
            )

    def mark_gpu_lost(self, gpu: int) -> HealthEvent | None:
        """The GPU falls off the bus: NVML calls on it raise ``NvmlGpuLost`` and watchers get a
        ``GPU_LOST`` event. Returns ``None`` if it was already lost."""
        with self.store.transaction() as state:
            fake_gpu = gpu_by_index(self.node, gpu, f"mark GPU {gpu} lost")
            if state.gpus[gpu].lost:
                return None
            state.gpus[gpu].lost = True
            event = HealthEvent(
                HealthEventKind.GPU_LOST, gpu, fake_gpu.uuid, timestamp=self._wall_clock()
            )
            return self._emit(state, event)

    def mark_gpu_recovered(self, gpu: int) -> None:
        """The GPU answers again (as after a successful reset); MIG instances are kept."""
        with self.store.transaction() as state:
            gpu_by_index(self.node, gpu, f"mark GPU {gpu} recovered")
            state.gpus[gpu].lost = False

    # -- whole node -----------------------------------------------------------------------
    def state(self) -> NodeState:
        """A snapshot of the shared state."""
        return self.store.read()

    def reset_state(self) -> NodeState:
        """Start the node over from its config (MIG layout, no processes, no events kept)."""
        return self.store.reset()

    @staticmethod
    def _emit(state: NodeState, event: HealthEvent) -> HealthEvent:
        state.add_event(
            EventState(
                seq=0,
                gpu=event.gpu_index,
                kind=event.kind.value,
                xid=event.xid,
                gpu_instance_id=event.gpu_instance_id,
                compute_instance_id=event.compute_instance_id,
                time=event.timestamp,
            )
        )
        return event


def _check_percent(value: int, name: str, what: str) -> None:
    if not 0 <= value <= 100:
        raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, what, f"{name} must be 0..100, got {value}")
