"""Time-sliced contexts: what the fake lists per tick, and what each really gets."""

from __future__ import annotations

from collections import Counter

from gpuslice_nvml.fake.timeslice import TickListing, TimeSlicedGpu


def test_contexts_that_fit_the_gpu_are_listed_as_they_are() -> None:
    assert TickListing().pick(0, 1, {10: 60, 11: 30}) == {10: 60, 11: 30}


def test_an_oversubscribed_gpu_lists_one_context_per_tick_in_proportion() -> None:
    """As an H100 lists two busy contexts: one per tick at ~100 %, in turn."""
    ticks = TickListing()
    listed: Counter[int] = Counter()
    for tick in range(100):
        (pid, sm), *rest = ticks.pick(0, tick, {10: 100, 11: 100, 12: 50}).items()
        assert not rest and sm == 100
        listed[pid] += 1
    assert listed == {10: 40, 11: 40, 12: 20}
    assert ticks.pick(0, 99, {10: 100, 11: 100, 12: 50}) == {pid: 100}  # the same tick again


def test_what_each_context_gets_is_split_between_the_runnable_ones() -> None:
    """Two contexts at 100 %: half each while both are runnable, all of it alone."""
    now = [0.0]
    runnable = {1: 0, 2: 0}
    meter = TimeSlicedGpu(
        {1: 100, 2: 100}, tick_s=3600, clock=lambda: now[0], runnable_ns=runnable.get
    )
    with meter as gpu:  # ticked by hand below, not by its thread
        for step in range(10):  # 1 s: process 2 frozen for the second half
            now[0] += 0.1
            runnable[1] += 100_000_000
            if step < 5:
                runnable[2] += 100_000_000
            gpu.tick()
    assert abs(gpu.share(1) - 0.75) < 1e-6 and abs(gpu.share(2) - 0.25) < 1e-6
