"""Per-node config selection from a directory of named configs, and the per-node mode rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_device_plugin.config import ConfigError, select_config
from gpuslice_device_plugin.devices import Device, Resource
from gpuslice_device_plugin.mps import ReplicaShare
from gpuslice_device_plugin.node import NodeInfo, refusal, sharing_state

LABEL = "nvidia.com/device-plugin.config"


def configs(tmp_path: Path, **named: str) -> Path:
    for name, text in named.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "..data").mkdir()  # a ConfigMap volume's bookkeeping is not a config
    return tmp_path


def pick(directory: Path, value: str | None, default: str | None = None) -> str:
    return select_config(directory, label=LABEL, label_value=value, default=default).name


def test_the_label_picks_else_the_default_else_the_only_one(tmp_path: Path) -> None:
    d = configs(tmp_path, a100="version: v1\n", ts4="sharing: {timeSlicing: {}}\n")
    assert pick(d, "ts4") == "ts4"
    assert pick(d, None, default="a100") == "a100"
    selected = select_config(d, label=LABEL, label_value="ts4", default="a100")
    assert selected.why == f"node label {LABEL}=ts4"
    with pytest.raises(ConfigError, match=f"the node has no label {LABEL} .*available: a100, ts4"):
        pick(d, None)
    (tmp_path / "ts4").unlink()
    assert pick(d, None) == "a100"


def test_a_label_naming_no_config_is_refused_listing_the_names(tmp_path: Path) -> None:
    d = configs(tmp_path, a100="version: v1\n")
    with pytest.raises(ConfigError, match=f"{LABEL}=h100: no config named 'h100'.*available: a100"):
        pick(d, "h100")


def test_a_bad_key_in_the_selected_config_stops_start_up_naming_it(tmp_path: Path) -> None:
    d = configs(tmp_path, good="version: v1\n", bad="flags: {migStratgy: mixed}\n")
    with pytest.raises(ConfigError, match=r"bad: flags\.migStratgy: unknown key"):
        pick(d, "bad")
    selected = select_config(d, label=LABEL, label_value="good", default=None)
    assert len(selected.broken) == 1 and "flags.migStratgy: unknown key" in selected.broken[0]


def node(labels: dict[str, str]) -> NodeInfo:
    return NodeInfo("n1", "uid", labels)


def test_only_device_plugin_nodes_without_dra_slices_may_run_the_plugin() -> None:
    assert refusal(node({"gpuslice.dev/mode": "device-plugin"}), []) is None
    unlabelled = refusal(node({}), [])
    assert unlabelled is not None and "is a DRA node (no label gpuslice.dev/mode)" in unlabelled
    dra = refusal(node({"gpuslice.dev/mode": "dra"}), [])
    assert dra is not None and "(gpuslice.dev/mode=dra)" in dra
    both = refusal(node({"gpuslice.dev/mode": "device-plugin"}), ["n1-gpu.gpuslice.dev-x"])
    assert both is not None and "still publishes 1 ResourceSlice(s)" in both


def test_the_node_says_how_each_resource_is_shared() -> None:
    gpu = Device("GPU-1::0", "GPU-1", "0", 0, 0, None, replica=0)
    share = ReplicaShare("GPU-1::0", "sh-1", 25, 2**30, "hard", "memory-partition", "mps", "", "x")
    labels, details = sharing_state(
        [
            Resource("nvidia.com/gpu", (gpu,), 4, True, "mps"),
            Resource("nvidia.com/mig-1g.10gb", (gpu,), 2, False, "time-slicing"),
            Resource("nvidia.com/mig-3g.40gb", (gpu,)),
        ],
        {"GPU-1::0": share},
    )
    assert labels == {
        "sharing.gpuslice.dev/gpu": "mps",
        "sharing.gpuslice.dev/mig-1g.10gb": "time-slicing",
        "sharing.gpuslice.dev/mig-3g.40gb": "none",
    }
    assert details["nvidia.com/gpu"]["enforced"] is True
    assert details["nvidia.com/gpu"]["cores"] == 25
    assert details["nvidia.com/mig-1g.10gb"]["enforced"] is False
