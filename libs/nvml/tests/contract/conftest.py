"""Contract tests run against every backend: the fake always, the real one where a GPU is,
and the real one on the mock libnvidia-ml driven by the fake's node (``tests/mock`` runs this
suite in a child process whose loader finds the mock; there the backends are "mock" only).

They only read: the real backend never has its MIG mode changed or instances created here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslice_nvml import mock
from gpuslice_nvml.errors import NvmlError
from gpuslice_nvml.fake import FakeNvml
from gpuslice_nvml.interface import Nvml

CONTRACT_NODE = """
name: contract-node
gpus:
  - model: H100-SXM5-80GB
    migEnabled: true
    migInstances:
      - profile: 3g.40gb
        computeInstances: [1c.3g.40gb, 2c.3g.40gb]
      - profile: 1g.10gb
  - model: A100-SXM4-40GB
  - model: L4
    numaNode: 1
topology:
  nvlink:
    - gpus: [0, 1]
      links: 12
"""


#: Set by tests/mock for its child pytest: run the suites on the real backend over the mock.
ON_MOCK = os.environ.get(mock.ON_MOCK_ENV) == "1"
BACKENDS = ["mock"] if ON_MOCK else ["fake", pytest.param("real", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def nvml(
    request: pytest.FixtureRequest,
    write_config: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Nvml]:
    backend: Nvml
    if request.param == "fake":
        backend = FakeNvml.from_config_file(write_config(CONTRACT_NODE))
    elif request.param == "mock":
        from gpuslice_nvml.real import RealNvml

        for key, value in mock.prepare(write_config(CONTRACT_NODE)).items():
            monkeypatch.setenv(key, value)
        backend = RealNvml()
    else:
        from gpuslice_nvml.real import RealNvml

        try:
            backend = RealNvml()
        except NvmlError as exc:
            pytest.skip(f"no NVIDIA GPU/driver: {exc}")
    with backend:
        yield backend
