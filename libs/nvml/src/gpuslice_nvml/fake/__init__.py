"""The fake NVML backend: a simulated node of real GPU models, shared across processes.

* :class:`FakeNvml` implements :class:`gpuslice_nvml.interface.Nvml`.
* :class:`FakeNvmlControl` (and ``python -m gpuslice_nvml.fake.ctl``) changes the node from
  outside: processes, XIDs, lost GPUs.
* The node is described by a YAML config (:mod:`gpuslice_nvml.fake.config`) over the model
  catalog (:mod:`gpuslice_nvml.fake.catalog`); its mutable state lives in a shared JSON file
  (:mod:`gpuslice_nvml.fake.state`).
"""

from gpuslice_nvml.fake.backend import FakeNvml
from gpuslice_nvml.fake.catalog import CATALOG, GpuModel, find_model
from gpuslice_nvml.fake.config import FakeConfigError, FakeNodeConfig, parse_config
from gpuslice_nvml.fake.control import FakeNvmlControl
from gpuslice_nvml.fake.node import FakeNode, build_node, load_node

__all__ = [
    "CATALOG",
    "FakeConfigError",
    "FakeNode",
    "FakeNodeConfig",
    "FakeNvml",
    "FakeNvmlControl",
    "GpuModel",
    "build_node",
    "find_model",
    "load_node",
    "parse_config",
]
