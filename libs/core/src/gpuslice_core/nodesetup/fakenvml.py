"""The fake NVML node config of this node (docs/nvml.md): the chart's one config for every node,
named after the node so that every fake node gets its own GPU UUIDs."""

from __future__ import annotations

import json
from pathlib import Path

from gpuslice_core.files import atomic_write_bytes
from gpuslice_core.nodesetup.report import log


def write_fake_config(src: Path, dst: Path, node_name: str, set_name: bool) -> None:
    """Write ``src`` to ``dst`` atomically, plus ``name: <node_name>`` when ``set_name``."""
    text = src.read_text()
    if set_name:
        text = text.rstrip("\n") + f"\nname: {json.dumps(node_name)}\n"
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(dst, text.encode(), mode=0o644)
    log(f"fake NVML config for node {node_name or '?'} written to {dst}")
