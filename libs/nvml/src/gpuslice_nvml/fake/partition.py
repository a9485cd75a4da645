"""Driver memory partitioning by cgroup, as the fake models it (driver release 615+).

* ``nvmlDeviceSetMemoryLimits_v1`` / ``…GetMemoryLimits_v1`` exist only on drivers 615 and
  newer: older fake drivers raise FUNCTION_NOT_FOUND, which is how a caller probes for them.
* Limits are recorded per (GPU, cgroup v2 directory). A GPU in MIG mode is NOT_SUPPORTED; a path
  that is not a directory of a mounted cgroup v2 hierarchy is NOT_FOUND (missing) or
  NOT_SUPPORTED (a cgroup v1 directory). Soft 0 + hard ``MEMORY_LIMIT_MAX`` clears; a removed
  cgroup loses its limits.
* A limit applies to every real process in the cgroup or below it. An allocation that would
  take the cgroup's use past its hard limit fails with NVML_ERROR_MEMORY (CUDA's out of
  memory), so the hard limit is the last byte that can be allocated.
"""

from __future__ import annotations

from pathlib import Path

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import procfs
from gpuslice_nvml.fake.activity import live_processes
from gpuslice_nvml.fake.node import FakeNode
from gpuslice_nvml.fake.state import MemoryLimitState, NodeState, ProcessState
from gpuslice_nvml.types import MEMORY_LIMIT_MAX, MEMORY_PARTITIONING_MIN_DRIVER, driver_major


def require_driver(node: FakeNode, what: str) -> None:
    if driver_major(node.driver_version) < MEMORY_PARTITIONING_MIN_DRIVER:
        raise e.nvml_error(
            e.ERROR_FUNCTION_NOT_FOUND,
            what,
            f"driver {node.driver_version} has no memory partitioning; it needs "
            f"{MEMORY_PARTITIONING_MIN_DRIVER} or newer",
        )


def check_namespace(namespace: str, what: str) -> str:
    """The normalized cgroup directory, or the NVML error for a bad one."""
    path = Path(namespace)
    if not path.is_absolute():
        raise e.nvml_error(
            e.ERROR_INVALID_ARGUMENT, what, "the namespace must be a cgroup's full sysfs path"
        )
    if not path.is_dir():
        raise e.nvml_error(e.ERROR_NOT_FOUND, what, f"no cgroup directory {namespace}")
    if not procfs.is_cgroup2_dir(path):
        raise e.nvml_error(
            e.ERROR_NOT_SUPPORTED,
            what,
            f"{namespace} is not in a cgroup v2 hierarchy; memory partitioning needs cgroup v2",
        )
    return str(path.resolve())


def prune(state: NodeState) -> None:
    """Forget the limits of cgroups that were removed (the driver clears them)."""
    state.memory_limits = [lim for lim in state.memory_limits if Path(lim.namespace).is_dir()]


def set_limits(state: NodeState, gpu: int, namespace: str, soft: int, hard: int, what: str) -> None:
    if soft < 0 or hard < 0 or soft > hard:
        raise e.nvml_error(
            e.ERROR_INVALID_ARGUMENT, what, f"need 0 <= soft <= hard, got soft {soft} hard {hard}"
        )
    prune(state)
    state.memory_limits = [
        lim for lim in state.memory_limits if not (lim.gpu == gpu and lim.namespace == namespace)
    ]
    if soft == 0 and hard == MEMORY_LIMIT_MAX:
        return
    state.memory_limits.append(
        MemoryLimitState(gpu=gpu, namespace=namespace, soft_limit=soft, hard_limit=hard)
    )


def get_limits(state: NodeState, gpu: int, namespace: str) -> tuple[int, int]:
    for lim in state.memory_limits:
        if lim.gpu == gpu and lim.namespace == namespace:
            return lim.soft_limit, lim.hard_limit
    return 0, MEMORY_LIMIT_MAX


def _cgroup_v2(process: ProcessState) -> Path | None:
    if not process.real:
        return None
    groups = procfs.cgroups_of(process.pid)
    return groups.v2 if groups else None


def used_in(state: NodeState, gpu: int, namespace: str, *, skip: ProcessState | None = None) -> int:
    """Memory the live real processes in cgroup ``namespace`` (or below) use on ``gpu``."""
    total = 0
    for p in live_processes(state):
        if p is skip or p.gpu != gpu:
            continue
        cgroup = _cgroup_v2(p)
        if cgroup is not None and procfs.within(cgroup, Path(namespace)):
            total += p.used_memory
    return total


def check_allocation(state: NodeState, process: ProcessState, new_used: int, what: str) -> None:
    """Refuse taking ``process`` to ``new_used`` bytes when a hard limit of its cgroup (or of an
    ancestor cgroup) on its GPU would be exceeded."""
    if not state.memory_limits or new_used <= process.used_memory:
        return
    cgroup = _cgroup_v2(process)
    if cgroup is None:
        return
    prune(state)
    for lim in state.memory_limits:
        if lim.gpu != process.gpu or not procfs.within(cgroup, Path(lim.namespace)):
            continue
        others = used_in(state, process.gpu, lim.namespace, skip=process)
        if others + new_used > lim.hard_limit:
            raise e.nvml_error(
                e.ERROR_MEMORY,
                what,
                f"out of memory: cgroup {lim.namespace} has a hard limit of {lim.hard_limit} "
                f"bytes on GPU {lim.gpu}; {others + process.used_memory} in use, "
                f"{new_used - process.used_memory} more asked",
            )
