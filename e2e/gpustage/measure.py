"""The measurements of one enforcement mechanism, each a small experiment with real processes.

Every experiment makes its own share and its own "containers" (fresh cgroups, a workload moved
into them and attached to the share, the share's environment), and undoes all of it before it
returns, whatever happened, in the order a pod ends: processes killed, their cgroups removed,
then the share released. Rates are the workload's kernels per second, steady state (the first
second left out: start-up and a watchdog share's burst credit), as a percentage of the
unconstrained baseline run with the same ``--iterations``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from e2e.gpustage.clients import (
    Launcher,
    WorkloadProcess,
    attach,
    move_into,
    share_env,
    thaw,
)
from e2e.gpustage.enforcer import SAMPLE_INTERVAL_S, StageEnforcer, limit_mechanisms, median
from e2e.gpustage.report import GIB, Row, Verdict, gib, judged
from gpuslice_enforcer.testing import Cgroups
from gpuslice_nvml import Nvml, NvmlError
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb

MIB = 1 << 20
MEMORY_LIMIT = 4 * GIB
MEMORY_ASK = 6 * GIB
PAIR_TOLERANCE = 5.0  # points
OVERHEAD_TARGET = 2.0  # percent
LATENCY_SHARES = 6  # the first, then the median of the next five
#: what a workload may take to start (interpreter, CUDA, MPS connection) before it is late
START_TIMEOUT_S = 60.0


@dataclass
class Bench:
    """What every experiment of one mechanism needs."""

    nvml: Nvml
    enforcer: StageEnforcer
    launcher: Launcher
    gpu_uuid: str
    memory_total: int
    seconds: float
    iterations: int
    baseline_rate: float
    mechanism: str  # the section's label: "watchdog", "mps-legacy", …
    mode: pb.EnforcementMode.ValueType
    #: why the outcome of a limit cannot be judged on this backend ("" when it can)
    unjudged: str = ""
    #: every cgroup the experiments made (all removed by the time they return)
    cgroups_made: list[Path] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def claim(self, what: str) -> str:
        return f"gpustage-{self.mechanism}-{what}-{next(self._ids)}"

    def verdict(self, ok: bool, mechanism: str) -> Verdict:
        """Judged, except a limit that MPS holds where MPS's effect cannot be seen."""
        return "measured" if self.unjudged and mechanism.startswith("mps") else judged(ok)

    def note(self, row: Row) -> Row:
        """Say why a row that has a target was only measured."""
        if row.verdict == "measured" and row.target != "(reported)":
            row.detail = "; ".join(filter(None, [row.detail, self.unjudged]))
        return row

    def sm(self, *, start_at: float | None = None) -> list[str]:
        command = ["sm", "--seconds", f"{self.seconds:g}", "--iterations", str(self.iterations)]
        return command + (["--start-at", f"{start_at:.3f}"] if start_at else [])


@dataclass
class Container:
    proc: WorkloadProcess
    cgroups: list[Path]


@dataclass(frozen=True)
class Share:
    claim: str
    reply: pb.CreateShareResponse

    @property
    def id(self) -> str:
        return self.reply.share_id

    def mechanism(self, resource: str, default: str) -> str:
        return limit_mechanisms(self.reply).get(resource, default)


@contextlib.contextmanager
def share(bench: Bench, what: str, cores: int, memory: int) -> Iterator[Share]:
    claim = bench.claim(what)
    reply, _ = bench.enforcer.create(
        claim, bench.gpu_uuid, cores=cores, memory=memory, mode=bench.mode
    )
    try:
        yield Share(claim, reply)
    finally:
        bench.enforcer.release(claim)


@contextlib.contextmanager
def containers(bench: Bench) -> Iterator[tuple[Cgroups, list[WorkloadProcess]]]:
    """Cgroups and processes of one experiment: processes killed first, then cgroups removed
    (each logged in ``bench.cgroups_made``, so the stage can check that none is left)."""
    with Cgroups() as cgroups:
        procs: list[WorkloadProcess] = []
        try:
            yield cgroups, procs
        finally:
            for proc in procs:
                proc.kill()
            thaw(cgroups.made)  # a process killed while frozen dies when thawed
            for proc in procs:
                proc.stop()
            bench.cgroups_made.extend(cgroups.made)


def start_container(
    bench: Bench,
    made: tuple[Cgroups, list[WorkloadProcess]],
    shared: Share | None,
    name: str,
    command: Sequence[str],
) -> Container:
    """A workload in fresh cgroups, attached to the share (as the CDI hook would) with the
    share's environment, then let go."""
    cgroups, procs = made
    env = share_env(shared.reply.container_edits) if shared is not None else {}
    proc = bench.launcher.start(name, command, env)
    procs.append(proc)
    dirs = cgroups.container()
    move_into(proc.pid, dirs)
    if shared is not None:
        attach(bench.enforcer.containers, shared.reply, shared.claim, f"ctr-{name}", proc.pid)
    proc.go()
    return Container(proc, dirs)


def steady_rate(result: dict[str, object]) -> float:
    """Kernels per second without the first second (two 0.5 s windows) when the run is long
    enough to leave at least two windows; else the run's own rate."""
    windows = result.get("windows")
    if isinstance(windows, list) and len(windows) >= 4:
        tail = [float(w) for w in windows[2:]]
        return sum(tail) / len(tail)
    rate = result.get("rate", 0.0)
    return float(rate) if isinstance(rate, int | float) else 0.0


def sm_result(proc: WorkloadProcess, timeout: float) -> dict[str, object]:
    """The sm result of a finished workload; RuntimeError naming how it ended otherwise."""
    if proc.finish(timeout) is None:
        raise RuntimeError(f"{proc.name} did not finish within {timeout:g} s")
    result = proc.result
    if not result or not result.get("ok"):
        raise RuntimeError(f"{proc.name}: {proc.describe_end()}")
    return result


def percent(rate: float, baseline: float) -> float:
    return 100.0 * rate / baseline if baseline > 0 else float("nan")


class BreachWatch:
    """Polls NVML (every 10 ms, as the enforcer sees it) for the first moment a process uses
    more than ``limit`` bytes: the breach a reaction time is counted from. The workload's own
    progress lines would start the clock late on a real GPU, where the context's memory counts
    too."""

    def __init__(self, nvml: Nvml, device: str, pid: int, limit: int) -> None:
        self.nvml, self.device, self.pid, self.limit = nvml, device, pid, limit
        self.breach_at: float | None = None
        self.max_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="breach", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                used = [
                    p.used_memory_bytes or 0
                    for p in self.nvml.running_processes(self.device)
                    if p.pid == self.pid
                ]
            except NvmlError:
                used = []
            if used:
                self.max_used = max(self.max_used, used[0])
                if used[0] > self.limit and self.breach_at is None:
                    self.breach_at = time.monotonic()
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# -- experiments --------------------------------------------------------------------------


def latency(bench: Bench) -> tuple[Row, Share]:
    """CreateShare latency: the first share (for MPS it starts the daemon) and the median of
    the next ones. Returns the row and the first share, which the caller keeps until the
    mechanism's experiments are done so that the daemon is not restarted for each of them."""
    times: list[float] = []
    shares: list[Share] = []
    for _ in range(LATENCY_SHARES):
        claim = bench.claim("latency")
        reply, took = bench.enforcer.create(
            claim, bench.gpu_uuid, cores=30, memory=MEMORY_LIMIT, mode=bench.mode
        )
        times.append(took)
        shares.append(Share(claim, reply))
    for later in shares[1:]:
        bench.enforcer.release(later.claim)
    first, rest = times[0], median(times[1:])
    row = Row(
        "latency",
        bench.mechanism,
        "CreateShare: first / median of next",
        f"{first * 1000:.0f} ms / {rest * 1000:.1f} ms",
        "-",
        "measured",
        data={"first_s": first, "median_next_s": rest, "all_s": times},
    )
    return row, shares[0]


def memory_limit(bench: Bench) -> Row:
    """Allocate 6 GiB under a 4 GiB limit: refused at the limit, or killed within two
    sampling periods of passing it (the progress line that first reads above the limit)."""
    figure = f"alloc {gib(MEMORY_ASK)} under {gib(MEMORY_LIMIT)}"
    target = "refused, or killed <= 2 periods"
    command = ["alloc", "--bytes", str(MEMORY_ASK), "--chunk", str(256 * MIB), "--hold", "3"]
    with share(bench, "memory", 100, MEMORY_LIMIT) as shared, containers(bench) as made:
        mechanism = shared.mechanism("memory", bench.mechanism)
        ctr = start_container(bench, made, shared, f"{bench.mechanism}-alloc", command)
        watch = BreachWatch(bench.nvml, bench.gpu_uuid, ctr.proc.pid, MEMORY_LIMIT)
        try:
            code = ctr.proc.finish(START_TIMEOUT_S + 10)
        finally:
            watch.stop()
        progress = [line for line in ctr.proc.lines if "allocated" in line.data]
        over = next((ln for ln in progress if _int(ln.data["allocated"]) > MEMORY_LIMIT), None)
        under = [ln for ln in progress if _int(ln.data["allocated"]) <= MEMORY_LIMIT]
        killed = bench.enforcer.violations.first(
            lambda v: v.share_id == shared.id and v.action == pb.ACTION_KILLED
        )
        data: dict[str, object] = {
            "limit_bytes": MEMORY_LIMIT,
            "asked_bytes": MEMORY_ASK,
            "exit": code,
            "max_progress_bytes": max((_int(ln.data["allocated"]) for ln in progress), default=0),
            "max_nvml_used_bytes": watch.max_used,
            "sample_interval_s": SAMPLE_INTERVAL_S,
            "violation": killed.violation.message if killed else None,
            "result": ctr.proc.result,
        }
    row = Row("memory", mechanism, figure, "", target, "fail")
    row.data = data
    result = data["result"] if isinstance(data["result"], dict) else {}
    if code is None:
        row.value, row.detail = "still running", "the workload did not end within its time"
    elif code < 0 and ctr.proc.eof_at is not None:
        # From the breach NVML showed; else from the first progress line above the limit, or
        # (killed before it said so) from the last one under it.
        line = over or (under[-1] if under else None)
        start, since = watch.breach_at, "nvml"
        if start is None and line is not None:
            start, since = line.at, "progress line"
        if start is None:
            row.value, row.detail = "killed", "killed before NVML or a progress line showed use"
        else:
            reaction = ctr.proc.eof_at - start
            periods = reaction / SAMPLE_INTERVAL_S
            data.update(reaction_s=reaction, periods=periods, breach_seen_by=since)
            if line is not None:
                data["reaction_from_progress_line_s"] = ctr.proc.eof_at - line.at
            row.value = f"killed {periods:.1f} periods ({reaction * 1000:.0f} ms) after the breach"
            row.verdict = bench.verdict(periods <= 2.0, mechanism)
            if killed is None:
                row.detail = f"{ctr.proc.describe_end()}, but no KILLED violation was reported"
    elif code == 0 and result.get("ok") is False:
        allocated, error = _int(result.get("allocated")), str(result.get("error") or "")
        refused = "OUT_OF_MEMORY" in error and allocated <= MEMORY_LIMIT
        row.value = f"refused at {gib(allocated)}"
        row.verdict = bench.verdict(refused, mechanism)
        row.detail = "" if refused else f"refused past the limit or not for memory: {error}"
    elif code == 0 and result.get("ok"):
        row.value = f"allocated {gib(_int(result.get('allocated')))}, not killed"
        row.verdict = bench.verdict(False, mechanism)
    else:
        row.value, row.detail = f"exit {code}", ctr.proc.describe_end()
    return bench.note(row)


def sm_alone(bench: Bench) -> tuple[Row, float | None]:
    """A 30 % share alone: its rate as a share of the baseline, reported as measured."""
    with share(bench, "sm30", 30, MEMORY_LIMIT) as shared, containers(bench) as made:
        mechanism = shared.mechanism("cores", bench.mechanism)
        ctr = start_container(bench, made, shared, f"{bench.mechanism}-sm30", bench.sm())
        try:
            result = sm_result(ctr.proc, bench.seconds + START_TIMEOUT_S)
        except RuntimeError as exc:
            return Row("sm", mechanism, "SM 30 alone", "-", "-", "fail", str(exc)), None
    achieved = percent(steady_rate(result), bench.baseline_rate)
    row = Row(
        "sm",
        mechanism,
        "SM 30 alone",
        f"{achieved:.1f} % of baseline",
        "(reported)",
        "measured",
        data={"percent": achieved, "result": result},
    )
    return row, achieved


def sm_pair(bench: Bench, start_margin: float) -> Row:
    """Shares of 30 and 70 started together: each within ±5 points of its limit."""
    figure, target = "SM 30 + 70 together", f"30/70 ± {PAIR_TOLERANCE:g}"
    with (
        share(bench, "pair30", 30, MEMORY_LIMIT) as low,
        share(bench, "pair70", 70, MEMORY_LIMIT) as high,
        containers(bench) as made,
    ):
        start_at = time.time() + start_margin
        ctrs = []
        for shared, cores in ((low, 30), (high, 70)):
            name = f"{bench.mechanism}-pair{cores}"
            ctrs.append(start_container(bench, made, shared, name, bench.sm(start_at=start_at)))
        mechanism = low.mechanism("cores", bench.mechanism)
        try:
            results = [sm_result(c.proc, bench.seconds + START_TIMEOUT_S) for c in ctrs]
        except RuntimeError as exc:
            return Row("sm", mechanism, figure, "-", target, "fail", str(exc))
        late = [c.proc.name for c in ctrs if (r := c.proc.ready(0)) and r.wall > start_at]
    got = [percent(steady_rate(r), bench.baseline_rate) for r in results]
    ok = all(abs(g - want) <= PAIR_TOLERANCE for g, want in zip(got, (30, 70), strict=True))
    row = Row(
        "sm",
        mechanism,
        figure,
        f"{got[0]:.1f} / {got[1]:.1f} % of baseline",
        target,
        bench.verdict(ok, mechanism),
        f"started after --start-at: {', '.join(late)}" if late else "",
        data={"percent": got, "results": results, "start_at": start_at},
    )
    return bench.note(row)


def overhead(bench: Bench) -> Row:
    """A share of all the cores and half the memory, unconstrained in effect: at most 2 %
    slower than the baseline."""
    figure, target = "overhead, cores 100 + half memory", f"<= {OVERHEAD_TARGET:g} % slower"
    with (
        share(bench, "overhead", 100, bench.memory_total // 2) as shared,
        containers(bench) as made,
    ):
        mechanism = shared.mechanism("cores", bench.mechanism)
        ctr = start_container(bench, made, shared, f"{bench.mechanism}-overhead", bench.sm())
        try:
            result = sm_result(ctr.proc, bench.seconds + START_TIMEOUT_S)
        except RuntimeError as exc:
            return Row("overhead", mechanism, figure, "-", target, "fail", str(exc))
    slower = 100.0 - percent(steady_rate(result), bench.baseline_rate)
    row = Row(
        "overhead",
        mechanism,
        figure,
        f"{slower:+.1f} % slower",
        target,
        bench.verdict(slower <= OVERHEAD_TARGET, mechanism),
        data={"slower_percent": slower, "result": result},
    )
    return bench.note(row)


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) else 0


def baseline(launcher: Launcher, seconds: float) -> tuple[int, float, Row]:
    """Unconstrained, no share: calibrate the iterations of a 20 ms kernel once, then measure
    the rate every later run is compared with, with those iterations."""
    calibrate = launcher.start(
        "calibrate", ["sm", "--seconds", f"{min(seconds, 2.0):g}", "--kernel-ms", "20"], wait=False
    )
    try:
        calibration = sm_result(calibrate, seconds + START_TIMEOUT_S)
    finally:
        calibrate.stop()
    iterations = _int(calibration.get("iterations"))
    if iterations <= 0:
        raise RuntimeError(f"the calibration run gave no iterations: {calibration}")
    command = ["sm", "--seconds", f"{seconds:g}", "--iterations", str(iterations)]
    run = launcher.start("baseline", command, wait=False)
    try:
        result = sm_result(run, seconds + START_TIMEOUT_S)
    finally:
        run.stop()
    rate = steady_rate(result)
    row = Row(
        "baseline",
        "none",
        "unconstrained sm, no share",
        f"{rate:.1f} kernels/s ({iterations} iterations)",
        "(reported)",
        "measured",
        data={"rate": rate, "iterations": iterations, "calibration": calibration, "result": result},
    )
    return iterations, rate, row
