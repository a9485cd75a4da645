"""The experiments of one enforcement mechanism (harness.py runs each in its own share and
containers): CreateShare latency, the memory limit, SM alone and as a 30/70 pair, overhead."""

from __future__ import annotations

import threading
import time

from e2e.gpustage.enforcer import SAMPLE_INTERVAL_S, median
from e2e.gpustage.harness import (
    START_TIMEOUT_S,
    Bench,
    Share,
    as_int,
    containers,
    percent,
    share,
    sm_result,
    start_container,
    steady_rate,
)
from e2e.gpustage.report import GIB, Row, gib
from gpuslice_nvml import Nvml, NvmlError
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb

MIB = 1 << 20
MEMORY_LIMIT = 4 * GIB
MEMORY_ASK = 6 * GIB
PAIR_TOLERANCE = 5.0  # points
#: What the watchdog reaches for two time-sliced contexts side by side (docs/enforcer.md, "SM
#: accuracy"): NVML lists one context per driver tick, not in exact proportion to the time
#: each got, so the smaller share is under-served. MPS mechanisms are held to PAIR_TOLERANCE.
WATCHDOG_PAIR_TOLERANCE = 12.0
OVERHEAD_TARGET = 2.0  # percent
LATENCY_SHARES = 6  # the first, then the median of the next five


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


class SampleLog:
    """Every per-process utilization sample NVML gives for the GPU while it runs (polled every
    50 ms), kept in the report: what the watchdog's SM meter is fed, seen from outside."""

    LIMIT = 600

    def __init__(self, nvml: Nvml, device: int) -> None:
        self.nvml, self.device = nvml, device
        self.samples: list[tuple[int, int, int]] = []  # (pid, timestamp µs, SM percent)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="samples", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        since = 0
        while not self._stop.wait(0.05) and len(self.samples) < self.LIMIT:
            try:
                got = self.nvml.process_utilization(self.device, since)
            except NvmlError:
                continue
            for sample in got:
                if sample.timestamp_us > since or since == 0:
                    self.samples.append((sample.pid, sample.timestamp_us, sample.sm_percent))
            since = max([since, *(sample.timestamp_us for sample in got)])

    def stop(self) -> list[tuple[int, int, int]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


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
        over = next((ln for ln in progress if as_int(ln.data["allocated"]) > MEMORY_LIMIT), None)
        under = [ln for ln in progress if as_int(ln.data["allocated"]) <= MEMORY_LIMIT]
        killed = bench.enforcer.violations.first(
            lambda v: v.share_id == shared.id and v.action == pb.ACTION_KILLED
        )
        data: dict[str, object] = {
            "limit_bytes": MEMORY_LIMIT,
            "asked_bytes": MEMORY_ASK,
            "exit": code,
            "max_progress_bytes": max((as_int(ln.data["allocated"]) for ln in progress), default=0),
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
        allocated, error = as_int(result.get("allocated")), str(result.get("error") or "")
        refused = "OUT_OF_MEMORY" in error and allocated <= MEMORY_LIMIT
        row.value = f"refused at {gib(allocated)}"
        row.verdict = bench.verdict(refused, mechanism)
        row.detail = "" if refused else f"refused past the limit or not for memory: {error}"
    elif code == 0 and result.get("ok"):
        row.value = f"allocated {gib(as_int(result.get('allocated')))}, not killed"
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
    """Shares of 30 and 70 started together: each within ±5 points of its limit (the
    watchdog: within the accuracy docs/enforcer.md states)."""
    tolerance = WATCHDOG_PAIR_TOLERANCE if bench.mechanism == "watchdog" else PAIR_TOLERANCE
    figure, target = "SM 30 + 70 together", f"30/70 ± {tolerance:g}"
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
        samples = SampleLog(bench.nvml, bench.launcher.device)
        try:
            results = [sm_result(c.proc, bench.seconds + START_TIMEOUT_S) for c in ctrs]
        except RuntimeError as exc:
            return Row("sm", mechanism, figure, "-", target, "fail", str(exc))
        finally:
            seen = samples.stop()
        pids = {c.proc.pid: c.proc.name for c in ctrs}
        late = [c.proc.name for c in ctrs if (r := c.proc.ready(0)) and r.wall > start_at]
    got = [percent(steady_rate(r), bench.baseline_rate) for r in results]
    ok = all(abs(g - want) <= tolerance for g, want in zip(got, (30, 70), strict=True))
    row = Row(
        "sm",
        mechanism,
        figure,
        f"{got[0]:.1f} / {got[1]:.1f} % of baseline",
        target,
        bench.verdict(ok, mechanism),
        f"started after --start-at: {', '.join(late)}" if late else "",
        data={
            "percent": got,
            "results": results,
            "start_at": start_at,
            "pids": pids,
            "nvml_samples": seen,
        },
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
