"""Shared fixtures: fake nodes written to a temporary directory with their own state file."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice_nvml import mock
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl

WriteConfig = Callable[[str], Path]

#: GPU 0: H100 in MIG mode with no instances; GPU 1: H100 without MIG; GPU 2: L4.
MIXED_NODE = """
name: test-node
gpus:
  - model: H100-SXM5-80GB
    migEnabled: true
    numaNode: 0
  - model: NVIDIA H100 80GB HBM3
    numaNode: 0
  - model: L4
    numaNode: 1
topology:
  nvlink:
    - gpus: [0, 1]
      links: 18
"""


@pytest.fixture
def write_config(tmp_path: Path) -> WriteConfig:
    """Write a config (YAML text) whose state lives in ``tmp_path``; returns its path."""
    counter = iter(range(1000))

    def write(text: str) -> Path:
        path = tmp_path / f"node-{next(counter)}.yaml"
        body = textwrap.dedent(text).strip() + "\n"
        if "statePath" not in body:
            body += f"statePath: {path.stem}.state.json\n"
        path.write_text(body)
        return path

    return write


@pytest.fixture
def mixed_config(write_config: WriteConfig) -> Path:
    return write_config(MIXED_NODE)


@pytest.fixture
def fake(mixed_config: Path) -> FakeNvml:
    return FakeNvml.from_config_file(mixed_config)


@pytest.fixture
def control(mixed_config: Path) -> FakeNvmlControl:
    return FakeNvmlControl.from_config_file(mixed_config)


#: The one-model tests need the mock libnvidia-ml loaded; tests/mock/test_on_mock.py runs them
#: in a child process that has it.
collect_ignore = [] if os.environ.get(mock.ON_MOCK_ENV) == "1" else ["onmock"]
