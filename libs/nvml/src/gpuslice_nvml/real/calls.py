"""Calling pynvml: error mapping, start-up, and decoding of what NVML returns."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from gpuslice_nvml import errors as e

T = TypeVar("T")

#: go-nvlib's ``GetArchitectureAsString`` names.
ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}

#: go-nvlib's ``GetBrandAsString`` names.
BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}

#: go-nvlib's ``GetAddressingModeAsString`` names (NVML_DEVICE_ADDRESSING_MODE_*).
ADDRESSING_MODES = {0: "None", 1: "HMM", 2: "ATS"}

_INIT_HINTS = {
    e.ERROR_LIBRARY_NOT_FOUND: (
        "install the NVIDIA driver, and point --driver-root (env GPUSLICE_DRIVER_ROOT) at its "
        "root as this process sees it (the chart mounts it at /driver-root), or give the "
        "container the driver's libraries through the NVIDIA Container Toolkit; "
        "use --nvml=fake to run without a GPU"
    ),
    e.ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel module is not loaded on this node",
    e.ERROR_NO_PERMISSION: "no permission to open the /dev/nvidia* device nodes",
    e.ERROR_LIB_RM_VERSION_MISMATCH: (
        "libnvidia-ml and the loaded kernel module are different driver versions; "
        "reboot or reload the driver after an upgrade"
    ),
}


def error_code(exc: pynvml.NVMLError) -> int:
    value = getattr(exc, "value", e.ERROR_UNKNOWN)
    return value if isinstance(value, int) else e.ERROR_UNKNOWN


def map_error(exc: pynvml.NVMLError, what: str) -> e.NvmlError:
    """The gpuslice error for a pynvml error (raise it ``from exc``)."""
    code = error_code(exc)
    detail = "" if e.has_description(code) else str(exc)
    return e.nvml_error(code, what, detail)


def call(what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with pynvml errors turned into :class:`~gpuslice_nvml.errors.NvmlError`."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise map_error(exc, what) from exc


def init(not_found: str = "") -> None:
    """``nvmlInit`` with an error that says what to do about it (``not_found``: which paths
    were tried, put before the hint when no library could be loaded)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        code = error_code(exc)
        hint = _INIT_HINTS.get(code, "")
        if code == e.ERROR_LIBRARY_NOT_FOUND and not_found:
            hint = f"{not_found}; {hint}"
        raise e.nvml_error(code, "nvmlInit", hint) from exc


def shutdown() -> None:
    with contextlib.suppress(pynvml.NVMLError):  # nothing useful to do on the way out
        pynvml.nvmlShutdown()


def text(value: bytes | str) -> str:
    """NVML strings arrive as ``str`` from decorated calls and ``bytes`` from struct fields."""
    return value.decode(errors="replace").rstrip("\x00") if isinstance(value, bytes) else value


def normalize_bus_id(raw: bytes | str) -> str:
    """``00000000:18:00.0`` -> ``0000:18:00.0`` (lower case, 4-digit domain)."""
    value = text(raw).strip().lower()
    domain, rest = value.split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def sysfs_pcie_root(bus_id: str, sysfs: Path = Path("/sys/bus/pci/devices")) -> str | None:
    """The ``pciDDDD:BB`` root complex above a PCI device, from its sysfs path."""
    try:
        resolved = (sysfs / bus_id).resolve(strict=True)
    except OSError:
        return None
    return next((part for part in resolved.parts if part.startswith("pci")), None)


def sysfs_numa_node(bus_id: str, sysfs: Path = Path("/sys/bus/pci/devices")) -> int | None:
    try:
        value = int((sysfs / bus_id / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def cores_per_sm(major: int, minor: int) -> int | None:
    """CUDA cores per SM for a compute capability (to derive SMs from the core count)."""
    if major == 7 or (major, minor) in ((6, 0), (8, 0)):
        return 64
    if major >= 8 or major == 6:
        return 128
    return None
