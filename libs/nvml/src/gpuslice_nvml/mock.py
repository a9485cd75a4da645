"""The node file of the mock ``libnvidia-ml.so.1`` (libs/nvml/mock/, built by hack/nvml-mock.sh).

The mock is a second front end on the fake node: it answers NVML's C calls from the same shared
state file the Python fake reads and writes, so ``python -m gpuslice_nvml.fake.ctl`` changes
what both see. What does not change (UUIDs, PCI addresses, the model's numbers, MIG profile
tables, the NVLink wiring) is resolved here, by the same code the fake uses, and written once as
a flat JSON *node file* next to the state file; the C library reads it at ``nvmlInit``. C never
parses the YAML config nor repeats the catalog, so the two front ends cannot drift on facts.

    python -m gpuslice_nvml.mock --config node.yaml
    # prints: GPUSLICE_NVML_MOCK_NODE=/tmp/gpuslice-fake-nvml/<node>.json.mock-node.json

Node file format, version 1 (``formatVersion``; the C side refuses any other with
NVML_ERROR_LIB_RM_VERSION_MISMATCH): every key below is written, camelCase, integers as JSON
integers. ``initialState`` is the state the fake starts from, so the mock can (re)create the
state file exactly as :class:`~gpuslice_nvml.fake.state.StateStore` does when it is missing or
was made from another config. See docs/nvml-mock.md.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuslice_core.cli import EnvArgumentParser
from gpuslice_core.errors import GpusliceError
from gpuslice_nvml.fake.node import FakeGpu, FakeNode, load_node
from gpuslice_nvml.fake.state import SCHEMA_VERSION, StateStore
from gpuslice_nvml.real.calls import ADDRESSING_MODES, ARCHITECTURES, BRANDS, cores_per_sm
from gpuslice_nvml.types import FAKE_NVML_CONFIG_ENV

FORMAT_VERSION = 1
#: The variable the C library reads at ``nvmlInit`` to find its node file.
NODE_ENV = "GPUSLICE_NVML_MOCK_NODE"
#: Without ``NODE_ENV``, the node file the library reads from its own directory (dladdr): a
#: driver root of files carries it next to ``libnvidia-ml.so.1``, so the node pods that load
#: the library from the driver root need no variable (docs/nvml-mock.md, "As a driver root").
LIBRARY_NODE_FILE = "gpuslice-nvml-mock-node.json"
#: Set (to "1") where the test suites run the real backend on the mock (libs/nvml/tests/mock).
ON_MOCK_ENV = "GPUSLICE_NVML_TESTS_ON_MOCK"
#: GPU-instance ids 0..14 (the memory-slice tree) and compute-instance ids 0..7.
MAX_GPU_INSTANCES = 15
MAX_COMPUTE_INSTANCES = 8

_BRAND_CODES = {name: code for code, name in BRANDS.items()}
_ARCHITECTURE_CODES = {name: code for code, name in ARCHITECTURES.items()}
_ADDRESSING_CODES = {name: code for code, name in ADDRESSING_MODES.items()}


def node_file_path(node: FakeNode) -> Path:
    return node.state_path.with_name(node.state_path.name + ".mock-node.json")


def describe(node: FakeNode) -> dict[str, Any]:
    """The node file's content."""
    return {
        "formatVersion": FORMAT_VERSION,
        "stateSchemaVersion": SCHEMA_VERSION,
        "name": node.name,
        "digest": node.digest,
        "statePath": str(node.state_path.resolve()),
        "driverVersion": node.driver_version,
        "cudaDriverVersion": node.cuda_driver_version,
        "utilizationSampleMs": node.config.utilization_sample_ms,
        "gpus": [_gpu(node, gpu) for gpu in node.gpus],
        "initialState": node.initial_state().model_dump(mode="json", by_alias=True),
    }


def _gpu(node: FakeNode, gpu: FakeGpu) -> dict[str, Any]:
    model = gpu.model
    major, minor = model.cuda_compute_capability
    per_sm = cores_per_sm(major, minor) or 0
    links = []
    for other in node.gpus:
        if other.index != gpu.index:
            links += [other.pci_bus_id] * node.link(gpu.index, other.index).nvlinks
    return {
        "uuid": gpu.uuid,
        "name": model.product_name,
        "brand": _BRAND_CODES.get(model.brand, 0),
        "architecture": _ARCHITECTURE_CODES.get(model.architecture, 0xFFFFFFFF),
        "ccMajor": major,
        "ccMinor": minor,
        "multiprocessors": model.multiprocessors,
        "gpuCores": model.multiprocessors * per_sm,
        "memoryMib": model.memory_mib,
        "pciBusId": gpu.pci_bus_id,
        "pciDeviceId": model.pci_device_id,
        "numaNode": gpu.numa_node,
        "addressingMode": (
            -1 if gpu.addressing_mode is None else _ADDRESSING_CODES[gpu.addressing_mode]
        ),
        "migCapable": model.mig_capable,
        "topology": [node.link(gpu.index, other.index).level.value for other in node.gpus],
        "nvlinkPeers": links,
        "giProfiles": [_gi_profile(gpu, pr) for pr in gpu.gi_profiles],
        "migUuids": [
            [gpu.mig_uuid(gi, ci) for ci in range(MAX_COMPUTE_INSTANCES)]
            for gi in range(MAX_GPU_INSTANCES)
        ]
        if model.mig_capable
        else [],
    }


def _gi_profile(gpu: FakeGpu, profile: Any) -> dict[str, Any]:
    return {
        "nvmlProfile": profile.nvml_profile,
        "id": profile.id,
        "name": profile.name,
        "sliceCount": profile.slice_count,
        "memorySlices": profile.memory_slices,
        "instanceCount": profile.instance_count,
        "multiprocessors": profile.multiprocessors,
        "memoryMib": profile.memory_mib,
        "copyEngines": profile.copy_engines,
        "decoders": profile.decoders,
        "encoders": profile.encoders,
        "jpegDecoders": profile.jpeg_decoders,
        "ofaEngines": profile.ofa_engines,
        "p2pSupported": profile.p2p_supported,
        "placements": [[pl.start, pl.size] for pl in profile.placements],
        "ciProfiles": [
            {
                "nvmlProfile": ci.nvml_profile,
                "id": ci.id,
                "name": ci.name,
                "sliceCount": ci.slice_count,
                "instanceCount": ci.instance_count,
                "multiprocessors": ci.multiprocessors,
                "placements": [[pl.start, pl.size] for pl in ci.placements],
            }
            for ci in gpu.ci_profiles(profile)
        ],
    }


def write_node_file(node: FakeNode, path: Path | None = None) -> Path:
    """Write the node file (atomically; at ``path``, by default next to the state) and make
    sure the shared state exists; its path."""
    StateStore(node.state_path, node.digest, node.initial_state).read()
    path = path or node_file_path(node)
    data = json.dumps(describe(node), indent=1).encode()
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        Path(name).chmod(0o644)
        Path(name).replace(path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return path


def prepare(config: str | Path) -> dict[str, str]:
    """Write the node file of ``config``; the environment that points the mock at it."""
    return {NODE_ENV: str(write_node_file(load_node(config)))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = EnvArgumentParser(
        prog="python -m gpuslice_nvml.mock",
        description=(
            "Write the node file the mock libnvidia-ml.so.1 reads and print the variable that "
            "points it there (NAME=VALUE, one per line)."
        ),
    )
    parser.add_flag(
        "--config",
        env=FAKE_NVML_CONFIG_ENV,
        deprecated=["FAKE_NVML_CONFIG"],
        required=True,
        help="Path of the fake node's YAML config, the same one the fake and fake.ctl use.",
    )
    args = parser.parse_args(argv)
    try:
        env = prepare(args.config)
    except GpusliceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for key, value in env.items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
