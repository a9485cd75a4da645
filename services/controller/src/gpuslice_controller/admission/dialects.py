"""The pod request dialects of other GPU-sharing systems, as tables.

Each :class:`Dialect` names the extended resources (and pod labels or annotations) one system's
users write, their units, and how count, cores and memory combine. ``translate`` reads these
tables and holds the only logic; a new dialect is a new table entry, not new code.

Rules every dialect shares (``translate`` applies them; docs/controller.md explains why):

- values are whole numbers; limits win over requests, and a request that differs from its limit
  is denied. A value of 0 for cores, memory or a memory percentage means "not asked" (HAMi-core,
  vCUDA and gpushare all read 0 as "no limit").
- ``cores`` are percent of one GPU's SMs, per GPU; ``memory`` is per GPU unless the dialect says
  it is the container's total (:attr:`Dialect.memory_is_total`).
- a request with neither cores below 100 nor memory is a whole GPU (exclusive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuslice_api.quantity import GIB, MIB

VCUDA_MEMORY_UNIT = 256 * MIB
"""tkestack gpu-manager's memory block (``types.MemoryBlockSize``): one unit = 256 MiB."""

MatchRule = Literal["contains-ignore-case", "exact"]


@dataclass(frozen=True)
class SelectorAnnotation:
    """A pod annotation holding a comma-separated list that restricts which GPUs may be chosen.

    ``attribute``: the device attribute (in the driver's domain) the entries are compared with;
    ``match``: how one entry matches the attribute; ``exclude``: the listed GPUs are forbidden
    instead of required (a GPU must match one entry of a use-list and none of a nouse-list).
    """

    key: str
    attribute: str
    match: MatchRule
    exclude: bool


@dataclass(frozen=True)
class Dialect:
    """One system's way of asking for GPUs in a container's resources."""

    name: str
    """DNS label: template names, the ``gpu.gpuslice.dev/dialect`` label, the annotation."""
    title: str
    """For people: messages and docs."""

    count: str | None = None
    """Extended resource: the number of GPUs (default 1 when other resources are asked)."""
    count_label: str | None = None
    """Pod label that gives the number of GPUs when the container has no count resource."""
    count_alone_is_plain: bool = False
    """The count resource alone is the plain whole-GPU request another component serves (HAMi's
    ``nvidia.com/gpu``): it selects this dialect only together with the dialect's other resources
    or annotations."""

    cores: str | None = None
    """Extended resource: percent of one GPU's SMs (1..100), per GPU."""
    cores_count_whole_gpus: bool = False
    """vCUDA style: cores below 100 are a share of one GPU, multiples of 100 are that many whole
    GPUs (memory is then ignored), anything else is denied."""
    cores_with_count: bool = True
    """False: cores cannot be combined with more than one GPU (denied)."""

    memory: str | None = None
    """Extended resource: GPU memory, in ``memory_unit``."""
    memory_unit: int = MIB
    memory_is_total: bool = False
    """The memory is the container's total, split evenly over its GPUs (must divide evenly)."""
    memory_percentage: str | None = None
    """Extended resource: percent (1..100) of each GPU's memory; ``memory`` wins when both are
    given, as in HAMi."""

    ignored: tuple[str, ...] = ()
    """Extended resources that have no DRA counterpart: removed, with a warning."""
    mode_annotation: str | None = None
    """Pod annotation choosing the sharing mode; the value ``mig`` is denied (MIG devices are
    asked for with the ``mig.gpuslice.dev`` class, not translated)."""
    selector_annotations: tuple[SelectorAnnotation, ...] = ()

    @property
    def resources(self) -> tuple[str, ...]:
        """Every extended resource this dialect owns, in table order."""
        named = (self.count, self.cores, self.memory, self.memory_percentage, *self.ignored)
        return tuple(n for n in named if n)

    @property
    def annotations(self) -> tuple[str, ...]:
        """Every pod annotation this dialect reads."""
        keys = [a.key for a in self.selector_annotations]
        if self.mode_annotation:
            keys.append(self.mode_annotation)
        return tuple(keys)


def _hami_selectors(prefix: str) -> tuple[SelectorAnnotation, ...]:
    # HAMi's checkGPUtype: strings.Contains(ToUpper(cardType), ToUpper(entry)), so "A100"
    # matches "NVIDIA A100-SXM4-40GB"; CheckUUID: exact match of the trimmed entry.
    return (
        SelectorAnnotation(f"{prefix}/use-gputype", "productName", "contains-ignore-case", False),
        SelectorAnnotation(f"{prefix}/nouse-gputype", "productName", "contains-ignore-case", True),
        SelectorAnnotation(f"{prefix}/use-gpuuuid", "uuid", "exact", False),
        SelectorAnnotation(f"{prefix}/nouse-gpuuuid", "uuid", "exact", True),
    )


HAMI = Dialect(
    name="hami",
    title="HAMi",
    count="nvidia.com/gpu",
    count_alone_is_plain=True,
    cores="nvidia.com/gpucores",
    memory="nvidia.com/gpumem",
    memory_unit=MIB,
    memory_percentage="nvidia.com/gpumem-percentage",
    ignored=("nvidia.com/priority",),
    mode_annotation="nvidia.com/vgpu-mode",
    selector_annotations=_hami_selectors("nvidia.com"),
)

ALIYUN = Dialect(
    name="aliyun",
    title="Aliyun gpushare/cGPU",
    count="aliyun.com/gpu-count",
    count_label="aliyun.com/gpu-count",
    cores="aliyun.com/gpu-core.percentage",
    cores_with_count=False,
    memory="aliyun.com/gpu-mem",
    memory_unit=GIB,
    memory_is_total=True,
)

VCUDA = Dialect(
    name="vcuda",
    title="tkestack vCUDA",
    cores="tencent.com/vcuda-core",
    cores_count_whole_gpus=True,
    memory="tencent.com/vcuda-memory",
    memory_unit=VCUDA_MEMORY_UNIT,
)

DOCKER_VCUDA = Dialect(
    name="docker-vcuda",
    title="docker.com vCUDA",
    cores="docker.com/vcuda-core",
    cores_count_whole_gpus=True,
    memory="docker.com/vcuda-memory",
    memory_unit=VCUDA_MEMORY_UNIT,
)

QGPU = Dialect(
    name="qgpu",
    title="Tencent qGPU/Elastic GPU",
    cores="tke.cloud.tencent.com/qgpu-core",
    cores_count_whole_gpus=True,
    memory="tke.cloud.tencent.com/qgpu-memory",
    memory_unit=GIB,
)

VOLCANO = Dialect(
    name="volcano",
    title="Volcano vGPU",
    count="volcano.sh/vgpu-number",
    cores="volcano.sh/vgpu-cores",
    memory="volcano.sh/vgpu-memory",
    memory_unit=MIB,
    memory_percentage="volcano.sh/vgpu-memory-percentage",
    mode_annotation="volcano.sh/vgpu-mode",
)

DIALECTS: tuple[Dialect, ...] = (HAMI, ALIYUN, VCUDA, DOCKER_VCUDA, QGPU, VOLCANO)

BY_RESOURCE: dict[str, Dialect] = {r: d for d in DIALECTS for r in d.resources}
"""Which dialect owns an extended resource name (each name has exactly one owner)."""
