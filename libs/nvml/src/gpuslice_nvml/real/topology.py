"""NVLink wiring from NVML: which active links of a GPU end where.

``nvidia-smi topo -m`` prints ``NV<n>`` for two GPUs joined by ``n`` links. Direct links end at
the other GPU's PCI address. On NVSwitch systems (HGX) every link ends at a switch, and any two
GPUs on the fabric reach each other over all their links, so the count is the smaller of the
two GPUs' switch-link counts.
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpuslice_nvml import errors as e
from gpuslice_nvml.real.calls import error_code, map_error, normalize_bus_id

NVLINK_GPU = 0x00
NVLINK_SWITCH = 0x02

#: (remote PCI bus id, remote device type) of one active link.
NvLinkEnd = tuple[str, int]


def nvlink_ends(index: int, h: Any) -> list[NvLinkEnd]:
    """The far ends of a GPU's active NVLinks (empty on PCIe-only GPUs)."""
    ends: list[NvLinkEnd] = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
        except pynvml.NVMLError as exc:
            if error_code(exc) in (e.ERROR_NOT_SUPPORTED, e.ERROR_INVALID_ARGUMENT):
                continue
            raise map_error(exc, f"nvmlDeviceGetNvLinkState(GPU {index}, link {link})") from exc
        try:
            kind = int(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link))
        except pynvml.NVMLError:
            kind = NVLINK_GPU  # drivers without the call predate NVSwitch reporting
        ends.append((normalize_bus_id(remote.busId), kind))
    return ends


def nvlinks_between(ends_a: list[NvLinkEnd], ends_b: list[NvLinkEnd], bus_id_b: str) -> int:
    direct = sum(1 for bus, kind in ends_a if kind == NVLINK_GPU and bus == bus_id_b)
    if direct:
        return direct
    switch_a = sum(1 for _, kind in ends_a if kind == NVLINK_SWITCH)
    switch_b = sum(1 for _, kind in ends_b if kind == NVLINK_SWITCH)
    return min(switch_a, switch_b)
