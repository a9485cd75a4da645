"""The harness every experiment runs in: a share, its "containers", and the rates.

An experiment makes its own share and its own containers (fresh cgroups, a workload moved into
them and attached to the share, the share's environment) and undoes all of it before it returns,
whatever happened, in the order a pod ends: processes killed, their cgroups removed, then the
share released. Rates are the workload's kernels per second, steady state (the first second left
out: start-up and a watchdog share's burst credit), as a percentage of the unconstrained
baseline run with the same ``--iterations``.
"""

from __future__ import annotations

import contextlib
import itertools
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
from e2e.gpustage.enforcer import StageEnforcer, limit_mechanisms
from e2e.gpustage.report import Row, Verdict, judged
from gpuslice_nvml import Nvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.enforcer import Cgroups

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


def as_int(value: object) -> int:
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
    iterations = as_int(calibration.get("iterations"))
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
