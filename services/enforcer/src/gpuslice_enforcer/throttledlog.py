"""One log line per ``LOG_EVERY_S`` at most for an event that recurs (a socket that cannot
accept, a loop that fails every second): the attach socket and the MPS supervisor use it."""

from __future__ import annotations

import time
from collections.abc import Callable

from gpuslice_core.logging import get_logger

log = get_logger(__name__)

#: At most one line per recurring event in this many seconds.
LOG_EVERY_S = 10.0


class Throttled:
    """One log line per ``every`` seconds at most for a recurring event; each line says how
    many times it happened since the last one."""

    def __init__(
        self, event: str, every: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.event = event
        self.every = every
        self.clock = clock
        self.count = 0
        self._last: float | None = None

    def __call__(self, **fields: object) -> bool:
        """Count one occurrence; True when it was logged."""
        self.count += 1
        now = self.clock()
        if self._last is not None and now - self._last < self.every:
            return False
        log.warning(self.event, occurrences=self.count, **fields)
        self._last, self.count = now, 0
        return True
