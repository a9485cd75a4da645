"""Choosing the NVML backend from flags: ``--nvml=real|fake``, ``--fake-nvml-config`` and
``--driver-root`` (where the real backend finds ``libnvidia-ml.so.1``; every service that opens
NVML takes it the same way, and the kubelet plugin also finds CDI's driver files under it).

The real backend is the default and is never swapped for the fake behind the user's back: on a
machine without a GPU, ``--nvml=real`` fails with the NVML error that says why.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpuslice_core.cli import EnvArgumentParser
from gpuslice_core.errors import InvalidArgumentError
from gpuslice_nvml.interface import Nvml

BACKENDS = ("real", "fake")


def add_nvml_arguments(parser: EnvArgumentParser) -> None:
    """Add ``--nvml`` (env ``GPUSLICE_NVML``), ``--fake-nvml-config`` (env
    ``GPUSLICE_FAKE_NVML_CONFIG``) and ``--driver-root`` (env ``GPUSLICE_DRIVER_ROOT``, or
    NVIDIA's ``NVIDIA_DRIVER_ROOT``) to a service's parser."""
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
    parser.add_flag(
        "--driver-root",
        aliases=["NVIDIA_DRIVER_ROOT"],
        type=Path,
        default=Path("/"),
        help=(
            "Root of the NVIDIA driver installation as this process sees it (the chart mounts "
            "the host's at /driver-root). With --nvml=real, libnvidia-ml.so.1 is loaded from "
            "its library directories (usr/lib64, usr/lib/x86_64-linux-gnu, ... as NVIDIA's "
            "tools search them), so the NVIDIA Container Toolkit is not needed; / or a root "
            "without the library leaves it to the loader's search path. The kubelet plugin "
            "also takes device nodes and CDI's driver files from under it."
        ),
    )


def open_nvml(
    backend: str, fake_config: str | Path | None = None, driver_root: Path | None = None
) -> Nvml:
    """Open the named backend (``driver_root``: where the real one finds libnvidia-ml and the
    ``nvidia-smi`` it runs where NVML has no call).

    Raises ``InvalidArgumentError`` for an unknown backend or ``fake`` without a config,
    ``FakeConfigError`` for a bad config, and the mapped ``NvmlError`` (e.g.
    ``NvmlLibraryNotFound``) when the real NVML cannot start.
    """
    if backend == "real":
        from gpuslice_nvml.real import RealNvml

        return RealNvml(driver_root)
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
    driver_root: Path = args.driver_root
    return open_nvml(backend, fake_config, driver_root)
