"""Fixtures of the device plugin's unit tests: fake NVML nodes. Tests against the sandbox's
real control plane and node agent live in e2e/tests/device_plugin/test_device_plugin.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice_nvml import Nvml, open_nvml
from gpuslice_testkit.device_plugin import write_node

NodeFactory = Callable[[dict[str, Any]], Nvml]


@pytest.fixture
def fake_node(tmp_path: Path) -> Iterator[NodeFactory]:
    opened: list[Nvml] = []

    def make(doc: dict[str, Any]) -> Nvml:
        nvml = open_nvml("fake", write_node(tmp_path, doc, f"node-{len(opened)}"))
        opened.append(nvml)
        return nvml

    yield make
    for nvml in opened:
        nvml.close()
