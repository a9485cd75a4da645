"""GPU health as every gpuslice service that watches it does it: the health flags, the event loop
with its periodic recovery check, and the rule for when a fault has recovered.

What a fault *means* stays with each service (the kubelet plugin taints ResourceSlice devices,
the device plugin marks ListAndWatch devices Unhealthy); this module only feeds them events,
tells them when to check, and decides which of their faults may be cleared:

    add_health_arguments(parser, ...)          # --health-recovery, --xid-quiet-period, ...
    watch_health(nvml, stop, check_interval=10, on_event=handle, on_check=check_recovery)
    cleared = recovered(faults, nvml, now=now, quiet_period=300)
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from gpuslice_core.cli import EnvArgumentParser, positive_seconds
from gpuslice_core.logging import get_logger
from gpuslice_nvml.errors import NvmlError
from gpuslice_nvml.interface import Nvml
from gpuslice_nvml.types import HealthEvent

log = get_logger(__name__)

# XIDs that applications cause (illegal address, graphics exception, ...): not the GPU's fault
APP_XIDS = frozenset({13, 31, 43, 45, 68, 109})

K = TypeVar("K", bound=Hashable)


def parse_xids(value: str) -> frozenset[int]:
    """A comma-separated list of XID numbers, for argparse."""
    try:
        return frozenset(int(x) for x in value.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a comma-separated list of XID numbers"
        ) from exc


def add_health_arguments(
    parser: EnvArgumentParser, *, recovery_help: str, quiet_help: str, ignored_help: str
) -> None:
    """``--health-recovery``, ``--xid-quiet-period``, ``--health-check-interval`` and
    ``--ignored-xids`` (env GPUSLICE_HEALTH_RECOVERY, GPUSLICE_XID_QUIET_PERIOD,
    GPUSLICE_HEALTH_CHECK_INTERVAL, GPUSLICE_IGNORED_XIDS), with the service's own words for
    what recovery and ignoring do."""
    parser.add_bool_flag(
        "--health-recovery", deprecated=["HEALTH_RECOVERY"], default=True, help=recovery_help
    )
    parser.add_flag(
        "--xid-quiet-period",
        deprecated=["XID_QUIET_PERIOD"],
        type=positive_seconds,
        default=300.0,
        help=quiet_help,
    )
    parser.add_flag(
        "--health-check-interval",
        deprecated=["HEALTH_CHECK_INTERVAL"],
        type=positive_seconds,
        default=10.0,
        help="Seconds between recovery checks of unhealthy GPUs.",
    )
    parser.add_flag(
        "--ignored-xids",
        deprecated=["IGNORED_XIDS"],
        type=parse_xids,
        default=",".join(str(x) for x in sorted(APP_XIDS)),
        help=ignored_help,
    )


def watch_health(
    nvml: Nvml,
    stop: threading.Event,
    *,
    check_interval: float,
    on_event: Callable[[HealthEvent], object],
    on_check: Callable[[], object],
    on_watching: Callable[[], object] | None = None,
    poll: float = 1.0,
) -> None:
    """Hand every NVML health event to ``on_event`` and call ``on_check`` every
    ``check_interval`` seconds until ``stop`` is set; ``on_watching`` once the watch exists
    (events from then on count). Raises NvmlError when NVML cannot watch events at all; a failed
    wait is logged and retried a second later."""
    watch = nvml.watch_events()
    if on_watching is not None:
        on_watching()
    next_check = time.monotonic() + check_interval
    with watch:
        while not stop.is_set():
            try:
                event = watch.wait(min(poll, check_interval))
            except NvmlError as exc:
                log.warning("health event wait failed", error=str(exc))
                stop.wait(1.0)
                continue
            if event is not None:
                on_event(event)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + check_interval
                on_check()


def gpu_answers(nvml: Nvml, gpu: int) -> bool:
    """Whether GPU ``gpu`` answers NVML again (its handle and its memory)."""
    try:
        nvml.gpu(gpu)
        nvml.memory_info(gpu)
    except NvmlError:
        return False
    return True


def recovered(
    faults: Iterable[tuple[K, int, float, bool]], nvml: Nvml, *, now: float, quiet_period: float
) -> list[K]:
    """The keys of the faults ``(key, gpu, last seen, gpu lost)`` that may be cleared: quiet for
    ``quiet_period`` (a lost GPU: at once) and on a GPU that answers NVML (asked once per GPU,
    and only for faults that are quiet)."""
    answers: dict[int, bool] = {}
    out: list[K] = []
    for key, gpu, last, lost in faults:
        if not (lost or now - last >= quiet_period):
            continue
        if gpu not in answers:
            answers[gpu] = gpu_answers(nvml, gpu)
        if answers[gpu]:
            out.append(key)
    return out
