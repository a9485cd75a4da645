"""Config errors name the key and say what would be right."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice_nvml.fake import FakeConfigError, FakeNvml, load_node

WriteConfig = Callable[[str], Path]


def error_of(write_config: WriteConfig, text: str) -> str:
    with pytest.raises(FakeConfigError) as info:
        load_node(write_config(text))
    return str(info.value)


def test_unknown_key_is_named_with_the_allowed_ones(write_config: WriteConfig) -> None:
    message = error_of(write_config, "gpus:\n  - model: L4\n    migEnabld: true\n")
    assert "gpus[0].migEnabld: unknown key" in message
    assert "migEnabled" in message


def test_unknown_top_level_key(write_config: WriteConfig) -> None:
    assert "drivers: unknown key" in error_of(write_config, "drivers: x\ngpus: [{model: L4}]")


def test_bad_model_lists_the_catalog(write_config: WriteConfig) -> None:
    message = error_of(write_config, "gpus: [{model: RTX 4090}]")
    assert "gpus[0].model: unknown GPU model 'RTX 4090'" in message
    for key in ("A100-SXM4-40GB", "H100-SXM5-80GB", "NVIDIA H200", "L4", "Tesla T4"):
        assert key in message


def test_missing_gpus(write_config: WriteConfig) -> None:
    assert "gpus: required key is missing" in error_of(write_config, "name: x")


def test_duplicate_key(write_config: WriteConfig) -> None:
    assert "duplicate key 'gpus'" in error_of(write_config, "gpus: [{model: L4}]\ngpus: []")


def test_unquoted_cuda_version(write_config: WriteConfig) -> None:
    message = error_of(write_config, "cudaDriverVersion: 12.8\ngpus: [{model: L4}]")
    assert "cudaDriverVersion: quote the version" in message


def test_mig_on_a_gpu_without_mig(write_config: WriteConfig) -> None:
    message = error_of(write_config, "gpus: [{model: T4, migEnabled: true}]")
    assert "gpus[0]: Tesla T4 does not support MIG" in message


def test_unknown_mig_profile_lists_the_profiles(write_config: WriteConfig) -> None:
    message = error_of(
        write_config,
        """
        gpus:
          - model: H100-SXM5-80GB
            migEnabled: true
            migInstances: [{profile: 1g.5gb}]
        """,
    )
    assert "gpus[0].migInstances[0].profile: '1g.5gb'" in message
    assert "1g.10gb, 1g.10gb+me, 1g.20gb" in message


def test_layout_that_does_not_fit(write_config: WriteConfig) -> None:
    message = error_of(
        write_config,
        """
        gpus:
          - model: H100-SXM5-80GB
            migEnabled: true
            migInstances: [{profile: 1g.10gb, count: 8}]
        """,
    )
    assert "gpus[0].migInstances[0]: the layout does not fit" in message
    assert "Insufficient Resources" in message


def test_mig_instances_need_mig_mode(write_config: WriteConfig) -> None:
    message = error_of(
        write_config, "gpus: [{model: A100-SXM4-40GB, migInstances: [{profile: 7g.40gb}]}]"
    )
    assert "gpus[0].migInstances: needs migEnabled: true" in message


def test_nvlink_on_a_pcie_gpu(write_config: WriteConfig) -> None:
    message = error_of(
        write_config,
        """
        gpus: [{model: L4, count: 2}]
        topology: {nvlink: [{gpus: [0, 1], links: 4}]}
        """,
    )
    assert "topology.nvlink[0].links: GPU 0 (NVIDIA L4) has 0 NVLinks" in message


def test_nvlink_to_a_missing_gpu(write_config: WriteConfig) -> None:
    message = error_of(
        write_config,
        """
        gpus: [{model: H100-SXM5-80GB, count: 2}]
        topology: {nvlink: [{gpus: [0, 5], links: 18}]}
        """,
    )
    assert "topology.nvlink[0].gpus: no GPU 5" in message


def test_uuid_with_count(write_config: WriteConfig) -> None:
    message = error_of(
        write_config,
        "gpus: [{model: L4, count: 2, uuid: GPU-11111111-2222-3333-4444-555555555555}]",
    )
    assert "use count: 1" in message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FakeConfigError, match="cannot read fake NVML config"):
        FakeNvml.from_config_file(tmp_path / "nope.yaml")


def test_overrides_and_defaults(write_config: WriteConfig) -> None:
    node = load_node(
        write_config(
            """
            name: n1
            gpus:
              - model: A100-SXM4-80GB
                uuid: GPU-11111111-2222-3333-4444-555555555555
                pciBusId: 0000:b1:00.0
                numaNode: 1
                addressingMode: ATS
              - model: A100-SXM4-80GB
            """
        )
    )
    first, second = node.gpus
    assert first.uuid == "GPU-11111111-2222-3333-4444-555555555555"
    assert (first.pci_bus_id, first.pcie_root, first.numa_node) == ("0000:b1:00.0", "pci0000:b0", 1)
    assert second.uuid.startswith("GPU-") and second.numa_node == 0
    # NVML answers an addressing mode only on coherent-memory systems
    assert (first.addressing_mode, second.addressing_mode) == ("ATS", None)
    # UUIDs are derived from the node name: the same name gives the same UUIDs
    again = load_node(write_config("name: n1\ngpus: [{model: L4}, {model: L4}]"))
    assert again.gpus[1].uuid == second.uuid
    other = load_node(write_config("name: n2\ngpus: [{model: L4}, {model: L4}]"))
    assert other.gpus[1].uuid != second.uuid
