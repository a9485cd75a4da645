"""Real GPU models the fake can simulate, with the numbers their drivers report.

Each model carries what NVML reports on the real GPU: the product name, ``memory.total``
in MiB (as ``nvidia-smi`` prints it), SM count, compute capability, PCI device id and, for MIG
GPUs, the GPU-instance profile table of ``nvidia-smi mig -lgip`` / ``-lgipp``: NVML enum, driver
profile id, slices, instance count, SMs, memory (``memorySizeMB``), engines and placements.
Profile *names* are not stored: they are computed from the memory numbers with go-nvlib's rule
(``gpuslice_nvml.profiles``), and a test checks they come out as NVIDIA spells them.

Sources: NVIDIA's MIG user guide profile tables, ``nvidia-smi`` output quoted in NVIDIA issue
trackers (H200: mig-parted #120), go-nvml's mock GPU tables. See docs/nvml.md for the numbers
that are least certain.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice_nvml import profiles as p
from gpuslice_nvml.types import MIB, ComputeInstanceProfile, GpuInstanceProfile, Placement

#: MIG GPUs of these generations have 8 memory slices and 7 compute slices.
MEMORY_SLICES = 8
COMPUTE_SLICES = 7


@dataclass(frozen=True, slots=True)
class GiProfileSpec:
    """One row of a GPU-instance profile table."""

    nvml_profile: int
    id: int
    memory_slices: int
    instance_count: int
    multiprocessors: int
    memory_mib: int
    copy_engines: int
    decoders: int
    jpeg_decoders: int
    ofa_engines: int
    starts: tuple[int, ...]
    encoders: int = 0

    @property
    def slice_count(self) -> int:
        return p.GI_PROFILE_SLICES[self.nvml_profile]


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A GPU model of the catalog."""

    #: Short catalog key used in configs ("H100-SXM5-80GB").
    key: str
    #: ``nvmlDeviceGetName``.
    product_name: str
    memory_mib: int
    multiprocessors: int
    cuda_compute_capability: tuple[int, int]
    architecture: str
    brand: str
    pci_device_id: int
    #: NVLinks per GPU (0: PCIe only).
    max_nvlinks: int
    gi_profiles: tuple[GiProfileSpec, ...] = ()
    #: Other names a config may use ("H200").
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def mig_capable(self) -> bool:
        return bool(self.gi_profiles)

    def gpu_instance_profiles(self) -> tuple[GpuInstanceProfile, ...]:
        """The profile table as NVML reports it, names computed."""
        return tuple(self._gi_profile(spec) for spec in self.gi_profiles)

    def _gi_profile(self, spec: GiProfileSpec) -> GpuInstanceProfile:
        return GpuInstanceProfile(
            name=p.gi_profile_name(spec.nvml_profile, spec.memory_mib, self.memory_bytes),
            nvml_profile=spec.nvml_profile,
            id=spec.id,
            slice_count=spec.slice_count,
            memory_slices=spec.memory_slices,
            instance_count=spec.instance_count,
            multiprocessors=spec.multiprocessors,
            memory_mib=spec.memory_mib,
            copy_engines=spec.copy_engines,
            decoders=spec.decoders,
            encoders=spec.encoders,
            jpeg_decoders=spec.jpeg_decoders,
            ofa_engines=spec.ofa_engines,
            p2p_supported=False,
            placements=tuple(Placement(s, spec.memory_slices) for s in spec.starts),
        )

    def compute_instance_profiles(
        self, gi: GpuInstanceProfile
    ) -> tuple[ComputeInstanceProfile, ...]:
        """The compute-instance profiles a GPU instance of profile ``gi`` offers.

        Sizes follow go-nvlib's rule; a ``c``-slice compute instance gets the SMs of the plain
        ``c``-slice GPU-instance profile (the whole instance's SMs when it spans it).
        """
        sms_by_slices = {
            s.slice_count: s.multiprocessors
            for s in self.gi_profiles
            if s.nvml_profile in _PLAIN_GI_PROFILES
        }
        result = []
        for c in sorted(p.CI_PROFILE_FOR_SLICES):
            if c > gi.slice_count or not p.ci_profile_allowed(c, gi.slice_count):
                continue
            enum = p.CI_PROFILE_FOR_SLICES[c]
            starts = p.ci_placement_starts(c, gi.slice_count)
            sms = gi.multiprocessors if c == gi.slice_count else sms_by_slices[c]
            name = p.ci_profile_name(c, gi.nvml_profile, gi.memory_mib, self.memory_bytes)
            result.append(
                ComputeInstanceProfile(
                    name=name,
                    nvml_profile=enum,
                    id=enum,
                    gpu_instance_profile_id=gi.id,
                    slice_count=c,
                    instance_count=len(starts),
                    multiprocessors=sms,
                    placements=tuple(Placement(s, c) for s in starts),
                )
            )
        return tuple(result)


_PLAIN_GI_PROFILES = frozenset({p.GI_1_SLICE, p.GI_2_SLICE, p.GI_3_SLICE, p.GI_4_SLICE})

_ONE_SLICE = tuple(range(7))


def _table(
    mem: tuple[int, int, int, int, int, int, int],
    sms: tuple[int, int, int, int, int, int, int],
    engines: tuple[tuple[int, int, int, int], ...],
) -> tuple[GiProfileSpec, ...]:
    """The 7-row table A100/H100/H200 share: 1g, 1g+me, 1g (2 memory slices), 2g, 3g, 4g, 7g.

    ``mem``/``sms`` are per row; ``engines`` are (copy, decoder, jpeg, ofa) per row.
    """
    layout = (
        # enum, driver id, memory slices, max instances, starts
        (p.GI_1_SLICE, 19, 1, 7, _ONE_SLICE),
        (p.GI_1_SLICE_REV1, 20, 1, 1, _ONE_SLICE),
        (p.GI_1_SLICE_REV2, 15, 2, 4, (0, 2, 4, 6)),
        (p.GI_2_SLICE, 14, 2, 3, (0, 2, 4)),
        (p.GI_3_SLICE, 9, 4, 2, (0, 4)),
        (p.GI_4_SLICE, 5, 4, 1, (0,)),
        (p.GI_7_SLICE, 0, 8, 1, (0,)),
    )
    return tuple(
        GiProfileSpec(
            nvml_profile=enum,
            id=driver_id,
            memory_slices=mslices,
            instance_count=count,
            multiprocessors=sms[row],
            memory_mib=mem[row],
            copy_engines=engines[row][0],
            decoders=engines[row][1],
            jpeg_decoders=engines[row][2],
            ofa_engines=engines[row][3],
            starts=starts,
        )
        for row, (enum, driver_id, mslices, count, starts) in enumerate(layout)
    )


# Engines (CE, NVDEC, NVJPG, OFA) per row, from the MIG user guide's profile tables.
_AMPERE_ENGINES = ((1, 0, 0, 0), (1, 1, 1, 1), (1, 1, 0, 0), (2, 1, 0, 0), (3, 2, 0, 0),
                   (4, 2, 0, 0), (7, 5, 1, 1))  # fmt: skip
_HOPPER_ENGINES = ((1, 1, 1, 0), (1, 1, 1, 1), (1, 1, 1, 0), (2, 2, 2, 0), (3, 3, 3, 0),
                   (4, 4, 4, 0), (8, 7, 7, 1))  # fmt: skip
_AMPERE_SMS = (14, 14, 14, 28, 42, 56, 98)
_HOPPER_SMS = (16, 16, 26, 32, 60, 64, 132)

A100_SXM4_40GB = GpuModel(
    key="A100-SXM4-40GB",
    aliases=("A100-40GB",),
    product_name="NVIDIA A100-SXM4-40GB",
    memory_mib=40960,
    multiprocessors=108,
    cuda_compute_capability=(8, 0),
    architecture="Ampere",
    brand="Nvidia",
    pci_device_id=0x20B010DE,
    max_nvlinks=12,
    gi_profiles=_table(
        mem=(4864, 4864, 9856, 9856, 19968, 19968, 40192),
        sms=_AMPERE_SMS,
        engines=_AMPERE_ENGINES,
    ),
)

A100_SXM4_80GB = GpuModel(
    key="A100-SXM4-80GB",
    aliases=("A100-80GB",),
    product_name="NVIDIA A100-SXM4-80GB",
    memory_mib=81920,
    multiprocessors=108,
    cuda_compute_capability=(8, 0),
    architecture="Ampere",
    brand="Nvidia",
    pci_device_id=0x20B210DE,
    max_nvlinks=12,
    gi_profiles=_table(
        mem=(9856, 9856, 19968, 19968, 40192, 40192, 80384),
        sms=_AMPERE_SMS,
        engines=_AMPERE_ENGINES,
    ),
)

H100_SXM5_80GB = GpuModel(
    key="H100-SXM5-80GB",
    aliases=("H100-80GB", "H100"),
    product_name="NVIDIA H100 80GB HBM3",
    memory_mib=81559,
    multiprocessors=132,
    cuda_compute_capability=(9, 0),
    architecture="Hopper",
    brand="Nvidia",
    pci_device_id=0x233010DE,
    max_nvlinks=18,
    gi_profiles=_table(
        mem=(9984, 9984, 20096, 20096, 40448, 40448, 81152),
        sms=_HOPPER_SMS,
        engines=_HOPPER_ENGINES,
    ),
)

H200_SXM_141GB = GpuModel(
    key="H200-SXM-141GB",
    aliases=("H200",),
    product_name="NVIDIA H200",
    memory_mib=143771,
    multiprocessors=132,
    cuda_compute_capability=(9, 0),
    architecture="Hopper",
    brand="Nvidia",
    pci_device_id=0x233510DE,
    max_nvlinks=18,
    gi_profiles=_table(
        # a real H200, driver 580.159.04 (2026-11-26); mig-parted #120's older driver had
        # 256 MiB less in every profile of two or more memory slices
        mem=(16384, 16384, 33280, 33280, 71424, 71424, 143360),
        sms=_HOPPER_SMS,
        engines=_HOPPER_ENGINES,
    ),
)

L4 = GpuModel(
    key="L4",
    product_name="NVIDIA L4",
    memory_mib=23034,
    multiprocessors=58,
    cuda_compute_capability=(8, 9),
    architecture="Ada Lovelace",
    brand="Nvidia",
    pci_device_id=0x27B810DE,
    max_nvlinks=0,
)

T4 = GpuModel(
    key="T4",
    product_name="Tesla T4",
    memory_mib=15360,
    multiprocessors=40,
    cuda_compute_capability=(7, 5),
    architecture="Turing",
    brand="Nvidia",
    pci_device_id=0x1EB810DE,
    max_nvlinks=0,
)

CATALOG: tuple[GpuModel, ...] = (
    A100_SXM4_40GB,
    A100_SXM4_80GB,
    H100_SXM5_80GB,
    H200_SXM_141GB,
    L4,
    T4,
)


def find_model(name: str) -> GpuModel | None:
    """The model whose key, alias or product name is ``name``; case, spaces and dashes do not
    matter, so GPU Feature Discovery's "NVIDIA-H100-80GB-HBM3" finds the H100 too."""
    wanted = _normalize(name)
    for model in CATALOG:
        if wanted in {_normalize(n) for n in (model.key, model.product_name, *model.aliases)}:
            return model
    return None


def _normalize(name: str) -> str:
    return "-".join(name.replace("_", " ").replace("-", " ").split()).casefold()


def describe_catalog() -> str:
    """``KEY ("product name")`` for every model, for error messages."""
    return ", ".join(f'{m.key} ("{m.product_name}")' for m in CATALOG)
