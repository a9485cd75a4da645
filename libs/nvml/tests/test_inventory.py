"""The inventory demo over the sample node fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gpuslice_nvml import inventory

SAMPLE = Path(__file__).resolve().parents[3] / "e2e" / "fixtures" / "sample-node.yaml"


@pytest.fixture
def sample_config(tmp_path: Path) -> Path:
    """The sample node with its state in ``tmp_path`` (the fixture's own state is shared)."""
    data = yaml.safe_load(SAMPLE.read_text())
    data["statePath"] = str(tmp_path / "state.json")
    path = tmp_path / "sample-node.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_text_report(sample_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inventory.main(["--nvml=fake", "--fake-nvml-config", str(sample_config)]) == 0
    out = capsys.readouterr().out
    assert "driver 570.158.01, CUDA 12.8, 6 GPUs" in out
    assert out.count("NVIDIA H100 80GB HBM3\n") == 4
    assert "79.6 GiB (81559 MiB)" in out
    assert "9.0 (Hopper)" in out
    assert "1g.10gb      19    7   16    9984 MiB" in out
    assert "3g.40gb      4:4" in out
    assert "GPU0  X     NV18  NV18  NV18  SYS   SYS   0" in out


def test_json_report(sample_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--nvml=fake", "--fake-nvml-config", str(sample_config), "--json"]
    assert inventory.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["gpus"]) == 6
    assert [p["name"] for p in report["migProfiles"]["NVIDIA H100 80GB HBM3"]][:3] == [
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
    ]
    assert [gi["profile"] for gi in report["migInstances"]["3"]] == [
        "3g.40gb",
        "2g.20gb",
        "1g.10gb",
    ]
    assert report["topology"]["matrix"][4][5] == "NODE"


def test_sample_fixture_loads_as_is() -> None:
    from gpuslice_nvml.fake import load_node

    node = load_node(SAMPLE)
    assert [g.model.key for g in node.gpus] == ["H100-SXM5-80GB"] * 4 + ["L4"] * 2


def test_error_is_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [{model: V100}]\n")
    assert inventory.main(["--nvml=fake", "--fake-nvml-config", str(bad)]) == 1
    assert "unknown GPU model 'V100'" in capsys.readouterr().err
