"""Finding GPUs, MIG devices and processes in the fake's state, with NVML's errors."""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake.activity import live_processes
from gpuslice_nvml.fake.node import FakeGpu, FakeNode
from gpuslice_nvml.fake.state import GiState, GpuState, NodeState, ProcessState
from gpuslice_nvml.types import MIB, DeviceRef, ProcessInfo


@dataclass(frozen=True)
class Target:
    """A resolved device: a whole GPU, or one MIG device (GPU instance + compute instance)."""

    gpu: FakeGpu
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def uuid(self) -> str:
        if self.gpu_instance_id is None or self.compute_instance_id is None:
            return self.gpu.uuid
        return self.gpu.mig_uuid(self.gpu_instance_id, self.compute_instance_id)

    def holds(self, process: ProcessState) -> bool:
        """Whether ``process`` runs on this device (a GPU holds its MIG devices' processes)."""
        if process.gpu != self.gpu.index:
            return False
        if self.gpu_instance_id is None:
            return True
        return (
            process.gpu_instance_id == self.gpu_instance_id
            and process.compute_instance_id == self.compute_instance_id
        )


def gpu_by_index(node: FakeNode, index: int, what: str) -> FakeGpu:
    if not 0 <= index < len(node.gpus):
        raise e.nvml_error(
            e.ERROR_INVALID_ARGUMENT, what, f"no GPU {index}; the node has {len(node.gpus)}"
        )
    return node.gpus[index]


def live_gpu(node: FakeNode, state: NodeState, index: int, what: str) -> tuple[FakeGpu, GpuState]:
    """The GPU and its state, or ``NvmlGpuLost`` if it fell off the bus."""
    gpu = gpu_by_index(node, index, what)
    gs = state.gpus[index]
    if gs.lost:
        raise e.nvml_error(e.ERROR_GPU_IS_LOST, what, f"GPU {index} ({gpu.uuid}) is lost")
    return gpu, gs


def resolve(node: FakeNode, state: NodeState, device: DeviceRef, what: str) -> Target:
    """Resolve an index or UUID like ``nvmlDeviceGetHandleBy{Index,UUID}`` does."""
    if isinstance(device, int):
        live_gpu(node, state, device, what)
        return Target(node.gpus[device])
    if device.startswith("GPU-"):
        for gpu in node.gpus:
            if gpu.uuid == device:
                live_gpu(node, state, gpu.index, what)
                return Target(gpu)
    elif device.startswith("MIG-"):
        for gpu in node.gpus:
            for gi in state.gpus[gpu.index].gpu_instances:
                for ci in gi.compute_instances:
                    if gpu.mig_uuid(gi.id, ci.id) == device:
                        live_gpu(node, state, gpu.index, what)
                        return Target(gpu, gi.id, ci.id)
    else:
        raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, what, f"{device!r} is not a GPU or MIG UUID")
    raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"no device has UUID {device}")


def gpu_instance(state: NodeState, target: Target) -> GiState | None:
    if target.gpu_instance_id is None:
        return None
    gis = state.gpus[target.gpu.index].gpu_instances
    return next((gi for gi in gis if gi.id == target.gpu_instance_id), None)


def memory_total(state: NodeState, target: Target) -> int:
    """The GPU's framebuffer, or the GPU instance's memory for a MIG device."""
    gi = gpu_instance(state, target)
    if gi is None:
        return target.gpu.model.memory_bytes
    profile = target.gpu.gi_profile(gi.profile_id)
    assert profile is not None
    return profile.memory_mib * MIB


def memory_used(state: NodeState, target: Target) -> int:
    """Memory used on the device; a MIG device's compute instances share their GPU instance's."""
    running = live_processes(state)
    if target.gpu_instance_id is None:
        procs = [p for p in running if p.gpu == target.gpu.index]
    else:
        procs = [
            p
            for p in running
            if p.gpu == target.gpu.index and p.gpu_instance_id == target.gpu_instance_id
        ]
    return sum(p.used_memory for p in procs)


def process_info(node: FakeNode, process: ProcessState) -> ProcessInfo:
    gpu = node.gpus[process.gpu]
    target = Target(gpu, process.gpu_instance_id, process.compute_instance_id)
    return ProcessInfo(
        pid=process.pid,
        gpu_index=process.gpu,
        device_uuid=target.uuid,
        used_memory_bytes=process.used_memory,
        gpu_instance_id=process.gpu_instance_id,
        compute_instance_id=process.compute_instance_id,
    )
