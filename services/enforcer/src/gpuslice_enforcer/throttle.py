"""SM throttling by duty cycles: a credit bucket per share and GPU.

Each sampling period the watchdog measures a share's SM use ``u`` (percent of the GPU, summed
over its processes) over the last ``dt`` seconds. The share earns ``limit x dt`` and spends
``u x dt`` percent-seconds; the balance (its credit) is capped at ``limit x burst_s``. While the
credit is negative the share's cgroups stay frozen for the next period, which earns credit back
(a frozen share uses nothing). Over time the share therefore uses exactly ``limit`` on average,
whatever its demand, with an error of at most one period's use — and a share that stays under
its limit only ever gains credit, so it is never frozen.

Work-conserving shares run unthrottled while nothing else on the GPU uses SMs, and their debt is
forgiven then (so contention starts from a clean slate). A strict cap (not work-conserving) is
throttled whenever it is over its limit.

The controller is pure: time comes in as ``dt``, so it is tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Others' SM use below this (percent) counts as an idle GPU for work-conserving shares.
IDLE_PERCENT = 1.0
#: The deepest debt, in seconds of full-GPU use (bounds how long one burst keeps a share frozen).
MAX_DEBT_S = 2.0


@dataclass
class Bucket:
    """The throttling state of one share on one GPU."""

    limit_percent: float
    burst_s: float
    credit: float = 0.0
    frozen: bool = False
    throttled_s: float = 0.0

    def __post_init__(self) -> None:
        self.credit = self.cap  # a new share starts with a full bucket

    @property
    def cap(self) -> float:
        return self.limit_percent * self.burst_s

    def step(
        self,
        used_percent: float,
        dt: float,
        *,
        others_percent: float = 0.0,
        work_conserving: bool = False,
    ) -> bool:
        """Account one period; returns whether the share should be frozen for the next one."""
        if self.frozen:
            self.throttled_s += dt
        if work_conserving and others_percent < IDLE_PERCENT:
            self.credit = min(max(self.credit, 0.0), self.cap)
            self.frozen = False
            return False
        self.credit += (self.limit_percent - used_percent) * dt
        self.credit = max(min(self.credit, self.cap), -100.0 * MAX_DEBT_S)
        self.frozen = self.credit < 0
        return self.frozen
