"""The credit bucket, driven by a simulated clock: no sleeping, exact arithmetic."""

from __future__ import annotations

import random

import pytest

from gpuslice_enforcer.throttle import MAX_DEBT_S, Bucket

DT = 0.1


def simulate(
    limit: float,
    demand: float,
    seconds: float,
    *,
    noise: float = 0.0,
    others: float = 50.0,
    work_conserving: bool = False,
    seed: int = 1,
) -> tuple[float, float]:
    """(average use over the second half, fraction of periods frozen) of a share whose
    processes want ``demand`` percent whenever they are not frozen."""
    rng = random.Random(seed)
    bucket = Bucket(limit, burst_s=0.5)
    frozen = False
    used_total = frozen_periods = periods = 0.0
    steps = int(seconds / DT)
    for i in range(steps):
        used = 0.0 if frozen else max(0.0, demand + rng.uniform(-noise, noise))
        frozen = bucket.step(used, DT, others_percent=others, work_conserving=work_conserving)
        if i >= steps // 2:
            used_total += used * DT
            frozen_periods += frozen
            periods += 1
    return used_total / (periods * DT), frozen_periods / periods


@pytest.mark.parametrize(("limit", "demand"), [(30, 80), (10, 100), (70, 90), (50, 51), (5, 60)])
def test_long_run_use_converges_to_the_limit(limit: float, demand: float) -> None:
    average, _ = simulate(limit, demand, 60)
    assert average == pytest.approx(limit, abs=1.0)


def test_noisy_demand_still_converges() -> None:
    average, _ = simulate(30, 80, 60, noise=20)
    assert average == pytest.approx(30, abs=1.5)


@pytest.mark.parametrize("demand", [0, 10, 29, 30])
def test_a_share_under_or_at_its_limit_is_never_frozen(demand: float) -> None:
    average, frozen = simulate(30, demand, 30)
    assert frozen == 0
    assert average == pytest.approx(demand)


def test_work_conserving_share_runs_free_on_an_idle_gpu_and_is_capped_under_contention() -> None:
    alone, frozen = simulate(30, 80, 20, others=0.0, work_conserving=True)
    assert alone == pytest.approx(80) and frozen == 0
    contended, _ = simulate(30, 80, 40, others=40.0, work_conserving=True)
    assert contended == pytest.approx(30, abs=1.0)


def test_strict_cap_is_throttled_even_on_an_idle_gpu() -> None:
    average, frozen = simulate(30, 80, 40, others=0.0, work_conserving=False)
    assert average == pytest.approx(30, abs=1.0) and frozen > 0.5


def test_debt_is_bounded() -> None:
    bucket = Bucket(10, burst_s=0.5)
    for _ in range(1000):
        bucket.step(100, DT)
    assert bucket.credit == -100 * MAX_DEBT_S
    periods = 0
    while bucket.step(0, DT):  # frozen, earning 10%/s back
        periods += 1
    assert periods * DT == pytest.approx(100 * MAX_DEBT_S / 10, abs=DT)
