"""Where the fake's state lives and how it starts over."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice_core.errors import CorruptStateError, FailedPreconditionError
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl, load_node

WriteConfig = Callable[[str], Path]


def test_state_file_next_to_the_config(write_config: WriteConfig) -> None:
    path = write_config("gpus: [{model: A100-SXM4-40GB, migEnabled: true}]")
    nvml = FakeNvml.from_config_file(path)
    nvml.create_gpu_instance(0, 0)
    state_file = path.parent / f"{path.stem}.state.json"
    assert nvml.store.path == state_file
    state = json.loads(state_file.read_text())
    assert state["gpus"][0]["gpuInstances"][0]["profileId"] == 0
    assert state["schemaVersion"] == 1


def test_default_state_path_is_in_the_temp_dir(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("name: my-node\ngpus: [{model: L4}]\n")
    path = load_node(config).state_path
    assert path.parent == Path(tempfile.gettempdir()) / "gpuslice-fake-nvml"
    assert path.name.startswith("my-node-")


def test_changed_config_starts_over(write_config: WriteConfig, tmp_path: Path) -> None:
    text = "statePath: shared.json\ngpus: [{model: A100-SXM4-40GB, migEnabled: true}]\n"
    path = write_config(text)
    FakeNvml.from_config_file(path).create_gpu_instance(0, 0)
    assert len(FakeNvml.from_config_file(path).gpu_instances(0)) == 1
    path.write_text(text.replace("migEnabled: true", "migEnabled: false"))
    assert FakeNvml.from_config_file(path).gpu(0).mig_enabled is False


def test_reset_goes_back_to_the_config(write_config: WriteConfig) -> None:
    path = write_config(
        """
        gpus:
          - model: H200
            migEnabled: true
            migInstances: [{profile: 3g.71gb, placement: 0}]
        """
    )
    nvml, control = FakeNvml.from_config_file(path), FakeNvmlControl.from_config_file(path)
    nvml.create_gpu_instance(0, 9)
    assert len(nvml.gpu_instances(0)) == 2
    control.reset_state()
    (gi,) = nvml.gpu_instances(0)
    assert (gi.profile_name, str(gi.placement)) == ("3g.71gb", "0:4")


def test_corrupt_state_is_reported(write_config: WriteConfig) -> None:
    path = write_config("gpus: [{model: L4}]")
    nvml = FakeNvml.from_config_file(path)
    nvml.gpu(0)
    nvml.store.path.write_text("{not json")
    with pytest.raises(CorruptStateError, match="ctl reset"):
        nvml.gpu(0)
    FakeNvmlControl.from_config_file(path).reset_state()
    assert nvml.gpu(0).name == "NVIDIA L4"


def test_unwritable_state_dir_is_a_clear_error(write_config: WriteConfig, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = write_config(f"statePath: {blocker}/sub/state.json\ngpus: [{{model: L4}}]")
    with pytest.raises(FailedPreconditionError, match="set statePath"):
        FakeNvml.from_config_file(path).gpu(0)
