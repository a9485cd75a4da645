"""The MPS supervisor: a thread that, every ``SUPERVISE_INTERVAL_S``, restarts MPS daemons that
died (``ShareManager.supervise``) and, every ``PRUNE_INTERVAL_S``, forgets containers that are
gone without a poststop hook (``ShareManager.prune``)."""

from __future__ import annotations

import threading
import time

import structlog

from gpuslice_core.logging import get_logger
from gpuslice_enforcer.shares import ShareManager
from gpuslice_enforcer.throttledlog import Throttled

log = get_logger(__name__)

SUPERVISE_INTERVAL_S = 1.0
#: How often containers that are gone without a poststop hook are forgotten.
PRUNE_INTERVAL_S = 5.0


class MpsSupervisor:
    def __init__(self, shares: ShareManager) -> None:
        self.shares = shares
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="mps-supervisor")
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _supervise(self) -> None:
        structlog.contextvars.bind_contextvars(thread="mps-supervisor")
        next_prune = time.monotonic() + PRUNE_INTERVAL_S
        # An OSError here (out of file descriptors, a full disk) recurs every second: one line
        # per 10 s, without a traceback; anything else is a bug and logged in full.
        supervise_failed = Throttled("mps supervision failed")
        prune_failed = Throttled("pruning gone containers failed")
        while not self._stop.wait(SUPERVISE_INTERVAL_S):
            try:
                self.shares.supervise()
            except OSError as exc:
                supervise_failed(error=str(exc))
            except Exception:
                log.exception("mps supervision failed")
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + PRUNE_INTERVAL_S
                try:
                    self.shares.prune()
                except OSError as exc:
                    prune_failed(error=str(exc))
                except Exception:
                    log.exception("pruning gone containers failed")
