"""Health events through an NVML event set (``nvmlEventSetCreate`` / ``nvmlEventSetWait``).

Registers XID critical errors, double-bit ECC errors and GPU-unavailable events (where the
driver offers them) on each GPU, like the NVIDIA device plugin. A GPU that cannot register
because it is lost, or that makes the wait fail with GPU_IS_LOST, is reported as a GPU_LOST
event instead of failing the watch.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import pynvml

from gpuslice_nvml import errors as e
from gpuslice_nvml.interface import EventWatch
from gpuslice_nvml.real.calls import call, error_code, map_error, text
from gpuslice_nvml.real.mig import instance_id
from gpuslice_nvml.types import HealthEvent, HealthEventKind

XID_CRITICAL = 0x8
DOUBLE_BIT_ECC = 0x2
GPU_UNAVAILABLE = 0x4000
WANTED = XID_CRITICAL | DOUBLE_BIT_ECC | GPU_UNAVAILABLE


class RealEventWatch(EventWatch):
    def __init__(
        self, handles: dict[int, Any], uuids: dict[int, str], lost: Sequence[int] = ()
    ) -> None:
        """``lost``: GPUs that were lost before the watch (reported as GPU_LOST at once)."""
        self._uuids = uuids
        self._pending: deque[HealthEvent] = deque(self._lost(i) for i in lost)
        self._registered: dict[int, Any] = {}
        #: GPUs whose driver cannot deliver these events (too old); they get none.
        self.unsupported: list[int] = []
        self._set = call("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)
        try:
            for index, h in handles.items():
                self._register(index, h)
        except BaseException:
            self.close()
            raise

    def _register(self, index: int, h: Any) -> None:
        try:
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(h)
            mask = WANTED & supported
            if not mask:
                self.unsupported.append(index)
                return
            pynvml.nvmlDeviceRegisterEvents(h, mask, self._set)
        except pynvml.NVMLError as exc:
            code = error_code(exc)
            if code == e.ERROR_GPU_IS_LOST:
                self._pending.append(self._lost(index))
                return
            if code == e.ERROR_NOT_SUPPORTED:
                self.unsupported.append(index)
                return
            raise map_error(exc, f"nvmlDeviceRegisterEvents(GPU {index})") from exc
        self._registered[index] = h

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted(self._registered))

    def wait(self, timeout_s: float) -> HealthEvent | None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while not self._pending:
            remaining_ms = max(int((deadline - time.monotonic()) * 1000), 0)
            try:
                data = pynvml.nvmlEventSetWait(self._set, remaining_ms)
            except pynvml.NVMLError as exc:
                code = error_code(exc)
                if code == e.ERROR_TIMEOUT:
                    return None
                if code == e.ERROR_GPU_IS_LOST and self._find_lost():
                    continue
                raise map_error(exc, "nvmlEventSetWait") from exc
            event = self._convert(data)
            if event is not None:
                return event
            if remaining_ms == 0:
                return None
        return self._pending.popleft()

    def close(self) -> None:
        if self._set is not None:
            with contextlib.suppress(pynvml.NVMLError):  # nothing to recover on the way out
                pynvml.nvmlEventSetFree(self._set)
            self._set = None

    def _find_lost(self) -> bool:
        """After GPU_IS_LOST, find which registered GPUs stopped answering."""
        for index, h in list(self._registered.items()):
            try:
                pynvml.nvmlDeviceGetMemoryInfo(h)
            except pynvml.NVMLError as exc:
                if error_code(exc) == e.ERROR_GPU_IS_LOST:
                    del self._registered[index]
                    self._pending.append(self._lost(index))
        return bool(self._pending)

    def _lost(self, index: int) -> HealthEvent:
        return HealthEvent(
            HealthEventKind.GPU_LOST, index, self._uuids[index], timestamp=time.time()
        )

    def _index_of(self, device: Any) -> int | None:
        """The GPU an event names, by its handle: a GPU-unavailable event comes from a GPU that
        may answer no call (nvmlDeviceGetUUID is GPU_IS_LOST there), so ask only as a fallback."""
        address = ctypes.cast(device, ctypes.c_void_p).value
        for index, h in self._registered.items():
            if ctypes.cast(h, ctypes.c_void_p).value == address:
                return index
        uuid = text(call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, device))
        return next((i for i, u in self._uuids.items() if u == uuid), None)

    def _convert(self, data: Any) -> HealthEvent | None:
        index = self._index_of(data.device)
        if index is None:
            return None
        uuid = self._uuids[index]
        if data.eventType & XID_CRITICAL:
            kind, xid = HealthEventKind.XID, int(data.eventData)
        elif data.eventType & DOUBLE_BIT_ECC:
            kind, xid = HealthEventKind.ECC_DOUBLE_BIT, None
        elif data.eventType & GPU_UNAVAILABLE:
            kind, xid = HealthEventKind.GPU_LOST, None
        else:
            return None
        return HealthEvent(
            kind=kind,
            gpu_index=index,
            gpu_uuid=uuid,
            xid=xid,
            gpu_instance_id=instance_id(data.gpuInstanceId),
            compute_instance_id=instance_id(data.computeInstanceId),
            timestamp=time.time(),
        )
