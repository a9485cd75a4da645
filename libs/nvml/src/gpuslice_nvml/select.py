"""Choosing the NVML backend from flags: ``--nvml=real|fake`` and ``--fake-nvml-config``.

The real backend is the default and is never swapped for the fake behind the user's back: on a
machine without a GPU, ``--nvml=real`` fails with the NVML error that says why.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpuslice_core.cli import EnvArgumentParser
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_nvml.interface import Nvml
from gpuslice_nvml.types import NvidiaSmi

BACKENDS = ("real", "fake")


def add_nvml_arguments(parser: EnvArgumentParser) -> None:
    """Add ``--nvml`` (env ``GPUSLICE_NVML``) and ``--fake-nvml-config`` (env
    ``GPUSLICE_FAKE_NVML_CONFIG``) to a service's parser."""
    parser.add_flag(
        "--nvml",
        deprecated=["NVML_BACKEND"],
        default="real",
        choices=BACKENDS,
        help=(
            "Which NVML to use: real (the driver's libnvidia-ml through pynvml) or fake "
            "(a simulated node described by --fake-nvml-config)."
        ),
    )
    parser.add_flag(
        "--fake-nvml-config",
        deprecated=["FAKE_NVML_CONFIG"],
        default=None,
        help="Path of the fake node's YAML config; required with --nvml=fake, ignored otherwise.",
    )


def open_nvml(
    backend: str,
    fake_config: str | Path | None = None,
    *,
    nvidia_smi: NvidiaSmi = NvidiaSmi(),  # noqa: B008 - frozen
) -> Nvml:
    """Open the named backend (the real one runs ``nvidia_smi`` where NVML has no call).

    Raises ``InvalidArgumentError`` for an unknown backend or ``fake`` without a config,
    ``FakeConfigError`` for a bad config, and the mapped ``NvmlError`` (e.g.
    ``NvmlLibraryNotFound``) when the real NVML cannot start.
    """
    if backend == "real":
        from gpuslice_nvml.real import RealNvml

        return RealNvml(nvidia_smi)
    if backend == "fake":
        if not fake_config:
            raise InvalidArgumentError(
                "--nvml=fake needs --fake-nvml-config (env GPUSLICE_FAKE_NVML_CONFIG): "
                "the path of the fake node's YAML config"
            )
        from gpuslice_nvml.fake import FakeNvml

        return FakeNvml.from_config_file(fake_config)
    raise InvalidArgumentError(f"--nvml must be one of {', '.join(BACKENDS)}, got {backend!r}")


def nvml_from_args(args: argparse.Namespace) -> Nvml:
    """:func:`open_nvml` with the values :func:`add_nvml_arguments` parsed."""
    backend: str = args.nvml
    fake_config: str | None = args.fake_nvml_config
    return open_nvml(backend, fake_config)
