"""One node, two front ends: the real backend on the mock library and the Python fake, both
reading the same state file. Collected only where the mock is loaded (tests/mock runs them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuslice_nvml import mock
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_nvml.real import RealNvml

pytestmark = pytest.mark.timeout(30)


@dataclass
class Node:
    config: Path
    real: RealNvml
    fake: FakeNvml
    control: FakeNvmlControl


OpenNode = Callable[[str], Node]


@pytest.fixture
def open_node(
    write_config: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[OpenNode]:
    """Open a node (YAML text) through both front ends; one node per test."""
    opened: list[RealNvml] = []

    def open_(text: str) -> Node:
        config = write_config(text)
        for key, value in mock.prepare(config).items():
            monkeypatch.setenv(key, value)
        real = RealNvml()
        opened.append(real)
        return Node(
            config,
            real,
            FakeNvml.from_config_file(config),
            FakeNvmlControl.from_config_file(config),
        )

    yield open_
    for real in opened:
        real.close()
