"""Placement planning for one GPU: which instances to keep, which to destroy, where to create.

Pure functions over the profile table NVML reports (placements, memory slices, compute slices,
instance counts); no NVML call is made here. mig-parted tries permutations of *create calls*
until the driver accepts one (and fails on orders the driver's own placement choice cannot
complete, mig-parted #29); we instead search placements on paper, then create every instance
at an explicit placement, so the outcome is decided before anything changes and is the same on
every run.

Rules a plan obeys, as the driver enforces them: placements of different instances do not share
a memory slice; the compute slices of all instances fit in the GPU's (the largest profile's
slice count, 7 on A100/H100); a profile has at most ``max_instances`` instances.

The search keeps as many of the existing instances as the layout can use (so re-applying a
layout changes nothing and switching layouts destroys only what must go), never destroys a
*pinned* instance (held by a claim or a running process), and places the rest largest first,
lowest start first, backtracking where a choice leaves no room (A100-40GB ``all-balanced``: a
3g.20gb at 0 would strand one of the two 1g.5gb, so it goes to 4).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpuslice_nvml import GpuInstanceProfile, Placement


@dataclass(frozen=True)
class Shape:
    """What planning needs of a GPU-instance profile."""

    id: int
    name: str
    compute_slices: int
    memory_slices: int
    max_instances: int
    placements: tuple[Placement, ...]

    @classmethod
    def of(cls, profile: GpuInstanceProfile) -> Shape:
        return cls(
            id=profile.id,
            name=profile.name,
            compute_slices=profile.slice_count,
            memory_slices=profile.memory_slices,
            max_instances=profile.instance_count,
            placements=tuple(sorted(profile.placements)),
        )


def total_compute_slices(profiles: Iterable[GpuInstanceProfile]) -> int:
    """The GPU's compute slices: those of its largest profile (7 on A100/H100/H200)."""
    return max((p.slice_count for p in profiles), default=0)


@dataclass(frozen=True)
class Present:
    """A GPU instance that exists now."""

    gpu_instance_id: int
    shape: Shape
    placement: Placement
    #: The profile of its only compute instance; ``None`` when it has none or several.
    device_profile: str | None
    #: Why it must not be destroyed ("claim abc", "processes 42"); empty when it may be.
    pinned_by: str = ""

    def describe(self) -> str:
        return f"GPU instance {self.gpu_instance_id} ({self.shape.name} at {self.placement})"


@dataclass(frozen=True)
class Want:
    """One MIG device a layout asks for: a GPU instance of ``shape`` with one compute instance
    of ``device_profile`` (the shape's own name for a full-size compute instance)."""

    device_profile: str
    shape: Shape


@dataclass(frozen=True)
class NewInstance:
    device_profile: str
    shape: Shape
    placement: Placement


@dataclass
class Plan:
    keep: list[Present] = field(default_factory=list)
    destroy: list[Present] = field(default_factory=list)
    create: list[NewInstance] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return bool(self.destroy or self.create)


class PlanError(Exception):
    """No plan exists. ``blocked`` is True when pinned instances are what stands in the way, so
    waiting may help; otherwise the layout can never fit the GPU."""

    def __init__(self, message: str, *, blocked: bool) -> None:
        super().__init__(message)
        self.blocked = blocked


@dataclass(frozen=True)
class _Occupant:
    shape: Shape
    placement: Placement


def plan(wants: Sequence[Want], present: Sequence[Present], total_compute: int) -> Plan:
    """Decide how to turn ``present`` into ``wants``; raise :class:`PlanError` when impossible."""
    remaining = Counter(w.device_profile for w in wants)
    shapes = {w.device_profile: w.shape for w in wants}
    pinned = sorted((p for p in present if p.pinned_by), key=lambda p: p.gpu_instance_id)

    def usable(p: Present) -> str | None:
        """The wanted device profile ``p`` can serve as, if any."""
        dp = p.device_profile
        return dp if dp is not None and dp in shapes and shapes[dp].id == p.shape.id else None

    stuck = []
    for p in pinned:
        dp = usable(p)
        if dp is not None and remaining[dp] > 0:
            remaining[dp] -= 1
            continue
        stuck.append(p)
    if stuck:
        raise PlanError(
            "; ".join(
                f"{p.describe()} is not part of the layout and is held by {p.pinned_by}"
                for p in stuck
            ),
            blocked=True,
        )
    optional = sorted(
        (p for p in present if not p.pinned_by and usable(p) is not None),
        key=lambda p: p.gpu_instance_id,
    )
    for size in range(len(optional), -1, -1):
        for extra in itertools.combinations(optional, size):
            counts = Counter(usable(p) or "" for p in extra)
            if any(counts[k] > remaining[k] for k in counts):
                continue
            keep = [*pinned, *extra]
            left = remaining - counts
            todo = list(_expand(left, shapes))
            created = fit(todo, [_Occupant(p.shape, p.placement) for p in keep], total_compute)
            if created is not None:
                kept = {p.gpu_instance_id for p in keep}
                return Plan(
                    keep=sorted(keep, key=lambda p: p.gpu_instance_id),
                    destroy=[p for p in present if p.gpu_instance_id not in kept],
                    create=created,
                )
    wanted = ", ".join(
        f"{c}x {n}" for n, c in sorted(Counter(w.device_profile for w in wants).items())
    )
    if pinned:
        held = "; ".join(f"{p.describe()} held by {p.pinned_by}" for p in pinned)
        raise PlanError(f"{wanted} does not fit next to the instances in use: {held}", blocked=True)
    raise PlanError(
        f"{wanted} does not fit the GPU (memory slices, compute slices or instance counts)",
        blocked=False,
    )


def fit(
    wants: Sequence[Want], occupied: Sequence[_Occupant], total_compute: int
) -> list[NewInstance] | None:
    """Placements for ``wants`` next to ``occupied``, or ``None`` if there are none."""
    items = sorted(
        wants,
        key=lambda w: (
            -w.shape.memory_slices,
            -w.shape.compute_slices,
            w.shape.id,
            w.device_profile,
        ),
    )
    compute_used = sum(o.shape.compute_slices for o in occupied)
    if compute_used + sum(w.shape.compute_slices for w in items) > total_compute:
        return None
    counts = Counter(o.shape.id for o in occupied)
    for w in items:
        counts[w.shape.id] += 1
        if counts[w.shape.id] > w.shape.max_instances:
            return None
    taken = [o.placement for o in occupied]
    chosen: list[Placement] = []

    def search(i: int) -> bool:
        if i == len(items):
            return True
        item = items[i]
        floor = -1
        if i > 0 and items[i - 1] == item:  # identical items: placements in increasing order
            floor = chosen[i - 1].start
        for placement in item.shape.placements:
            if placement.start <= floor:
                continue
            if any(placement.overlaps(t) for t in taken) or any(
                placement.overlaps(c) for c in chosen
            ):
                continue
            chosen.append(placement)
            if search(i + 1):
                return True
            chosen.pop()
        return False

    if not search(0):
        return None
    return [NewInstance(w.device_profile, w.shape, p) for w, p in zip(items, chosen, strict=True)]


def pick_placement(
    shape: Shape, present: Sequence[Present], total_compute: int
) -> Placement | None:
    """The lowest free placement for one more instance of ``shape``, or ``None``."""
    occupants = [_Occupant(p.shape, p.placement) for p in present]
    created = fit([Want(shape.name, shape)], occupants, total_compute)
    return created[0].placement if created else None


def check_placement(
    shape: Shape, placement: Placement, present: Sequence[Present], total_compute: int
) -> str | None:
    """Why one more ``shape`` instance cannot go at ``placement``; ``None`` when it can."""
    for p in present:
        if p.placement.overlaps(placement):
            return f"{shape.name} at {placement} overlaps {p.describe()}"
    same = sum(1 for p in present if p.shape.id == shape.id)
    if same >= shape.max_instances:
        return f"{shape.name} allows {shape.max_instances} instances per GPU and {same} exist"
    used = sum(p.shape.compute_slices for p in present)
    if used + shape.compute_slices > total_compute:
        return (
            f"{shape.name} needs {shape.compute_slices} compute slices and"
            f" {total_compute - used} of {total_compute} are free"
        )
    return None


def _expand(counts: Counter[str], shapes: dict[str, Shape]) -> Iterable[Want]:
    for name in sorted(counts):
        for _ in range(counts[name]):
            yield Want(name, shapes[name])
