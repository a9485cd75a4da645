"""Test-only crash points.

``GPUSLICE_MIG_MANAGER_CRASH_AT=<point>`` makes the process SIGKILL itself when it reaches
``<point>``, so a test can prove that a kill -9 there leaks nothing. Points:

- ``after-create-gpu-instance``: the GPU instance exists, its compute instance does not yet.
- ``after-destroy-compute-instance``: the compute instance is gone, its GPU instance is not.

Unset (always, outside tests) the hooks cost one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "GPUSLICE_MIG_MANAGER_CRASH_AT"


def crash_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
