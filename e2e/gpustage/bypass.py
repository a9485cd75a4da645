"""The bypass: a process in an MPS share's container that does not use MPS.

Legacy MPS limits hold only for clients of the share's daemon. A process in the same cgroup
without ``CUDA_MPS_PIPE_DIRECTORY`` would run unconstrained, so the enforcer must either keep it
from creating a context (the GPU in EXCLUSIVE_PROCESS compute mode while MPS shares exist) or
treat it as unenforced: freeze it (SM) or kill it (memory) within two sampling periods of its
context appearing. The legitimate client of the share runs beside it the whole time; its rate is
reported with and without the bypasser (without: the "SM 30 alone" figure of the same share
size).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from e2e.gpustage.clients import EXIT_CONTEXT, Line, WorkloadProcess, frozen, move_into
from e2e.gpustage.enforcer import SAMPLE_INTERVAL_S
from e2e.gpustage.harness import (
    START_TIMEOUT_S,
    Bench,
    containers,
    percent,
    share,
    sm_result,
    start_container,
    steady_rate,
)
from e2e.gpustage.measure import MEMORY_LIMIT
from e2e.gpustage.report import Row, judged
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb

#: how long the stage watches for the enforcer to act after the bypasser's context exists
WATCH_S = 3.0
ACTING = (pb.ACTION_THROTTLED, pb.ACTION_KILLED)
FIGURE = "non-MPS process in the share"
TARGET = "no context, or frozen/killed <= 2 periods"


def bypass(bench: Bench, alone_percent: float | None) -> list[Row]:
    figure, target = FIGURE, TARGET
    with share(bench, "bypass", 30, MEMORY_LIMIT) as shared, containers(bench) as made:
        legit = start_container(bench, made, shared, f"{bench.mechanism}-legit", bench.sm())
        if legit.proc.ready(START_TIMEOUT_S) is None:
            reason = f"the legitimate client did not start: {legit.proc.describe_end()}"
            return [Row("bypass", bench.mechanism, figure, "-", target, "fail", reason)]
        # Same cgroups as the legitimate client, none of the share's environment.
        rogue = bench.launcher.start(f"{bench.mechanism}-bypass", bench.sm())
        made[1].append(rogue)
        move_into(rogue.pid, legit.cgroups)
        acting = Acting(bench, shared.id, legit.cgroups, rogue)
        acting.calibrate()
        go_at = time.monotonic()
        rogue.go()
        ready = _started(rogue, acting)
        data: dict[str, object] = {"sample_interval_s": SAMPLE_INTERVAL_S}
        if ready is not None:
            row = _watch(bench, acting, ready.at, data)
        elif acting.seen:  # acted on before it could say it had a context
            first, at = acting.first()
            data.update(acting.data, first=first, after_go_s=at - go_at)
            value = f"{acting.name(first)} before its ready line"
            row = Row("bypass", bench.mechanism, figure, value, target, "pass", data=data)
        else:
            rogue.finish(10)
            refused = rogue.proc.returncode == EXIT_CONTEXT
            data["bypasser_end"] = rogue.describe_end()
            row = Row(
                "bypass",
                bench.mechanism,
                figure,
                "context refused" if refused else rogue.describe_end(),
                target,
                judged(refused),
                "" if refused else "the bypasser neither started nor was refused a context",
                data,
            )
        if not acting.count_frozen:
            note = "the client's cgroup was frozen before the bypasser started; not counted"
            row.detail = "; ".join(filter(None, [row.detail, note]))
        rows = [row]
        try:
            result = sm_result(legit.proc, bench.seconds + START_TIMEOUT_S)
        except RuntimeError as exc:
            figure = "legit client beside it"
            rows.append(Row("bypass", bench.mechanism, figure, "-", "-", "fail", str(exc)))
            return rows
        rogue.stop()
    beside = percent(steady_rate(result), bench.baseline_rate)
    alone = f"{alone_percent:.1f} %" if alone_percent is not None else "not measured"
    rows.append(
        Row(
            "bypass",
            bench.mechanism,
            "legit client: with / without bypasser",
            f"{beside:.1f} % / {alone} of baseline",
            "(reported)",
            "measured",
            data={"with_percent": beside, "without_percent": alone_percent, "result": result},
        )
    )
    return rows


class Acting:
    """Signs that the enforcer acted on the bypasser: its cgroup frozen, a THROTTLED/KILLED
    violation of the share, its death by a signal; each with the moment it was first seen."""

    def __init__(
        self, bench: Bench, share_id: str, cgroups: Sequence[Path], rogue: WorkloadProcess
    ) -> None:
        self.bench, self.share_id, self.cgroups, self.rogue = bench, share_id, cgroups, rogue
        self.since = time.monotonic()
        self.seen: dict[str, float] = {}
        self.data: dict[str, object] = {}
        self.action = ""
        self.count_frozen = True

    def calibrate(self, seconds: float = 3 * SAMPLE_INTERVAL_S) -> None:
        """Before the bypasser goes: if the legitimate client's cgroup is frozen on its own (it
        is then no MPS client either), a frozen cgroup says nothing about the bypasser."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.count_frozen:
            self.count_frozen = not frozen(self.cgroups)
            time.sleep(0.01)
        if not self.count_frozen:
            self.data["frozen_before_bypasser"] = True

    def check(self) -> None:
        now = time.monotonic()
        if self.count_frozen and "frozen" not in self.seen and frozen(self.cgroups):
            self.seen["frozen"] = now
        if "violation" not in self.seen:
            found = self.bench.enforcer.violations.first(self.about_rogue, since=self.since)
            if found is not None:
                self.seen["violation"] = found.at
                self.action = pb.Action.Name(found.violation.action).removeprefix("ACTION_")
                self.data["violation"] = {
                    "action": self.action,
                    "resource": pb.Resource.Name(found.violation.resource),
                    "pid": found.violation.pid,
                    "message": found.violation.message,
                }
        code = self.rogue.proc.poll()
        if "killed" not in self.seen and code is not None and code < 0:
            self.seen["killed"] = now

    def about_rogue(self, v: pb.Violation) -> bool:
        """A THROTTLED/KILLED violation of the share that names the bypasser (its pid, or in
        the message: a throttle acts on the share's cgroups and names the cause there), so one
        the legitimate client caused is not taken for the bypasser's."""
        pid = self.rogue.pid
        names = v.pid == pid or f"pid {pid} " in f"{v.message} "
        return v.share_id == self.share_id and v.action in ACTING and names

    def first(self) -> tuple[str, float]:
        first = min(self.seen, key=lambda k: self.seen[k])
        return first, self.seen[first]

    def name(self, what: str) -> str:
        return f"{self.action} violation" if what == "violation" else what


def _started(rogue: WorkloadProcess, acting: Acting) -> Line | None:
    """The bypasser's ready line; None when it ended first (refused a context, or killed) or
    the enforcer acted on it before it could print one."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ready = rogue.ready(0.01)
        if ready is not None:
            return ready
        acting.check()
        if acting.seen or rogue.proc.poll() is not None:
            return None
    return None


def _watch(bench: Bench, acting: Acting, ready_at: float, data: dict[str, object]) -> Row:
    """From the bypasser's ready line: the first sign that the enforcer acted on it."""
    deadline = ready_at + WATCH_S
    while time.monotonic() < deadline and len(acting.seen) < 3:
        acting.check()
        time.sleep(0.01)
    data.update(acting.data)
    data["evidence_s"] = {what: at - ready_at for what, at in acting.seen.items()}
    if not acting.seen:
        return Row(
            "bypass",
            bench.mechanism,
            FIGURE,
            f"ran unconstrained for {WATCH_S:g} s",
            TARGET,
            "fail",
            "a context outside MPS, and the enforcer neither froze nor killed it",
            data,
        )
    first, at = acting.first()
    reaction = max(0.0, at - ready_at)
    periods = reaction / SAMPLE_INTERVAL_S
    data.update(first=first, reaction_s=reaction, periods=periods)
    value = f"{acting.name(first)} after {periods:.1f} periods ({reaction * 1000:.0f} ms)"
    return Row("bypass", bench.mechanism, FIGURE, value, TARGET, judged(periods <= 2.0), data=data)
