"""Who may hold a CUDA context on a fake GPU: MPS clients, bypassing processes, compute mode.

A real CUDA process, at its first CUDA call, tries the MPS control daemon of
``$CUDA_MPS_PIPE_DIRECTORY`` (``/tmp/nvidia-mps`` when unset). If a daemon answers there and
serves the process's GPU, the process becomes an *MPS client*: its work runs inside the MPS
server's context, NVML lists it with ``nvmlDeviceGetMPSComputeRunningProcesses`` and not with
``nvmlDeviceGetComputeRunningProcesses``, and its SM use shows only as the server's. If no daemon
answers, the process silently runs without MPS, in a context of its own next to the server —
the way out of an MPS share that the enforcer must close.

The GPU's compute mode decides whether such a context may exist: ``EXCLUSIVE_PROCESS`` admits one
process with a context at a time (the MPS server counts as one: its clients share it), so a
process that does not go through MPS is refused while the server — or anyone — holds the GPU,
and an MPS client is refused while another process holds it. ``PROHIBITED`` admits nobody.
Refusals raise ``NvmlInUse``; the CUDA program would see ``CUDA_ERROR_DEVICES_UNAVAILABLE``.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake import procfs
from gpuslice_nvml.fake.activity import live_processes
from gpuslice_nvml.fake.state import NodeState, ProcessState
from gpuslice_nvml.types import ComputeMode

#: Where CUDA looks for the MPS control daemon when the variable is unset.
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
#: Files the MPS control stand-in (``fake.mps_control``) keeps in its pipe directory.
PID_FILE = "nvidia-cuda-mps-control.pid"
STATE_FILE = ".gpuslice-fake-mps.json"
#: A protocol-3 namespace directory lies this far below its daemon's pipe directory
#: (``<pipe>/<server>/<namespace>``).
NAMESPACE_DEPTH = 2


def serving_daemon(pipe_dir: str | None, gpu_uuid: str) -> bool:
    """Whether a live MPS control daemon answers at ``pipe_dir`` (or the namespace directory
    of one) and serves ``gpu_uuid``: then a CUDA process there becomes its client."""
    start = Path(pipe_dir or DEFAULT_PIPE_DIRECTORY)
    for directory in [start, *list(start.parents)[:NAMESPACE_DEPTH]]:
        if not (directory / "control").exists():
            continue
        try:
            pid = int((directory / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            continue
        if not procfs.alive(pid, None):
            continue
        try:
            visible = json.loads((directory / STATE_FILE).read_text()).get("visibleDevices")
        except (OSError, ValueError):
            visible = None
        return not visible or gpu_uuid in str(visible).split(",")
    return False


def admit(state: NodeState, process: ProcessState, what: str) -> None:
    """Refuse a new context the GPU's compute mode does not allow (``NvmlInUse``)."""
    mode = ComputeMode(state.gpus[process.gpu].compute_mode)
    if mode is ComputeMode.DEFAULT or process.gpu_instance_id is not None:
        return
    if mode is ComputeMode.PROHIBITED:
        raise e.nvml_error(e.ERROR_IN_USE, what, f"GPU {process.gpu} is in PROHIBITED compute mode")
    others = [
        p
        for p in live_processes(state)
        if p.gpu == process.gpu and p.pid != process.pid and p.gpu_instance_id is None
    ]
    holders = others if not process.mps_client else [p for p in others if not p.mps_client]
    if holders:
        holder = "the MPS server" if holders[0].mps_client else f"pid {holders[0].pid}"
        raise e.nvml_error(
            e.ERROR_IN_USE,
            what,
            f"GPU {process.gpu} is in {mode.value} compute mode and {holder} holds it "
            "(CUDA: CUDA_ERROR_DEVICES_UNAVAILABLE)",
        )
