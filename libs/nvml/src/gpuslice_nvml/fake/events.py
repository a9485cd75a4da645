"""Health events of the fake node: an event set that polls the shared state file.

Events are appended to the state file by the control API (another process, usually). A watch
remembers the sequence number it started at and, in :meth:`FakeEventWatch.wait`, checks the
file's stamp (inode, mtime, size) every ``poll_interval_s`` and reads it only when it changed,
until an event arrives or the timeout passes. Clock and sleep are injectable so timeouts can be
tested without waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from gpuslice_nvml import errors as e
from gpuslice_nvml.fake.node import FakeNode
from gpuslice_nvml.fake.state import EventState, FileStamp, NodeState, StateStore
from gpuslice_nvml.interface import EventWatch
from gpuslice_nvml.types import HealthEvent, HealthEventKind


class FakeEventWatch(EventWatch):
    def __init__(
        self,
        node: FakeNode,
        store: StateStore,
        gpus: tuple[int, ...],
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        wall_clock: Callable[[], float],
        poll_interval_s: float,
    ) -> None:
        self._node = node
        self._store = store
        self._gpus = gpus
        self._clock = clock
        self._sleep = sleep
        self._poll_interval_s = poll_interval_s
        self._pending: deque[HealthEvent] = deque()
        self._closed = False
        self._stamp: FileStamp | None = store.stamp()
        state = store.read()
        self._cursor = state.next_event_seq
        # Registering a lost GPU fails in NVML; the watch reports it as lost instead.
        for index in gpus:
            if state.gpus[index].lost:
                gpu = node.gpus[index]
                self._pending.append(
                    HealthEvent(HealthEventKind.GPU_LOST, index, gpu.uuid, timestamp=wall_clock())
                )

    @property
    def gpus(self) -> tuple[int, ...]:
        return self._gpus

    def wait(self, timeout_s: float) -> HealthEvent | None:
        if self._closed:
            raise e.nvml_error(e.ERROR_INVALID_ARGUMENT, "nvmlEventSetWait", "event set is freed")
        deadline = self._clock() + max(timeout_s, 0.0)
        while not self._pending:
            stamp = self._store.stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                self._collect(self._store.read())
                continue
            remaining = deadline - self._clock()
            if remaining <= 0:
                return None
            self._sleep(min(self._poll_interval_s, remaining))
        return self._pending.popleft()

    def close(self) -> None:
        self._closed = True
        self._pending.clear()

    def _collect(self, state: NodeState) -> None:
        for event in state.events:
            if event.seq < self._cursor:
                continue
            self._cursor = event.seq + 1
            if event.gpu in self._gpus:
                self._pending.append(self._convert(event))

    def _convert(self, event: EventState) -> HealthEvent:
        return HealthEvent(
            kind=HealthEventKind(event.kind),
            gpu_index=event.gpu,
            gpu_uuid=self._node.gpus[event.gpu].uuid,
            xid=event.xid,
            gpu_instance_id=event.gpu_instance_id,
            compute_instance_id=event.compute_instance_id,
            timestamp=event.time,
        )
