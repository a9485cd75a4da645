"""The cluster view at scale (issue 17): nodes x GPUs x claims created in the sandbox's real API
server, and the view the controller holds (``gpuslice_view.feed.ViewFeeder``: one reflector per
kind) built and kept current from them. Prints figures; asserts nothing except that the view
saw every object and every update.

    .venv/bin/python bench/bench_view.py [--nodes 1000] [--gpus 8] [--claims-per-gpu 2]
                                         [--updates 4000] [--threads 16]
    .venv/bin/python bench/bench_view.py --live 200 [--live-shares 32]   (3. only)

Every GPU is an H100-like device of our driver in one ResourceSlice per node; every claim
asks for a share (cores and memory) and carries an allocation result with consumedCapacity,
as the scheduler writes it. The view runs in a child process, alone, as in the controller's
container, so its memory and CPU are its own:

1. Build from scratch: start to synced (list of every kind, then watches), the child's RSS
   before and after, and the time of one list per kind (``gpuslice_view.source.load``, the
   kubectl plugin's way) for comparison.
2. Updates it follows: ``--updates`` claim changes (a label each, so a MODIFIED event each)
   sent by ``--threads`` threads as fast as the API server takes them. Printed: the API
   server's rate (the updates' own wall time), the time until the view had applied every one,
   and the child's CPU per applied event, i.e. the updates per second the view follows on one
   core. The API server, the bench's writers and the child share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the e2e sandbox package
    sys.path.insert(0, str(REPO))

from e2e.sandbox.binaries import find_binaries  # noqa: E402
from e2e.sandbox.controlplane import ControlPlane  # noqa: E402
from gpuslice_core import logging as gslog  # noqa: E402
from gpuslice_kube.client import new_api_client  # noqa: E402
from gpuslice_kube.raw import RawApi, resource_path  # noqa: E402
from gpuslice_testkit import view as t  # noqa: E402
from gpuslice_view.feed import ViewFeeder  # noqa: E402
from gpuslice_view.source import load  # noqa: E402

RESOURCE = "resource.k8s.io/v1"
NAMESPACE = "bench-view"
SHARE_CORES = 10
SHARE_MIB = 4096


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- the child: a ViewFeeder alone in its process, answering one command per stdin line ----


def child(kubeconfig: str) -> None:
    gslog.configure(component="bench-view", level="warning", json=True)
    raw = RawApi(new_api_client(kubeconfig, user_agent="bench-view-feeder"))
    before = rss_mib()
    feeder = ViewFeeder(raw)
    start = time.perf_counter()
    feeder.start()
    feeder.synced.wait()
    synced_s = time.perf_counter() - start
    counts = feeder.read(lambda v: (len(v.devices()), len(v.claims), len(v.usage())))
    allocated = feeder.read(lambda v: sum(len(u.shares) for u in v.usage().values()))
    report = {
        "synced_s": synced_s,
        "rss_before_mib": before,
        "rss_mib": rss_mib(),
        "devices": counts[0],
        "claims": counts[1],
        "shares": allocated,
    }
    print(json.dumps(report), flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
        # "events": the claim events applied so far and the CPU this process has used
        print(json.dumps({"claims": feeder.events["ResourceClaim"], "cpu_s": cpu_s()}), flush=True)
    feeder.stop()


class Child:
    def __init__(self, kubeconfig: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(kubeconfig)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def line(self) -> dict[str, float]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            raise RuntimeError(f"the view's process ended (exit {self.proc.wait()})")
        value: dict[str, float] = json.loads(text)
        return value

    def ask(self) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("events\n")
        self.proc.stdin.flush()
        return self.line()

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- the parent: objects in the API server, then the figures ----------------------------


def parallel(threads: int, calls: Sequence[Callable[[], object]]) -> float:
    """Run every call on ``threads`` threads; the wall time. The first failure is raised."""
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(c) for c in calls]:
            future.result()
    return time.perf_counter() - start


def populate(kube: RawApi, args: argparse.Namespace) -> tuple[int, float]:
    """Classes, slices and allocated claims; (claims, seconds)."""
    for cls in t.CLASSES:
        kube.create(
            resource_path(RESOURCE, "deviceclasses"),
            {"apiVersion": RESOURCE, "kind": "DeviceClass", **cls},
        )
    kube.create(
        resource_path("v1", "namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
    )
    nodes = [f"node-{n:04d}" for n in range(args.nodes)]
    slices = resource_path(RESOURCE, "resourceslices")

    def make_slice(node: str) -> None:
        obj = t.resource_slice(node, [t.gpu(i) for i in range(args.gpus)])
        obj["metadata"] = {"name": f"{node}-gpu.gpuslice.dev"}
        kube.create(slices, {"apiVersion": RESOURCE, "kind": "ResourceSlice", **obj})

    claims = resource_path(RESOURCE, "resourceclaims", namespace=NAMESPACE)

    def make_claim(node: str, gpu: int, k: int) -> None:
        name = f"{node}-g{gpu}-c{k}"
        consumed = {"cores": str(SHARE_CORES), "memory": f"{SHARE_MIB}Mi"}
        obj = t.claim(NAMESPACE, name, cores=str(SHARE_CORES), memory=f"{SHARE_MIB}Mi")
        obj["metadata"] = {"name": name, "namespace": NAMESPACE}
        made = kube.create(claims, {"apiVersion": RESOURCE, "kind": "ResourceClaim", **obj})
        made["status"] = {
            "allocation": {
                "devices": {"results": [t.result(node, f"gpu-{gpu}", **consumed)]},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                },
            }
        }
        made["status"]["allocation"]["devices"]["results"][0]["shareID"] = (
            f"00000000-0000-4000-8000-{abs(hash(name)) % 10**12:012d}"
        )
        kube.replace(f"{claims}/{name}/status", made)

    start = time.perf_counter()
    parallel(args.threads, [partial(make_slice, n) for n in nodes])
    made = [
        partial(make_claim, n, g, k)
        for n in nodes
        for g in range(args.gpus)
        for k in range(args.claims_per_gpu)
    ]
    parallel(args.threads, made)
    return len(made), time.perf_counter() - start


def updates(kube: RawApi, args: argparse.Namespace, child: Child, total_claims: int) -> None:
    names = [
        f"node-{n:04d}-g{g}-c{k}"
        for n in range(args.nodes)
        for g in range(args.gpus)
        for k in range(args.claims_per_gpu)
    ]
    claims = resource_path(RESOURCE, "resourceclaims", namespace=NAMESPACE)
    before = child.ask()
    count = args.updates
    calls = [
        (
            lambda i=i: kube.patch(
                f"{claims}/{names[i % len(names)]}", {"metadata": {"labels": {"bench": str(i)}}}
            )
        )
        for i in range(count)
    ]
    start = time.perf_counter()
    api_wall = parallel(args.threads, calls)
    deadline = time.monotonic() + 120
    seen = child.ask()
    while seen["claims"] - before["claims"] < count and time.monotonic() < deadline:
        time.sleep(0.02)
        seen = child.ask()
    followed_wall = time.perf_counter() - start
    applied = seen["claims"] - before["claims"]
    cpu = seen["cpu_s"] - before["cpu_s"]
    print(f"\n2. {count} claim updates from {args.threads} threads ({total_claims} claims)")
    print(f"   API server took them at     {count / api_wall:7.0f} updates/s ({api_wall:.2f} s)")
    print(
        f"   the view applied {applied:.0f} of them, all {followed_wall:.2f} s after the first "
        f"was sent ({applied / followed_wall:.0f}/s, ratio to the API server's rate "
        f"{(applied / followed_wall) / (count / api_wall):.2f})"
    )
    if applied:
        per_event_us = cpu / applied * 1e6
        print(
            f"   the view's CPU: {per_event_us:.0f} us per event -> it follows "
            f"{1e6 / per_event_us:,.0f} updates/s on one core (target >= 300/s)"
        )


def live_usage(endpoints: int, shares: int) -> None:
    """3. Live usage: ``endpoints`` enforcer stand-ins on loopback, each serving the metrics text
    the enforcer's own registry writes for ``shares`` shares; ``LivePoller.poll_once`` over
    all of them (8 workers, as in the controller), three rounds."""
    from concurrent.futures import ThreadPoolExecutor
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from gpuslice_view.live import LivePoller, Target

    registry = CollectorRegistry()
    labels = ["claim_uid", "gpu", "UUID"]
    gauges = [
        Gauge(f"gpuslice_enforcer_share_{n}", n, labels, registry=registry)
        for n in ("memory_used_bytes", "memory_limit_bytes", "sm_ratio", "sm_limit_ratio")
    ]
    for i in range(shares):
        for g in gauges:
            g.labels(f"uid-{i}", str(i % 8), f"GPU-{i % 8}").set(i)
    body = generate_latest(registry)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(endpoints)]
    pool = ThreadPoolExecutor(max_workers=endpoints)
    for server in servers:
        pool.submit(server.serve_forever)
    targets = [
        Target(f"node-{i}", f"http://127.0.0.1:{s.server_address[1]}/metrics")
        for i, s in enumerate(servers)
    ]
    poller = LivePoller(lambda: targets, lambda _: None, interval=15, timeout=2)
    print(f"\n3. live usage: {endpoints} enforcers x {shares} shares ({len(body)} bytes each)")
    try:
        for _ in range(3):
            wall, cpu = time.perf_counter(), time.process_time()
            got = poller.poll_once()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            ok = sum(1 for n in got.values() if not n.error)
            print(
                f"   one round: {wall:.2f} s wall, {cpu:.2f} s CPU (servers included), "
                f"{1000 * cpu / endpoints:.2f} ms CPU per enforcer; {ok}/{endpoints} answered"
            )
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--claims-per-gpu", type=int, default=2, help="up to 10 (cores 10 each)")
    parser.add_argument("--updates", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--live", type=int, default=0, help="only the live-usage scrape of N enforcers"
    )
    parser.add_argument("--live-shares", type=int, default=32, help="shares per enforcer")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.live:
        live_usage(args.live, args.live_shares)
        return
    gslog.configure(component="bench", level="warning", json=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    root = Path(tempfile.mkdtemp(prefix="gs-bench-view-"))
    sandbox = ControlPlane(root / "cp", binaries=find_binaries())
    sandbox.start()
    view_proc: Child | None = None
    try:
        kube = RawApi(new_api_client(sandbox.kubeconfig, user_agent="bench", pool_size=32))
        total, seconds = populate(kube, args)
        gpus = args.nodes * args.gpus
        print(
            f"populated: {args.nodes} nodes x {args.gpus} GPUs = {gpus} devices, {total} "
            f"allocated claims in {seconds:.1f} s"
        )
        view_proc = Child(sandbox.kubeconfig)
        built = view_proc.line()
        print("\n1. the view from scratch (ViewFeeder in its own process)")
        print(
            f"   synced in {built['synced_s']:.2f} s: {built['devices']:.0f} devices, "
            f"{built['claims']:.0f} claims, {built['shares']:.0f} shares on devices"
        )
        print(
            f"   RSS {built['rss_before_mib']:.0f} MiB before, {built['rss_mib']:.0f} MiB synced "
            f"(+{built['rss_mib'] - built['rss_before_mib']:.0f} MiB; "
            f"{(built['rss_mib'] - built['rss_before_mib']) * 1024 / gpus:.1f} KiB per GPU "
            "with its claims)"
        )
        start = time.perf_counter()
        load(kube)
        print(f"   one list per kind (kubectl gpuslice's way): {time.perf_counter() - start:.2f} s")
        updates(kube, args, view_proc, total)
    finally:
        if view_proc is not None:
            view_proc.stop()
        sandbox.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
