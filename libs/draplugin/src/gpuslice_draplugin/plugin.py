"""What a driver implements, and what it hands back: the contract between a DRA driver and the
helper (``gpuslice_draplugin.start``).

A driver implements ``Plugin``: ``prepare`` and ``unprepare`` get the claims of one kubelet call
and answer per claim, keyed by claim UID — prepared devices or an exception for ``prepare``,
``None`` or an exception for ``unprepare``. One bad claim never fails the call: the helper puts
each exception's text into that claim's ``error`` field, and a claim the plugin leaves out (or
a call that raises) becomes an error of those claims only. Optionally a driver gives a
``HealthSource`` for the kubelet's health stream. It publishes its devices as ``Pool``s of plain
v1-shaped dicts (``Helper.publish``).
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it: namespace, name and UID — nothing else comes with a
    NodePrepareResources call; the rest is in the ResourceClaim (``Helper.claims``)."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a claim's NodePrepareResources answer. ``share_id`` goes out on v1 only
    (v1beta1 has no such field)."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


#: One claim's prepare answer: its devices, or what went wrong (its text is the claim's error).
PrepareResult = Sequence[PreparedDevice] | Exception


class Plugin(Protocol):
    """The driver's side of the DRA calls. Both methods may run concurrently (one kubelet call
    per pod); each answers every claim it was given, keyed by UID."""

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]: ...

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, Exception | None]: ...


@dataclass(frozen=True)
class DeviceHealth:
    """One device's health for the kubelet's stream; ``pool`` empty = the node's pool."""

    device: str
    healthy: bool
    message: str
    updated: float  # seconds since the epoch of the last change
    pool: str = ""


class HealthSource(Protocol):
    """Where the health stream comes from: ``subscribe`` returns a queue that gets the health of
    every device at once, then again after every change."""

    def subscribe(self) -> queue.Queue[list[DeviceHealth]]: ...

    def unsubscribe(self, q: queue.Queue[list[DeviceHealth]]) -> None: ...


@dataclass(frozen=True)
class Pool:
    """What one pool should hold: resource.k8s.io/v1-shaped devices (``name``, ``attributes``,
    ``capacity``, ``taints``, ``consumesCounters``, …) and counter sets (``name``,
    ``counters``). The helper splits them into slices and converts them for older servers."""

    devices: Sequence[Mapping[str, Any]] = ()
    shared_counters: Sequence[Mapping[str, Any]] = ()
