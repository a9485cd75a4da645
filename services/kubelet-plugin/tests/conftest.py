"""Fixtures of the kubelet plugin's unit tests: a fake node (fake NVML). Nothing here talks
to an API server; tests that need one run against the sandbox's real control plane
(e2e/tests/kubelet_plugin/test_kubelet_plugin_*.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_nvml import open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_testkit.kubelet_plugin.harness import H100X2_MIG, Node, write_node

NODE = "node-a"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    config = write_node(tmp_path, H100X2_MIG, NODE)
    nvml = open_nvml("fake", config)
    yield Node(config, nvml, FakeNvmlControl.from_config_file(config))
    nvml.close()
