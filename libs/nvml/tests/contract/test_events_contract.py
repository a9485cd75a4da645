"""Event watches on every backend."""

from __future__ import annotations

import pytest

from gpuslice_nvml import errors as e
from gpuslice_nvml.interface import Nvml
from gpuslice_nvml.types import HealthEvent


def test_watch_returns_an_event_or_times_out(nvml: Nvml) -> None:
    with nvml.watch_events() as watch:
        assert set(watch.gpus) <= set(range(nvml.device_count()))
        event = watch.wait(timeout_s=0.05)
    assert event is None or isinstance(event, HealthEvent)


def test_watch_on_a_missing_gpu(nvml: Nvml) -> None:
    with pytest.raises(e.NvmlInvalidArgument):
        nvml.watch_events([nvml.device_count()])
