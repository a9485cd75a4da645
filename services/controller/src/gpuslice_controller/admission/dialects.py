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

HAMi lets an install rename its resources and set defaults (its chart values ``resourceName``,
``resourceMem``, ``resourceMemPercentage``, ``resourceCores``, ``resourcePriority``,
``defaultMem``, ``defaultCores``, ``defaultGPUNum``): :class:`HamiNames` holds them and
:func:`hami` builds that install's table; :class:`Dialects` is the set one controller translates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
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

    default_count: int = 1
    """GPUs of a container that names none (HAMi's ``defaultGPUNum``)."""
    default_cores: int = 0
    """Cores of a container that names none; 0: not asked (HAMi's ``defaultCores``)."""
    default_memory: int = 0
    """Memory (in ``memory_unit``) of a container that names neither memory nor a percentage;
    0: all of each GPU's memory (HAMi's ``defaultMem``)."""

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


#: HAMi's count resource, which is also the NVIDIA device plugin's and DRA's extended resource
#: mapping's: under this name a count alone is the plain whole-GPU request, not translated.
PLAIN_GPU = "nvidia.com/gpu"

#: An extended resource name: a DNS subdomain prefix, a slash, a name (no kubernetes.io prefix).
_EXTENDED_RESOURCE = re.compile(
    r"^(?!(?:[^/]*\.)?kubernetes\.io/)[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


def _flag(name: str) -> str:
    return "--hami-" + name.replace("_", "-")


@dataclass(frozen=True)
class HamiNames:
    """One HAMi install's resource names and defaults, as its chart values name them.

    A ``ValueError`` names the controller flag (``--hami-<field>``) and what it allows.
    """

    resource_name: str = PLAIN_GPU
    """``resourceName``: the number of vGPUs."""
    resource_mem: str = "nvidia.com/gpumem"
    """``resourceMem``: MiB of memory per vGPU."""
    resource_mem_percentage: str = "nvidia.com/gpumem-percentage"
    """``resourceMemPercentage``: percent of each GPU's memory."""
    resource_cores: str = "nvidia.com/gpucores"
    """``resourceCores``: percent of each GPU's SMs."""
    resource_priority: str = "nvidia.com/priority"
    """``resourcePriority``: a task priority with no DRA counterpart (removed, with a warning)."""
    default_mem: int = 0
    """``defaultMem``: MiB per vGPU when a container names neither memory resource; 0 = all."""
    default_cores: int = 0
    """``defaultCores``: percent of the SMs when a container names no cores; 0 = no limit."""
    default_gpu_num: int = 1
    """``defaultGPUNum``: vGPUs when a container asks for memory or cores without a count."""

    def __post_init__(self) -> None:
        names: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.name.startswith("resource_"):
                continue
            if not _EXTENDED_RESOURCE.match(value):
                raise ValueError(
                    f"{_flag(f.name)} {value!r} is not an extended resource name: a domain, a"
                    f" slash and a name, e.g. nvidia.com/gpumem (not in kubernetes.io)"
                )
            if value in names:
                raise ValueError(
                    f"{_flag(f.name)} {value!r} is also {_flag(names[value])}: each HAMi"
                    f" resource needs its own name"
                )
            names[value] = f.name
        if self.default_mem < 0:
            raise ValueError(f"--hami-default-mem {self.default_mem} must be 0 (all) or more MiB")
        if not 0 <= self.default_cores <= 100:
            raise ValueError(
                f"--hami-default-cores {self.default_cores} must be 0 (no limit) to 100 percent"
            )
        if self.default_gpu_num < 1:
            raise ValueError(f"--hami-default-gpu-num {self.default_gpu_num} must be at least 1")


def hami(names: HamiNames = HamiNames()) -> Dialect:
    """HAMi's table for an install with these resource names and defaults."""
    return Dialect(
        name="hami",
        title="HAMi",
        count=names.resource_name,
        count_alone_is_plain=names.resource_name == PLAIN_GPU,
        cores=names.resource_cores,
        memory=names.resource_mem,
        memory_unit=MIB,
        memory_percentage=names.resource_mem_percentage,
        ignored=(names.resource_priority,),
        mode_annotation="nvidia.com/vgpu-mode",
        selector_annotations=_hami_selectors("nvidia.com"),
        default_count=names.default_gpu_num,
        default_cores=names.default_cores,
        default_memory=names.default_mem,
    )


HAMI = hami()

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


@dataclass(frozen=True)
class Dialects:
    """The dialects one controller translates, and which of them owns each resource name."""

    all: tuple[Dialect, ...]
    by_resource: dict[str, Dialect] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        owners: dict[str, Dialect] = {}
        for d in self.all:
            for r in d.resources:
                if r in owners:
                    raise ValueError(
                        f"resource {r} is named by both {owners[r].title} and {d.title}; a"
                        f" renamed HAMi resource must not take another dialect's name"
                    )
                owners[r] = d
        object.__setattr__(self, "by_resource", owners)

    @classmethod
    def of(cls, hami_names: HamiNames = HamiNames()) -> Dialects:
        """Every dialect, HAMi with ``hami_names``."""
        first = HAMI if hami_names == HamiNames() else hami(hami_names)
        return cls((first, ALIYUN, VCUDA, DOCKER_VCUDA, QGPU, VOLCANO))

    @property
    def resources(self) -> tuple[str, ...]:
        """Every resource a pod is sent to the webhook for (a plain count alone is not)."""
        return tuple(
            r
            for d in self.all
            for r in d.resources
            if not (d.count_alone_is_plain and r == d.count)
        )


DEFAULT = Dialects.of()
"""The dialects with HAMi's own names and defaults."""

DIALECTS: tuple[Dialect, ...] = DEFAULT.all

BY_RESOURCE: dict[str, Dialect] = DEFAULT.by_resource
"""Which dialect owns an extended resource name (each name has exactly one owner)."""
