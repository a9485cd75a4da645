"""What one probe costs a node: an exec probe (a new interpreter) against an httpGet on the
service's own health server (gpuslice_core.health), issue 31.

Starts the enforcer and the MIG manager on the fake NVML, then:

- exec: runs each command the chart used to exec (``python -c "...check_health(...)"`` for the
  enforcer, ``gpuslice-mig-manager --probe``, ``gpuslice-kubelet-plugin --probe``) under
  ``/usr/bin/time``: wall seconds and peak RSS of the probe process, median of ``--runs``.
  The kubelet plugin's is timed against absent sockets (no API server here): the interpreter
  start and the imports are the cost, its two gRPC calls a few milliseconds more.
- http: ``--gets`` GETs of /readyz and of /healthz, each on a fresh connection as the kubelet
  makes them, and the serving process's CPU time (utime + stime from /proc/<pid>/stat) spent
  on them, per GET; its RSS before and after.

    PYTHONPATH=... python bench/bench_probes.py [--runs 5] [--gets 1000]
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuslice_testkit.core import ServiceProcess, http_probe

NODE = 'name: bench\ndriverVersion: "570.1"\nstatePath: state.json\ngpus:\n  - model: L4\n'
TICK = os.sysconf("SC_CLK_TCK")
ENFORCER_PROBE = (
    "import os, sys; from pathlib import Path; from gpuslice_core.grpcserver import "
    "check_health; sys.exit(0 if check_health(Path(os.environ['GPUSLICE_SOCKET'])) else 1)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def ready(port: int) -> bool:
    return http_probe(port) == 200


def exec_cost(argv: list[str], env: dict[str, str], runs: int) -> dict[str, object]:
    walls, rss, cpu = [], [], []
    for _ in range(runs):
        out = subprocess.run(
            ["/usr/bin/time", "-f", "%e %M %U %S", *argv],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        wall, max_rss, user, system = out.stderr.strip().splitlines()[-1].split()
        walls.append(float(wall))
        rss.append(int(max_rss) / 1024)
        cpu.append(float(user) + float(system))
    return {
        "wall_s": round(statistics.median(walls), 3),
        "cpu_s": round(statistics.median(cpu), 3),
        "peak_rss_mib": round(statistics.median(rss), 1),
    }


def http_cost(pid: int, port: int, path: str, gets: int) -> dict[str, object]:
    rss0, cpu0, t0 = rss_kib(pid), cpu_seconds(pid), time.perf_counter()
    statuses = set()
    for _ in range(gets):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", path)
        reply = conn.getresponse()
        reply.read()
        statuses.add(reply.status)
        conn.close()
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    return {
        "server_cpu_ms_per_get": round(1000 * cpu / gets, 3),
        "client_wall_ms_per_get": round(1000 * wall / gets, 3),
        "server_rss_mib_before": round(rss0 / 1024, 1),
        "server_rss_mib_after": round(rss_kib(pid) / 1024, 1),
        "statuses": sorted(statuses),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gets", type=int, default=1000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gsprobe-", dir="/tmp"))
    (work / "node.yaml").write_text(NODE)
    fake = ["--nvml=fake", f"--fake-nvml-config={work / 'node.yaml'}", "--metrics-addr="]
    env = dict(os.environ)
    py = sys.executable
    ports = {"enforcer": free_port(), "mig-manager": free_port()}
    socks = {"enforcer": work / "enf.sock", "mig-manager": work / "mig.sock"}
    argv = {
        "enforcer": [
            py,
            "-m",
            "gpuslice_enforcer",
            *fake,
            f"--socket={socks['enforcer']}",
            f"--state-dir={work / 'enf'}",
            f"--mps-root={work / 'mps'}",
            "--hook-path=",
            "--mps=off",
        ],
        "mig-manager": [
            py,
            "-m",
            "gpuslice_mig_manager",
            *fake,
            f"--socket={socks['mig-manager']}",
            f"--state-dir={work / 'mig'}",
        ],
    }
    procs: dict[str, ServiceProcess] = {}
    result: dict[str, dict[str, object]] = {}
    try:
        for name in argv:
            port = ports[name]
            procs[name] = ServiceProcess(
                name,
                [*argv[name], f"--health-addr=127.0.0.1:{port}"],
                log=work / f"{name}.log",
                ready=functools.partial(ready, port),
                env=env,
            ).start()
        execs = {
            "enforcer python -c check_health": (
                [py, "-c", ENFORCER_PROBE],
                {**env, "GPUSLICE_SOCKET": str(socks["enforcer"])},
            ),
            "gpuslice-mig-manager --probe": (
                [py, "-m", "gpuslice_mig_manager", "--probe", f"--socket={socks['mig-manager']}"],
                env,
            ),
            "gpuslice-kubelet-plugin --probe (absent sockets)": (
                [
                    py,
                    "-m",
                    "gpuslice_kubelet_plugin",
                    "--probe",
                    f"--registrar-dir={work / 'reg'}",
                    f"--plugins-dir={work / 'plugins'}",
                ],
                env,
            ),
        }
        for label, (command, command_env) in execs.items():
            result[f"exec: {label}"] = exec_cost(command, command_env, args.runs)
        for name, proc in procs.items():
            for path in ("/readyz", "/healthz"):
                result[f"http: {name} {path}"] = http_cost(proc.pid, ports[name], path, args.gets)
    finally:
        for proc in procs.values():
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
