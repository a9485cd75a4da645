"""The GPU compute time slice that NVIDIA's ``timeSlicingConfig.interval`` asks for.

NVIDIA's DRA driver sets a time-sliced GPU's time slice at prepare with ``nvidia-smi
compute-policy -i <UUID> --set-timeslice=<n>`` (Default 0, Short 1, Medium 2, Long 3); NVML has
no call for it. The plugin does the same, through ``Nvml.set_compute_time_slice`` (the real
backend runs the driver root's ``nvidia-smi``, the fake records it in the fake node):

- the interval of each whole GPU is in the claim's checkpoint record (``DeviceRecord.time_slice``)
  from the intent on, so teardown after a kill -9 knows what was set;
- a GPU has one time slice: in the checkpoint transaction that writes the intent (next to the
  overlap check), a claim whose interval differs from the one another claim recorded on the same
  GPU is refused, naming both intervals and the GPU (:func:`check_time_slices`);
- after the intent is durable the interval is set (:meth:`TimeSlicer.apply`; idempotent);
- teardown (unprepare, rollback, recovery of a dead instance's claim) puts the GPU back to
  ``Default`` when no other claim that is not itself being torn down records an interval on it
  (:meth:`TimeSlicer.release`).

A claim without an interval leaves the GPU's time slice as it is. docs/nvidia-config.md says why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from gpuslice_api.nvconfig import TIME_SLICE
from gpuslice_core.logging import get_logger
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, PluginState
from gpuslice_kubelet_plugin.claims import ClaimError
from gpuslice_kubelet_plugin.plan import Plan
from gpuslice_nvml import Nvml
from gpuslice_nvml.types import TIME_SLICES

log = get_logger(__name__)

DEFAULT = "Default"


def wanted(record: ClaimRecord) -> dict[str, str]:
    """GPU UUID -> the interval the claim set on it."""
    return {d.gpu_uuid: d.time_slice for d in record.devices if d.time_slice and d.gpu_uuid}


def _others(state: PluginState, uid: str, gpu_uuid: str) -> Iterable[tuple[ClaimRecord, str]]:
    """(claim, interval) of the other claims that hold an interval on the GPU; one being torn
    down holds none any more (two claims torn down at once must not keep each other's)."""
    for claim in state.claims.values():
        if claim.uid == uid or claim.state == "UnprepareStarted":
            continue
        for d in claim.devices:
            if d.gpu_uuid == gpu_uuid and d.time_slice:
                yield claim, d.time_slice


def check_time_slices(plan: Plan, state: PluginState) -> None:
    """``ClaimError`` (TimeSliceConflict) when the plan asks a GPU for an interval another claim
    set to something else."""
    for planned in plan.devices:
        want = planned.time_slice
        if want is None:
            continue
        gpu = planned.device.gpu_uuid
        for other, interval in _others(state, plan.uid, gpu):
            if interval != want:
                raise ClaimError(
                    "TimeSliceConflict",
                    f"request {planned.result.request}: {planned.config.origin} {TIME_SLICE} "
                    f"{want!r} for GPU {gpu} ({planned.device.name}) conflicts with "
                    f"{interval!r}, which ResourceClaim {other.ref} set on it; a GPU has one "
                    f"time slice: ask for {interval!r} (or no interval), or for another GPU",
                )


class TimeSlicer:
    """Sets and restores GPUs' time slices; one lock per GPU orders the decisions of concurrent
    prepares and unprepares on it (each decides from the committed state, under the lock)."""

    def __init__(self, nvml: Nvml, gpu_index: Callable[[str], int | None]) -> None:
        self.nvml = nvml
        self.gpu_index = gpu_index
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, gpu_uuid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(gpu_uuid, threading.Lock())

    def _set(self, gpu_uuid: str, interval: str) -> None:
        index = self.gpu_index(gpu_uuid)
        if index is None:  # gone from the node: nothing left to set
            log.warning("time slice not set: the GPU is gone", gpu=gpu_uuid, interval=interval)
            return
        self.nvml.set_compute_time_slice(index, TIME_SLICES[interval])
        log.info("time slice set", gpu=gpu_uuid, interval=interval)

    def apply(self, record: ClaimRecord) -> None:
        """Set each GPU's interval the claim asks for (after its intent is committed)."""
        for gpu_uuid, interval in wanted(record).items():
            with self._lock(gpu_uuid):
                self._set(gpu_uuid, interval)

    def release(self, record: ClaimRecord, state: Callable[[], PluginState]) -> None:
        """Put each GPU the claim set an interval on back to Default, unless another claim
        still holds one there."""
        for gpu_uuid in wanted(record):
            with self._lock(gpu_uuid):
                if next(iter(_others(state(), record.uid, gpu_uuid)), None) is None:
                    self._set(gpu_uuid, DEFAULT)
