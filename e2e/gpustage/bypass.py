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

from e2e.gpustage.clients import EXIT_CONTEXT, WorkloadProcess, frozen, move_into
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


def bypass(bench: Bench, alone_percent: float | None) -> list[Row]:
    figure, target = "non-MPS process in the share", "no context, or frozen/killed <= 2 periods"
    with share(bench, "bypass", 30, MEMORY_LIMIT) as shared, containers(bench) as made:
        legit = start_container(bench, made, shared, f"{bench.mechanism}-legit", bench.sm())
        if legit.proc.ready(START_TIMEOUT_S) is None:
            reason = f"the legitimate client did not start: {legit.proc.describe_end()}"
            return [Row("bypass", bench.mechanism, figure, "-", target, "fail", reason)]
        # Same cgroups as the legitimate client, none of the share's environment.
        rogue = bench.launcher.start(f"{bench.mechanism}-bypass", bench.sm())
        made[1].append(rogue)
        move_into(rogue.pid, legit.cgroups)
        rogue.go()
        ready = rogue.ready(START_TIMEOUT_S)
        data: dict[str, object] = {"sample_interval_s": SAMPLE_INTERVAL_S}
        if ready is None:
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
        else:
            row = _watch(bench, shared.id, legit.cgroups, rogue, ready.at, data)
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


def _watch(
    bench: Bench,
    share_id: str,
    cgroups: Sequence[Path],
    rogue: WorkloadProcess,
    ready_at: float,
    data: dict[str, object],
) -> Row:
    """After the bypasser's ready line: the first sign that the enforcer acted on it — its
    cgroup frozen, a THROTTLED/KILLED violation of the share, or its death by a signal."""
    figure, target = "non-MPS process in the share", "no context, or frozen/killed <= 2 periods"
    seen: dict[str, float] = {}
    acted = ""
    deadline = ready_at + WATCH_S
    while time.monotonic() < deadline and len(seen) < 3:
        now = time.monotonic()
        if "frozen" not in seen and frozen(cgroups):
            seen["frozen"] = now
        violation = bench.enforcer.violations.first(
            lambda v: v.share_id == share_id and v.action in ACTING, since=ready_at - 1.0
        )
        if violation is not None and "violation" not in seen:
            seen["violation"] = violation.at
            acted = pb.Action.Name(violation.violation.action).removeprefix("ACTION_")
            data["violation"] = {
                "action": pb.Action.Name(violation.violation.action),
                "resource": pb.Resource.Name(violation.violation.resource),
                "pid": violation.violation.pid,
                "message": violation.violation.message,
            }
        code = rogue.proc.poll()
        if "killed" not in seen and code is not None and code < 0:
            seen["killed"] = now
        time.sleep(0.01)
    data["evidence_s"] = {what: at - ready_at for what, at in seen.items()}
    if not seen:
        return Row(
            "bypass",
            bench.mechanism,
            figure,
            f"ran unconstrained for {WATCH_S:g} s",
            target,
            "fail",
            "a context outside MPS, and the enforcer neither froze nor killed it",
            data,
        )
    first = min(seen, key=lambda k: seen[k])
    reaction = max(0.0, seen[first] - ready_at)
    periods = reaction / SAMPLE_INTERVAL_S
    data.update(first=first, reaction_s=reaction, periods=periods)
    what = f"{acted} violation" if first == "violation" else first
    return Row(
        "bypass",
        bench.mechanism,
        figure,
        f"{what} after {periods:.1f} periods ({reaction * 1000:.0f} ms)",
        target,
        judged(periods <= 2.0),
        data=data,
    )
