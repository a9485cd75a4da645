"""Enforcer figures on the fake NVML with real processes and real cgroups. Prints figures;
asserts nothing. Needs root (cgroups).

    .venv/bin/python bench/bench_enforcer.py [--seconds S] [--trials N]

1. Watchdog CPU cost per sampled process: the enforcer process's CPU time (utime + stime from
   /proc) while it samples shares holding 0..N real processes every 100 ms.
2. Reaction time: from a process's allocation past its share's memory limit to its death.
3. Prepare to limits-in-force per mechanism: CreateShare, and the CDI hook attaching a container;
   3b. the hook alone: the static binary the chart installs, the Python hook as the chart
   installed it before and as a console script, and through gRPC (an enforcer without the
   attach socket); the variants take turns, run by run.
4. SM throttling accuracy: achieved SM share (from the fake's runnable-time accounting) for
   several limits against a process that wants 90%.
5. Hostile clients: a valid hook's latency with N stuck clients on the attach socket, the
   attach time as containers come and go (their cgroups removed, no poststop hook), the
   enforcer's CPU and log rate while out of file descriptors, and GetCapabilities beside open
   WatchViolations streams.

The fake NVML reads one JSON state file per call, so the absolute sampling cost is the fake's;
per-process cost (cgroup lookup, mapping, accounting) and the reaction/accuracy figures carry
over to a real node.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from gpuslice_enforcer import attachwire as wire
from gpuslice_enforcer import hook
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.enforcer import (
    HOOK_MAIN,
    Cgroups,
    EnforcerProcess,
    Workload,
    cgroup2_root,
    go_hook,
    hook_path,
    remove_tree,
    run_hook,
    share_request,
    short_tempdir,
)

MIB = 1 << 20
NODE = 'name: bench\ndriverVersion: "{driver}"\nstatePath: state.json\ngpus:\n  - model: L4\n'
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


CREATED: list[Path] = []


def node(driver: str) -> Path:
    directory = short_tempdir("gs-bench-")
    CREATED.append(directory)
    config = directory / "node.yaml"
    config.write_text(NODE.format(driver=driver))
    return config


def hook_of(reply: pb.CreateShareResponse) -> pb.Hook:
    return next(h for h in reply.container_edits.hooks if h.hook_name == "createContainer")


def watchdog_cost(seconds: float) -> None:
    print("\n1. watchdog CPU cost (sampling every 100 ms, one share holding N processes)")
    config = node("570.158.01")
    proc = EnforcerProcess(config, config.parent, ["--mps=off", "--log-level=warning"]).start()
    control = FakeNvmlControl.from_config_file(config)
    uuid = FakeNvml.from_config_file(config).gpu(0).uuid
    sleepers: list[subprocess.Popen[bytes]] = []
    baseline = None
    try:
        with proc.channel() as channel, Cgroups() as groups:
            reply = proc.stub(channel).CreateShare(
                share_request("bench-cost", uuid, memory=8 << 30)
            )
            box = groups.container()
            anchor = Workload(config, cgroup_dirs=box)
            run_hook(hook_of(reply), "bench-ctr", anchor.pid)
            for count in (0, 10, 50, 100):
                while len(sleepers) < count:
                    sleeper = subprocess.Popen(["sleep", "600"])
                    for directory in box:
                        (directory / "cgroup.procs").write_text(str(sleeper.pid))
                    control.add_process(sleeper.pid, 0, used_memory_bytes=MIB, real=True)
                    sleepers.append(sleeper)
                time.sleep(0.5)
                start_cpu, start = cpu_seconds(proc.pid), time.monotonic()
                time.sleep(seconds)
                cpu = cpu_seconds(proc.pid) - start_cpu
                wall = time.monotonic() - start
                per_sample_ms = cpu / (wall / 0.1) * 1e3
                nvml_ms = fake_nvml_ms(config)
                own_ms = per_sample_ms - nvml_ms
                note = ""
                if baseline is not None and count:
                    extra_us = (own_ms - baseline) * 1e3 / count
                    note = f" -> enforcer {extra_us:5.1f} us per extra process"
                else:
                    baseline = own_ms
                print(
                    f"   {count + 1:4d} processes: {cpu / wall * 100:5.1f}% of a core, "
                    f"{per_sample_ms:6.2f} ms CPU per sample (fake NVML {nvml_ms:5.2f} ms, "
                    f"enforcer {own_ms:5.2f} ms){note}"
                )
            anchor.stop()
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
        proc.stop()


def fake_nvml_ms(config: Path, rounds: int = 30) -> float:
    """CPU ms one watchdog sample spends in the fake NVML (read in this process)."""
    fake = FakeNvml.from_config_file(config)
    start = time.process_time()
    for _ in range(rounds):
        fake.running_processes(0)
        fake.process_utilization(0)
    return (time.process_time() - start) / rounds * 1e3


def reaction(trials: int) -> None:
    print("\n2. reaction time: allocation past the memory limit -> process killed")
    config = node("570.158.01")
    proc = EnforcerProcess(config, config.parent, ["--mps=off", "--log-level=warning"]).start()
    uuid = FakeNvml.from_config_file(config).gpu(0).uuid
    times = []
    try:
        with proc.channel() as channel, Cgroups() as groups:
            stub = proc.stub(channel)
            for trial in range(trials):
                claim = f"bench-kill-{trial}"
                reply = stub.CreateShare(share_request(claim, uuid, memory=64 * MIB))
                workload = Workload(config, memory=32 * MIB, cgroup_dirs=groups.container())
                run_hook(hook_of(reply), f"ctr-{trial}", workload.pid)
                time.sleep(0.25)
                workload.ask(f"alloc {64 * MIB}")
                over = time.monotonic()
                workload.proc.wait(timeout=10)
                times.append(time.monotonic() - over)
                workload.stop()
                stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid=claim))
    finally:
        proc.stop()
    print(
        f"   {trials} trials: median {statistics.median(times) * 1e3:.0f} ms, "
        f"max {max(times) * 1e3:.0f} ms (sampling period 100 ms)"
    )


def prepare_to_enforced(trials: int) -> None:
    print("\n3. prepare -> limits in force (CreateShare; then the CDI hook attaching a container)")
    cases = [
        ("watchdog (driver 570, MPS off)", "570.158.01", ["--mps=off"]),
        ("legacy MPS (driver 570)", "570.158.01", ["--memory-partitioning=off"]),
        ("memory partitioning (driver 615, MPS off)", "615.20.01", ["--mps=off"]),
        ("MPS protocol 3 (driver 615)", "615.20.01", ["--memory-partitioning=off"]),
    ]
    for label, driver, args in cases:
        if "partitioning (" in label and cgroup2_root() is None:
            print(f"   {label:<44} skipped: no cgroup v2")
            continue
        config = node(driver)
        proc = EnforcerProcess(config, config.parent, [*args, "--log-level=warning"]).start()
        uuid = FakeNvml.from_config_file(config).gpu(0).uuid
        creates, hooks = [], []
        try:
            with proc.channel() as channel, Cgroups() as groups:
                stub = proc.stub(channel)
                for trial in range(trials):
                    claim = f"bench-prep-{trial}"
                    start = time.perf_counter()
                    reply = stub.CreateShare(share_request(claim, uuid, memory=GIB_1))
                    creates.append(time.perf_counter() - start)
                    workload = Workload(config, cgroup_dirs=groups.container())
                    start = time.perf_counter()
                    run_hook(hook_of(reply), f"ctr-{trial}", workload.pid)
                    hooks.append(time.perf_counter() - start)
                    workload.stop()  # the shares stay: later ones find the MPS daemon up
                for trial in range(trials):
                    stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid=f"bench-prep-{trial}"))
        finally:
            proc.stop()
            proc.stop_mps_daemons()
        print(
            f"   {label:<44} CreateShare first {creates[0] * 1e3:5.0f} ms, then median "
            f"{statistics.median(creates[1:]) * 1e3:5.0f} ms; hook median "
            f"{statistics.median(hooks) * 1e3:5.1f} ms, max {max(hooks) * 1e3:5.1f} ms"
        )


GIB_1 = 1 << 30


def _report(label: str, runs: list[tuple[float, float]]) -> None:
    """One line of figures for ``runs`` of ``_run_timed``."""
    times, cpu = sorted(r[0] for r in runs), sorted(r[1] for r in runs)
    print(
        f"   {label:<58} median {statistics.median(times) * 1e3:5.1f} ms, "
        f"p90 {times[int(len(times) * 0.9) - 1] * 1e3:5.1f} ms, "
        f"max {times[-1] * 1e3:5.1f} ms; CPU median {statistics.median(cpu) * 1e3:5.1f} ms, "
        f"p90 {cpu[int(len(cpu) * 0.9) - 1] * 1e3:5.1f} ms ({len(times)} runs)"
    )


def _run_timed(command: list[str], state: bytes, env: dict[str, str]) -> tuple[float, float]:
    """Run ``command`` as runc runs a hook (fork and exec, ``state`` on stdin, until it exits):
    its wall time, and the CPU time (user + system) the child used itself, which holds under
    load when wall times do not."""
    start = time.perf_counter()
    child = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert child.stdin and child.stdout and child.stderr
    child.stdin.write(state)
    child.stdin.close()
    child.stdout.read()  # a line or two: neither pipe fills while the other is read
    error = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    for stream in (child.stdout, child.stderr):
        stream.close()
    if child.returncode != 0:
        raise RuntimeError(f"{command[0]} exited {child.returncode}: {error.decode()}")
    return wall, usage.ru_utime + usage.ru_stime


def hook_cost(trials: int) -> None:
    """Each hook as runc runs it, against a running enforcer, the variants taking turns run by
    run so that a change of load hits them alike."""
    print("\n3b. the CDI hook alone: createContainer -> limits in force (watchdog share)")
    config = node("570.158.01")
    proc = EnforcerProcess(config, config.parent, ["--mps=off", "--log-level=warning"]).start()
    uuid = FakeNvml.from_config_file(config).gpu(0).uuid
    attach_socket = proc.socket.with_name(proc.socket.name + ".attach")
    aside = attach_socket.with_name(attach_socket.name + ".aside")
    packages = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())
    try:
        with proc.channel() as channel, Cgroups() as groups:
            reply = proc.stub(channel).CreateShare(share_request("bench-hook", uuid))
            args = list(hook_of(reply).args)
            workload = Workload(config, cgroup_dirs=groups.container())
            static = str(go_hook())
            variants = [
                ("static binary, as the chart installs it", [static, *args[1:]], {}),
                ("static binary, --help only (process start, no call)", [static, "--help"], {}),
                (
                    "Python, as the chart installed it before (python -s -S -c)",
                    [sys.executable, "-s", "-S", "-c", HOOK_MAIN, *args[1:]],
                    {"PYTHONPATH": packages},
                ),
                ("Python console script (site.py)", [str(hook_path("python")), *args[1:]], {}),
            ]
            runs: list[list[tuple[float, float]]] = [[] for _ in variants]
            for trial in range(trials + 1):
                for index, (_, command, env) in enumerate(variants):
                    state = json.dumps({"id": f"ctr-{index}-{trial}", "pid": workload.pid})
                    ran = _run_timed(command, state.encode(), env)
                    if trial:  # the first run of each may compile bytecode or fill caches
                        runs[index].append(ran)
            for (label, _, _), taken in zip(variants, runs, strict=True):
                _report(label, taken)
            attach_socket.rename(aside)  # still listening, under another name
            grpc_runs = []
            for trial in range(min(trials, 20) + 1):
                state = json.dumps({"id": f"ctr-grpc-{trial}", "pid": workload.pid})
                ran = _run_timed([str(hook_path("python")), *args[1:]], state.encode(), {})
                if trial:
                    grpc_runs.append(ran)
            label = "Python gRPC fallback (enforcer without the attach socket)"
            _report(label, grpc_runs)
            aside.rename(attach_socket)
            workload.stop()
    finally:
        proc.stop()


def accuracy(seconds: float) -> None:
    print("\n4. SM throttling accuracy (demand 90%, measured after the burst credit is spent)")
    config = node("570.158.01")
    proc = EnforcerProcess(config, config.parent, ["--mps=off", "--log-level=warning"]).start()
    control = FakeNvmlControl.from_config_file(config)
    uuid = FakeNvml.from_config_file(config).gpu(0).uuid
    try:
        with proc.channel() as channel, Cgroups() as groups:
            stub = proc.stub(channel)
            for limit in (10, 30, 70):
                claim = f"bench-sm-{limit}"
                reply = stub.CreateShare(
                    share_request(claim, uuid, cores=limit, mode=pb.ENFORCEMENT_MODE_SOFT)
                )
                workload = Workload(config, sm=90, cgroup_dirs=groups.container())
                run_hook(hook_of(reply), f"ctr-{limit}", workload.pid)
                # settle: the 0.5 s burst credit (limit x 0.5 %s) drains at (90 - limit) %/s
                time.sleep(1.0 + 0.5 * limit / (90 - limit))
                a = control.sm_accounting(workload.pid)
                time.sleep(seconds)
                b = control.sm_accounting(workload.pid)
                achieved = (b.busy_seconds - a.busy_seconds) / (b.wall_seconds - a.wall_seconds)
                print(
                    f"   limit {limit:3d}%: achieved {achieved * 100:5.1f}% "
                    f"(error {achieved * 100 - limit:+5.1f} points over {seconds:.0f} s)"
                )
                workload.stop()
                stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid=claim))
    finally:
        proc.stop()


def stuck_client(path: Path) -> socket.socket:
    """A client that announces a 100-byte request, sends 2 bytes of it and holds."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(path))
    conn.sendall(wire.MAGIC + bytes([wire.METHOD_ATTACH]) + (100).to_bytes(4, "big") + b"\n\x02")
    return conn


def hostile(trials: int, containers: int) -> None:
    print("\n5. hostile clients: a hook beside N stuck clients; attach as containers come and go")
    config = node("570.158.01")
    proc = EnforcerProcess(config, config.parent, ["--mps=off", "--log-level=warning"]).start()
    uuid = FakeNvml.from_config_file(config).gpu(0).uuid
    attach_socket = proc.socket.with_name(proc.socket.name + ".attach")
    try:
        with proc.channel() as channel, Cgroups() as groups:
            reply = proc.stub(channel).CreateShare(share_request("bench-hostile", uuid))
            args = list(hook_of(reply).args)
            workload = Workload(config, cgroup_dirs=groups.container())
            for stuck in (0, 8, 50):
                held = [stuck_client(attach_socket) for _ in range(stuck)]
                times = []
                for trial in range(trials if stuck == 0 else 1):
                    state = json.dumps({"id": f"ctr-{stuck}-{trial}", "pid": workload.pid})
                    start = time.perf_counter()
                    ran = subprocess.run(args, input=state.encode(), capture_output=True)
                    times.append(time.perf_counter() - start)
                for conn in held:
                    conn.close()
                outcome = "ok" if ran.returncode == 0 else ran.stderr.decode().strip()[-80:]
                print(
                    f"   {stuck:3d} stuck clients: hook {statistics.median(times) * 1e3:7.1f} ms"
                    f" ({outcome})"
                )
                time.sleep(0.2 if stuck == 0 else 11)  # let the enforcer drop them
            workload.stop()
            times = []
            for index in range(containers):
                with Cgroups() as gone:  # removed at once: no poststop hook ever runs
                    dirs = gone.container()
                    own = [
                        f"{'7:freezer' if 'freezer' in str(d) else '0:'}:/{d.name}" for d in dirs
                    ]
                    message = hook.attach_message(
                        "bench-hostile", "", f"ctr-{index}", os.getpid(), own
                    )
                    start = time.perf_counter()
                    hook.call(str(proc.socket), wire.METHOD_ATTACH, message, time.monotonic() + 30)
                    times.append(time.perf_counter() - start)
            for first in (0, containers // 2, containers - 50):
                window = sorted(times[first : first + 50])
                print(
                    f"   attach, containers {first + 1:4d}..{first + 50:4d}: median "
                    f"{statistics.median(window) * 1e3:5.1f} ms, max {window[-1] * 1e3:5.1f} ms"
                )
    finally:
        proc.stop()
    hostile_limits()


def hostile_limits() -> None:
    """Out of file descriptors (no share: the log is the accept loop's); open streams."""
    config = node("570.158.01")
    proc = EnforcerProcess(config, config.parent, ["--mps=off", "--log-level=info"]).start()
    attach_socket = proc.socket.with_name(proc.socket.name + ".attach")
    try:
        soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        used = sum(1 for _ in Path(f"/proc/{proc.pid}/fd").iterdir())
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (used + 8, hard))
        clients = [stuck_client(attach_socket) for _ in range(40)]
        time.sleep(1.0)
        cpu, logged = cpu_seconds(proc.pid), proc.log.stat().st_size
        time.sleep(3.0)
        cpu, logged = cpu_seconds(proc.pid) - cpu, proc.log.stat().st_size - logged
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        for conn in clients:
            conn.close()
        print(
            f"   out of descriptors (40 clients, 8 free fds): {cpu / 3:.0%} of a core, "
            f"{logged / 3 / 1000:.1f} kB/s of log over 3 s"
        )
        with proc.channel() as channel:
            stub = proc.stub(channel)
            for count in (8, 16):
                streams = [
                    stub.WatchViolations(pb.WatchViolationsRequest(), timeout=60)
                    for _ in range(count)
                ]
                time.sleep(1.0)
                start = time.perf_counter()
                try:
                    stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=10)
                    outcome = "ok"
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                took = time.perf_counter() - start
                print(
                    f"   {count} WatchViolations streams open: GetCapabilities "
                    f"{took * 1e3:7.1f} ms ({outcome})"
                )
                for stream in streams:
                    stream.cancel()
                time.sleep(0.5)
    finally:
        proc.stop()


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "watchdog": lambda args: watchdog_cost(args.seconds),
    "reaction": lambda args: reaction(args.trials),
    "prepare": lambda args: prepare_to_enforced(args.trials),
    "hook": lambda args: hook_cost(max(args.trials, 50)),
    "accuracy": lambda args: accuracy(args.seconds),
    "hostile": lambda args: hostile(max(args.trials, 10), 1000),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="Measuring window.")
    parser.add_argument("--trials", type=int, default=5, help="Trials per timing.")
    parser.add_argument(
        "--only", choices=sorted(SECTIONS), action="append", help="Run only these sections."
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_enforcer needs root (it creates cgroups)")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    try:
        for name in args.only or SECTIONS:
            SECTIONS[name](args)
    finally:
        for directory in CREATED:
            remove_tree(directory)


if __name__ == "__main__":
    main()
