"""The health rules the kubelet plugin and the device plugin share (gpuslice_nvml.health)."""

from __future__ import annotations

import argparse
from typing import Any, cast

import pytest

from gpuslice_core.cli import positive_seconds
from gpuslice_nvml import Nvml, NvmlGpuLost
from gpuslice_nvml.health import APP_XIDS, parse_xids, recovered


class Answering:
    """An Nvml stand-in whose GPUs in ``lost`` do not answer; counts the questions."""

    def __init__(self, lost: set[int]) -> None:
        self.lost = lost
        self.asked: list[int] = []

    def gpu(self, index: int) -> Any:
        self.asked.append(index)
        if index in self.lost:
            raise NvmlGpuLost(f"GPU {index} is lost")
        return object()

    def memory_info(self, index: int) -> Any:
        return object()


def test_a_fault_recovers_once_quiet_and_its_gpu_answers() -> None:
    nvml = Answering(lost={2})
    faults = [
        ("xid-old", 0, 100.0, False),  # quiet for 400 s, GPU 0 answers: cleared
        ("xid-new", 0, 450.0, False),  # seen 50 s ago: kept
        ("lost-back", 1, 499.0, True),  # a lost GPU that answers: cleared at once
        ("lost-still", 2, 100.0, True),  # does not answer: kept
        ("xid-other", 0, 150.0, False),  # GPU 0 is asked only once
    ]
    cleared = recovered(faults, cast(Nvml, nvml), now=500.0, quiet_period=300.0)
    assert cleared == ["xid-old", "lost-back", "xid-other"]
    assert sorted(nvml.asked) == [0, 1, 2]  # once per GPU, never for a fault not yet quiet


def test_xid_lists_and_seconds_are_checked_by_the_flag_parsers() -> None:
    assert parse_xids("13, 31,,79") == frozenset({13, 31, 79})
    assert parse_xids(",".join(map(str, sorted(APP_XIDS)))) == APP_XIDS
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list of XID"):
        parse_xids("13,x")
    assert positive_seconds("2.5") == 2.5
    with pytest.raises(argparse.ArgumentTypeError, match="positive number of seconds"):
        positive_seconds("0")
