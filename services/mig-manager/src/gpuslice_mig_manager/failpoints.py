"""Failpoints: named places where a test makes the process die as ``kill -9`` would.

The one kind of test support the product keeps, because the crash must happen inside the real
process, between two steps of a MIG change. ``GPUSLICE_MIG_MANAGER_CRASH_AT=<point>`` makes the
process SIGKILL itself when it reaches ``<point>``, so a test proves that a kill -9 there leaks
nothing (services/mig-manager/tests/test_crash.py). Points:

- ``after-create-gpu-instance``: the GPU instance exists, its compute instance does not yet.
- ``after-destroy-compute-instance``: the compute instance is gone, its GPU instance is not.

Unset (always, outside tests) a failpoint costs one dictionary lookup. The chart never sets it.
"""

from __future__ import annotations

import os
import signal

ENV = "GPUSLICE_MIG_MANAGER_CRASH_AT"


def crash_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
