"""Strict decoding of mig-parted configs and selection of GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_mig_manager.layouts import (
    LayoutError,
    gpu_instance_profile_of,
    load_layouts_file,
    parse_layouts,
    select_targets,
)
from gpuslice_nvml.fake import FakeNvml

pytestmark = pytest.mark.timeout(10)

HEAD = "version: v1\nmig-configs:\n  x:\n"


def error_of(text: str) -> str:
    with pytest.raises(LayoutError) as info:
        parse_layouts(text, source="layouts.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "    - devices: all\n      mig-enabled: true\n      mig-devics: {}\n",
            "layouts.yaml: mig-configs.x[0].mig-devics: unknown key; allowed keys here:"
            " device-filter, devices, mig-devices, mig-enabled",
        ),
        (
            "    - devices: all\n      mig-enabled: true\n",
            "mig-configs.x[0]: mig-devices is required when mig-enabled is true",
        ),
        (
            "    - devices: all\n      mig-enabled: false\n      mig-devices: {1g.5gb: 1}\n",
            "mig-devices must be empty or absent when mig-enabled is false",
        ),
        ("    - mig-enabled: false\n", "mig-configs.x[0].devices: required key is missing"),
        (
            "    - devices: some\n      mig-enabled: false\n",
            "mig-configs.x[0].devices: Input should be 'all' or a valid list (got 'some')",
        ),
        (
            "    - devices: [0, 0]\n      mig-enabled: false\n",
            "GPU indices must not repeat",
        ),
        (
            "    - devices: all\n      mig-enabled: true\n      mig-devices: {1g.5gbb: 1}\n",
            "'1g.5gbb' is not a MIG profile name",
        ),
        (
            "    - devices: all\n      mig-enabled: true\n      mig-devices: {3c.2g.10gb: 1}\n",
            "a compute instance must be smaller than its GPU instance",
        ),
        (
            "    - devices: all\n      mig-enabled: true\n      mig-devices: {1g.5gb: '7'}\n",
            "mig-configs.x[0].mig-devices.1g.5gb: Input should be a valid integer",
        ),
        (
            "    - devices: all\n      device-filter: 0xZZ\n      mig-enabled: false\n",
            "'0xZZ' is not a PCI device id like 0x20B010DE",
        ),
        ("    []\n", "mig-configs.x: List should have at least 1 item"),
    ],
)
def test_errors_name_the_key(body: str, expected: str) -> None:
    assert expected in error_of(HEAD + body)


def test_top_level_errors() -> None:
    assert "version: Input should be 'v1'" in error_of("version: v2\nmig-configs: {}\n")
    assert "mig-config: unknown key; allowed keys here: mig-configs, version" in error_of(
        "version: v1\nmig-config: {}\n"
    )
    assert "duplicate key 'x'" in error_of(
        HEAD + "    - {devices: all, mig-enabled: false}\n  x: []\n"
    )
    assert "top level must be a mapping" in error_of("- 1\n")
    assert "invalid YAML" in error_of("version: [\n")


def test_a_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match=r"cannot read MIG layout file .*nope.yaml"):
        load_layouts_file(tmp_path / "nope.yaml")


def test_profile_names() -> None:
    assert gpu_instance_profile_of("1c.3g.20gb") == "3g.20gb"
    assert gpu_instance_profile_of("1c.1g.10gb+me") == "1g.10gb+me"
    assert gpu_instance_profile_of("7g.80gb") == "7g.80gb"
    config = parse_layouts(
        HEAD + "    - devices: all\n      mig-enabled: true\n      mig-devices:"
        " {1g.10gb+me: 1, 1g.24gb+gfx: 1, 1g.12gb-me: 1, 1g.24gb+me.all: 1, 2c.4g.40gb: 0}\n"
    )
    assert config.get("x")[0].wanted() == {
        "1g.10gb+me": 1,
        "1g.24gb+gfx": 1,
        "1g.12gb-me": 1,
        "1g.24gb+me.all": 1,
    }


def test_selection_by_index_filter_and_all(tmp_path: Path) -> None:
    node = tmp_path / "node.yaml"
    node.write_text(
        "name: sel\nstatePath: s.json\ngpus:\n  - model: A100-SXM4-40GB\n    count: 2\n"
        "  - model: H100-SXM5-80GB\n  - model: L4\n"
    )
    gpus = FakeNvml.from_config_file(node).gpus()
    config = parse_layouts(
        "version: v1\nmig-configs:\n"
        "  mixed:\n"
        "    - device-filter: ['0x20B010DE']\n      devices: all\n      mig-enabled: true\n"
        "      mig-devices: {1g.5gb: 7}\n"
        "    - device-filter: 0x233010DE\n      devices: all\n      mig-enabled: true\n"
        "      mig-devices: {7g.80gb: 1}\n"
        "  some:\n    - devices: [1, 3]\n      mig-enabled: false\n"
        "  clash:\n    - devices: [0]\n      mig-enabled: false\n"
        "    - devices: all\n      mig-enabled: false\n"
        "  missing:\n    - devices: [9]\n      mig-enabled: false\n"
    )

    mixed = select_targets(config, "mixed", gpus)
    assert {i: (t.entry, t.devices) for i, t in mixed.items()} == {
        0: ("mixed[0]", {"1g.5gb": 7}),
        1: ("mixed[0]", {"1g.5gb": 7}),
        2: ("mixed[1]", {"7g.80gb": 1}),
    }
    assert sorted(select_targets(config, "some", gpus)) == [1, 3]
    with pytest.raises(LayoutError, match=r"clash\[1\] and clash\[0\] both select GPU 0"):
        select_targets(config, "clash", gpus)
    with pytest.raises(LayoutError, match=r"devices \[9\] do not exist; the node has GPUs"):
        select_targets(config, "missing", gpus)
    with pytest.raises(LayoutError, match="no layout named 'nope'; layouts: clash, missing"):
        select_targets(config, "nope", gpus)
