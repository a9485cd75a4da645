"""Print what NVML sees on this node: GPUs, MIG profiles and instances, topology.

python -m gpuslice_nvml.inventory                      # the real GPUs
python -m gpuslice_nvml.inventory --nvml=fake --fake-nvml-config e2e/fixtures/sample-node.yaml
python -m gpuslice_nvml.inventory --json ...           # the same as one JSON document
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from gpuslice_core.cli import EnvArgumentParser
from gpuslice_core.errors import GpusliceError
from gpuslice_nvml.errors import NvmlGpuLost
from gpuslice_nvml.interface import Nvml
from gpuslice_nvml.select import add_nvml_arguments, nvml_from_args
from gpuslice_nvml.types import GIB, GpuInfo, GpuInstanceProfile


@dataclasses.dataclass
class Inventory:
    """Everything the report shows, gathered once."""

    backend: str
    driver_version: str
    cuda_version: str
    gpus: list[GpuInfo]
    lost: list[int]
    profiles: dict[str, list[GpuInstanceProfile]]
    instances: dict[int, list[dict[str, Any]]]
    free: dict[int, dict[str, int]]
    topology: list[list[str]]


def collect(nvml: Nvml) -> Inventory:
    system = nvml.system_info()
    gpus: list[GpuInfo] = []
    lost: list[int] = []
    for index in range(nvml.device_count()):
        try:
            gpus.append(nvml.gpu(index))
        except NvmlGpuLost:
            lost.append(index)
    profiles: dict[str, list[GpuInstanceProfile]] = {}
    instances: dict[int, list[dict[str, Any]]] = {}
    free: dict[int, dict[str, int]] = {}
    for gpu in gpus:
        if gpu.mig_capable and gpu.name not in profiles:
            profiles[gpu.name] = nvml.gpu_instance_profiles(gpu.index)
        if gpu.mig_enabled:
            instances[gpu.index] = _instances(nvml, gpu.index)
            free[gpu.index] = {
                p.name: nvml.remaining_capacity(gpu.index, p.id) for p in profiles[gpu.name]
            }
    live = [g.index for g in gpus]
    topology = [[nvml.topology(a, b).label for b in live] for a in live]
    return Inventory(
        backend=nvml.backend,
        driver_version=system.driver_version,
        cuda_version=system.cuda_version,
        gpus=gpus,
        lost=lost,
        profiles=profiles,
        instances=instances,
        free=free,
        topology=topology,
    )


def _instances(nvml: Nvml, gpu: int) -> list[dict[str, Any]]:
    devices = {(d.gpu_instance_id, d.compute_instance_id): d for d in nvml.mig_devices(gpu)}
    rows = []
    for gi in nvml.gpu_instances(gpu):
        cis = nvml.compute_instances(gpu, gi.id)
        rows.append(
            {
                "gpuInstance": gi.id,
                "profile": gi.profile_name,
                "profileId": gi.profile_id,
                "placement": str(gi.placement),
                "computeInstances": [
                    {
                        "id": ci.id,
                        "profile": ci.profile_name,
                        "uuid": ci.uuid,
                        "multiprocessors": devices[(gi.id, ci.id)].multiprocessors,
                    }
                    for ci in cis
                ],
            }
        )
    return rows


def render_text(inv: Inventory) -> str:
    out: list[str] = []
    count = len(inv.gpus) + len(inv.lost)
    out.append(
        f"Node ({inv.backend} NVML): driver {inv.driver_version}, CUDA {inv.cuda_version}, "
        f"{count} GPU{'s' if count != 1 else ''}"
    )
    for gpu in inv.gpus:
        out.append("")
        out.extend(_gpu_block(gpu))
    for index in inv.lost:
        out.extend(["", f"GPU {index}  LOST (fell off the bus; NVML calls fail with GPU_IS_LOST)"])
    for name, profiles in inv.profiles.items():
        indices = ", ".join(str(g.index) for g in inv.gpus if g.name == name)
        out.extend(["", f"MIG profiles of {name} (GPU {indices})"])
        out.extend(_profile_table(profiles))
    for index, rows in inv.instances.items():
        out.extend(["", f"MIG instances on GPU {index}"])
        out.extend(_instance_table(rows))
        room = ", ".join(f"{n} x{c}" for n, c in inv.free[index].items() if c)
        out.append(f"  still fits (each profile on its own): {room or 'nothing'}")
    if inv.topology:
        out.extend(["", "Topology", *_topology(inv)])
    return "\n".join(out) + "\n"


def _gpu_block(gpu: GpuInfo) -> list[str]:
    if gpu.mig_mode is None:
        mig = "not supported"
    else:
        mig = "enabled" if gpu.mig_mode.current else "disabled"
        if gpu.mig_mode.reset_required:
            mig += f" ({'enable' if gpu.mig_mode.pending else 'disable'} pending a GPU reset)"
    numa = "-" if gpu.numa_node is None else str(gpu.numa_node)
    return [
        f"GPU {gpu.index}  {gpu.name}",
        f"  UUID                {gpu.uuid}",
        f"  Memory              {gpu.memory_total_bytes / GIB:.1f} GiB"
        f" ({gpu.memory_total_mib} MiB)",
        f"  SMs                 {gpu.multiprocessors}",
        f"  Compute capability  {gpu.cuda_compute_capability_str} ({gpu.architecture})",
        f"  PCI                 {gpu.pci_bus_id}  device 0x{gpu.pci_device_id:08X}"
        f"  root {gpu.pcie_root or '-'}  NUMA {numa}",
        f"  MIG                 {mig}",
    ]


def _profile_table(profiles: list[GpuInstanceProfile]) -> list[str]:
    header = "  PROFILE      ID  MAX  SMS   MEMORY      CE DEC ENC JPG OFA  PLACEMENTS (start:size)"
    lines = [header]
    for p in profiles:
        starts = ",".join(str(pl.start) for pl in p.placements)
        lines.append(
            f"  {p.name:<12} {p.id:>2}  {p.instance_count:>3}  {p.multiprocessors:>3}  "
            f"{p.memory_mib:>6} MiB  {p.copy_engines:>3} {p.decoders:>3} {p.encoders:>3} "
            f"{p.jpeg_decoders:>3} {p.ofa_engines:>3}  {{{starts}}}:{p.memory_slices}"
        )
    return lines


def _instance_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["  GI  PROFILE      PLACEMENT  CI  CI PROFILE     SMS  MIG UUID"]
    for row in rows:
        head = f"  {row['gpuInstance']:>2}  {row['profile']:<12} {row['placement']:<9}"
        if not row["computeInstances"]:
            lines.append(f"{head}  --  (no compute instance)")
        for ci in row["computeInstances"]:
            sms = ci["multiprocessors"]
            lines.append(f"{head}  {ci['id']:>2}  {ci['profile']:<13} {sms:>4}  {ci['uuid']}")
            head = " " * len(head)
    return lines


def _topology(inv: Inventory) -> list[str]:
    names = [f"GPU{g.index}" for g in inv.gpus]
    width = max(6, *(len(n) + 2 for n in names))
    lines = ["  " + " " * 6 + "".join(n.ljust(width) for n in names) + "NUMA"]
    for gpu, row in zip(inv.gpus, inv.topology, strict=True):
        numa = "-" if gpu.numa_node is None else str(gpu.numa_node)
        lines.append(f"  {f'GPU{gpu.index}':<6}" + "".join(c.ljust(width) for c in row) + numa)
    lines.append(
        "  X = self, NV# = # NVLinks, PHB = same PCIe host bridge, NODE = same NUMA node, "
        "SYS = across NUMA nodes (PIX/PXB: PCIe switches)"
    )
    return lines


def to_json(inv: Inventory) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        return json.loads(json.dumps(dataclasses.asdict(value), default=str))

    return {
        "backend": inv.backend,
        "driverVersion": inv.driver_version,
        "cudaDriverVersion": inv.cuda_version,
        "gpus": [plain(g) for g in inv.gpus],
        "lostGpus": inv.lost,
        "migProfiles": {name: [plain(p) for p in ps] for name, ps in inv.profiles.items()},
        "migInstances": {str(k): v for k, v in inv.instances.items()},
        "migRoom": {str(k): v for k, v in inv.free.items()},
        "topology": {"gpus": [g.index for g in inv.gpus], "matrix": inv.topology},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = EnvArgumentParser(
        prog="python -m gpuslice_nvml.inventory",
        description="Show the GPUs, MIG profiles, MIG instances and topology NVML reports.",
    )
    add_nvml_arguments(parser)
    parser.add_argument("--json", action="store_true", help="Print one JSON document.")
    args = parser.parse_args(argv)
    try:
        with nvml_from_args(args) as nvml:
            inventory = collect(nvml)
    except GpusliceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(to_json(inventory), indent=2))
    else:
        sys.stdout.write(render_text(inventory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
