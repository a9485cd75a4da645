"""Backend selection from flags and environment."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from gpuslice_core.cli import EnvArgumentParser
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_nvml import add_nvml_arguments, errors, nvml_from_args, open_nvml
from gpuslice_nvml.fake import FakeNvml


def parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="svc")
    add_nvml_arguments(p)
    return p


def test_defaults_to_real(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSLICE_NVML", raising=False)
    monkeypatch.delenv("GPUSLICE_FAKE_NVML_CONFIG", raising=False)
    args = parser().parse_args([])
    assert (args.nvml, args.fake_nvml_config) == ("real", None)


def test_env_selects_the_fake(monkeypatch: pytest.MonkeyPatch, mixed_config: Path) -> None:
    monkeypatch.setenv("GPUSLICE_NVML", "fake")
    monkeypatch.setenv("GPUSLICE_FAKE_NVML_CONFIG", str(mixed_config))
    with nvml_from_args(parser().parse_args([])) as nvml:
        assert isinstance(nvml, FakeNvml) and nvml.device_count() == 3


def test_fake_without_config_names_the_flag() -> None:
    with pytest.raises(InvalidArgumentError, match="--fake-nvml-config"):
        open_nvml("fake", None)


def test_unknown_backend() -> None:
    with pytest.raises(InvalidArgumentError, match="real, fake"):
        open_nvml("mock")


def test_real_never_falls_back_to_the_fake(
    monkeypatch: pytest.MonkeyPatch, mixed_config: Path
) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    with pytest.raises(errors.NvmlLibraryNotFound):
        open_nvml("real", mixed_config)


def test_help_documents_the_env_vars(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "GPUSLICE_NVML" in out and "GPUSLICE_FAKE_NVML_CONFIG" in out
