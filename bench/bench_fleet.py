"""What N nodes' claim caches cost the API server and each node (issue 30). Prints figures;
asserts nothing except that every node's cache ends with exactly its own claims.

    .venv/bin/python bench/bench_fleet.py [--nodes 10,100] [--churn 20] [--seconds 20]

For each N and each way of watching, against the sandbox's real kube-apiserver:

- ``all``: every node watches every ResourceClaim (the claim cache before issue 30);
- ``label``: every node watches the claims labelled with its node (``gpu.gpuslice.dev/node``),
  which the controller's leader writes (``gpuslice_controller.claimnodes``, run here for real).

C = 16 x N claims (8 GPUs x 2 claims per node), each allocated to one node as the scheduler
writes it. N real ``ClaimCache``s (the kubelet plugin's: reflector, keep, filter), one per node,
many nodes per process over one API client. Phases:

1. roll-out: every node's cache starts at once (a DaemonSet roll-out): time to synced, LIST
   requests and bytes the API server sent;
2. steady state (``--steady`` seconds, nothing changes): watch events sent, writes by the nodes;
3. churn: R claim allocations a second (``--churn``), as pods come and go: a new claim is
   created and allocated to a random node (the scheduler's status write) and an old one is
   deleted: watch events and bytes the API server sent (its own metrics, every watcher
   counted: the controller-manager's and the labeller's too), events each node decoded, how
   long after the allocation write the node's cache had the claim (the lag that decides
   whether a prepare right after scheduling reads the API), the labeller's writes.

Then one real kubelet plugin (fake NVML, 8 GPUs) is left alone with short rescan and health
intervals (``--plugin-seconds``): the writes the API server takes meanwhile, per node and hour.

Per phase it prints the API server's CPU seconds and RSS, and the nodes' process CPU and RSS
divided by N (what one node costs, the many-nodes-per-process overhead included); at the end a
projection to 5,000 nodes from the measured curve.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice_api.names import DRIVER, NODE_LABEL, node_label_value
from gpuslice_controller.claimnodes import ClaimNodeLabels
from gpuslice_core import logging as gslog
from gpuslice_draplugin import ClaimCache, ResourceApi, detect
from gpuslice_draplugin.claimcache import allocated_here
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.kubelet_plugin.dra import result
from gpuslice_testkit.kubelet_plugin.harness import write_node
from gpuslice_testkit.kubelet_plugin.process import PluginProcess

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the e2e sandbox package
    sys.path.insert(0, str(REPO))

from e2e.sandbox.binaries import find_binaries  # noqa: E402
from e2e.sandbox.controlplane import ControlPlane  # noqa: E402

RESOURCE = "resource.k8s.io/v1"
TICK = 100  # os.sysconf("SC_CLK_TCK") on Linux
CLAIMS_PER_NODE = 16


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ---- the API server's own figures ------------------------------------------------------------
SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


@dataclass
class ApiFigures:
    """Counters of the API server about ResourceClaims, and its process."""

    watch_events: float = 0.0
    watch_bytes: float = 0.0
    list_bytes: float = 0.0
    requests: Counter[str] = field(default_factory=Counter)
    cpu: float = 0.0

    def __sub__(self, other: ApiFigures) -> ApiFigures:
        return ApiFigures(
            self.watch_events - other.watch_events,
            self.watch_bytes - other.watch_bytes,
            self.list_bytes - other.list_bytes,
            self.requests - other.requests,
            self.cpu - other.cpu,
        )


def apiserver_metrics(raw: RawApi) -> str:
    """The API server's own /metrics text (the admin's credentials)."""
    client = raw.api_client
    _, url, headers, _, _ = client.param_serialize(
        method="GET", resource_path="/metrics", header_params={}, auth_settings=["BearerToken"]
    )
    return str(client.call_api("GET", url, header_params=headers).read().decode())


def api_figures(raw: RawApi, pid: int) -> ApiFigures:
    text = apiserver_metrics(raw)
    figures = ApiFigures(cpu=cpu_seconds(pid))
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match or "resourceclaims" not in match.group(2):
            continue
        name, labels, value = match.group(1), match.group(2), float(match.group(3))
        verb = re.search(r'\bverb="(\w+)"', labels)
        if name == "apiserver_watch_events_total":
            figures.watch_events += value
        elif name == "apiserver_watch_events_sizes_sum":
            figures.watch_bytes += value
        elif name == "apiserver_response_sizes_sum" and verb and verb.group(1) == "LIST":
            figures.list_bytes += value
        elif name == "apiserver_request_total" and verb:
            figures.requests[verb.group(1)] += int(value)
    return figures


# ---- the fleet -------------------------------------------------------------------------------
class Node:
    """One node's claim cache, counting what it decodes and when a claim arrives."""

    def __init__(self, api: ResourceApi, name: str, mode: str) -> None:
        selector = f"{NODE_LABEL}={node_label_value(name)}" if mode == "label" else None
        self.name = name
        self.cache = ClaimCache(api, driver=DRIVER, pool=name, label_selector=selector)
        self.events = 0
        self.waiting: dict[str, float] = {}  # claim key -> when its allocation here was written
        self.lags: list[float] = []
        self._observe = self.cache.observe
        self.cache.observe = self.observe  # type: ignore[method-assign]

    def observe(self, event_type: str, claim: Obj) -> None:
        self.events += 1
        self._observe(event_type, claim)
        if event_type == "DELETED" or not allocated_here(claim, driver=DRIVER, pool=self.name):
            return
        meta = claim.get("metadata") or {}
        started = self.waiting.pop(f"{meta.get('namespace')}/{meta.get('name')}", None)
        if started is not None:
            self.lags.append(time.monotonic() - started)

    def held(self) -> int:
        return len(self.cache._claims)


def allocation(node: str, i: int) -> Obj:
    return {"devices": {"results": [result(f"gpu-{i % 8}", pool=node)]}}


def claim_object(name: str) -> Obj:
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuslice.dev"}}]
    return {"metadata": {"name": name}, "spec": {"devices": {"requests": requests}}}


def settle(raw: RawApi, pid: int) -> None:
    """Until the API server has sent every watch event of what came before (one quiet second)."""
    last = api_figures(raw, pid).watch_events
    while True:
        time.sleep(1.0)
        now = api_figures(raw, pid).watch_events
        if now == last:
            return
        last = now


def make_claims(raw: RawApi, namespace: str, nodes: list[str]) -> list[tuple[str, str]]:
    """C claims, each allocated to one node; returns (name, node)."""
    path = resource_path(RESOURCE, "resourceclaims", namespace=namespace)
    wanted = [(f"c{i}", nodes[i % len(nodes)]) for i in range(CLAIMS_PER_NODE * len(nodes))]

    def make(item: tuple[int, tuple[str, str]]) -> None:
        i, (name, node) = item
        claim = raw.create(path, claim_object(name))
        claim["status"] = {"allocation": allocation(node, i)}
        raw.replace(f"{path}/{name}/status", claim)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(make, enumerate(wanted)))
    return wanted


def wait(check: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what} after {timeout:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start


@dataclass
class Run:
    mode: str
    n: int
    rollout_s: float = 0.0
    rollout: ApiFigures = field(default_factory=ApiFigures)
    steady: ApiFigures = field(default_factory=ApiFigures)
    churn: ApiFigures = field(default_factory=ApiFigures)
    churn_ops: int = 0
    churn_s: float = 0.0
    node_events: list[int] = field(default_factory=list)
    node_events_churn: int = 0
    lags: list[float] = field(default_factory=list)
    label_writes: int = 0
    label_first_s: float = 0.0
    nodes_cpu: float = 0.0
    nodes_rss: float = 0.0
    api_rss: float = 0.0


def fleet(
    sandbox: ControlPlane, pid: int, mode: str, n: int, churn: float, seconds: float, steady: float
) -> Run:
    run = Run(mode, n)
    client = new_api_client(sandbox.kubeconfig, user_agent="bench-fleet", pool_size=n + 32)
    raw = RawApi(client)
    api = ResourceApi(raw, detect(raw))
    namespace = f"fleet-{mode}-{n}"
    raw.create(resource_path("v1", "namespaces"), {"metadata": {"name": namespace}})
    names = [f"node-{i:05d}" for i in range(n)]
    claims = make_claims(raw, namespace, names)
    labels: ClaimNodeLabels | None = None
    stop_leading = threading.Event()
    if mode == "label":  # the controller's leader, as it runs: labels what is allocated
        labels = ClaimNodeLabels(RawApi(client), version="v1")
        labels.start()
        threading.Thread(target=labels.run, args=(stop_leading,), daemon=True).start()
        path = resource_path(RESOURCE, "resourceclaims", namespace=namespace)
        run.label_first_s = wait(
            lambda: len(raw.list(path, label_selector=NODE_LABEL)["items"]) == len(claims),
            600,
            "every claim labelled",
        )
    own_pid = os.getpid()
    nodes = [Node(api, name, mode) for name in names]
    settle(raw, pid)
    before, cpu0 = api_figures(raw, pid), cpu_seconds(own_pid)
    start = time.monotonic()
    for node in nodes:
        node.cache.start()
    wait(
        lambda: all(
            x.cache.reflector is not None and x.cache.reflector.synced.is_set() for x in nodes
        ),
        900,
        "every cache synced",
    )
    wait(lambda: sum(x.held() for x in nodes) == len(claims), 120, "every claim held")
    run.rollout_s = time.monotonic() - start  # every cache started (its first page) and synced
    run.rollout = api_figures(raw, pid) - before
    # steady state: nothing changes
    settle(raw, pid)
    before = api_figures(raw, pid)
    events0 = sum(x.events for x in nodes)
    time.sleep(steady)
    run.steady = api_figures(raw, pid) - before
    assert sum(x.events for x in nodes) == events0, "events at steady state"
    # churn: pods come and go; each op allocates a new claim on a random node (create, then
    # the scheduler's status write) and deletes a claim allocated earlier, so C stays the same
    rng = random.Random(7)  # noqa: S311 - which claim goes where, repeatably
    path = resource_path(RESOURCE, "resourceclaims", namespace=namespace)
    where = dict(claims)
    settle(raw, pid)
    before = api_figures(raw, pid)
    events0 = sum(x.events for x in nodes)
    writes0 = labels.writes if labels else 0
    by_name = {x.name: x for x in nodes}
    start = time.monotonic()
    ops = 0
    while time.monotonic() - start < seconds:
        due = start + ops / churn
        if due > time.monotonic():
            time.sleep(due - time.monotonic())
        gone = rng.choice(sorted(where))
        raw.delete(f"{path}/{gone}")
        del where[gone]
        name, target = f"n{ops}", rng.choice(names)
        claim = raw.create(path, claim_object(name))
        claim["status"] = {"allocation": allocation(target, ops)}
        by_name[target].waiting[f"{namespace}/{name}"] = time.monotonic()
        raw.replace(f"{path}/{name}/status", claim)
        where[name] = target
        ops += 1
    run.churn_s = time.monotonic() - start
    run.churn_ops = ops
    # every node ends with exactly its own claims
    counts = Counter(where.values())
    wait(lambda: all(x.held() == counts.get(x.name, 0) for x in nodes), 120, "caches caught up")
    run.churn = api_figures(raw, pid) - before
    run.node_events = [x.events for x in nodes]
    run.node_events_churn = sum(x.events for x in nodes) - events0
    run.lags = [lag for x in nodes for lag in x.lags]
    run.label_writes = (labels.writes - writes0) if labels else 0
    run.nodes_cpu = cpu_seconds(own_pid) - cpu0
    run.nodes_rss = rss_mib(own_pid)
    run.api_rss = rss_mib(pid)
    for node in nodes:
        node.cache.stop()
    stop_leading.set()
    if labels is not None:
        labels.stop()
    raw.delete(resource_path("v1", "namespaces", name=namespace))
    return run


def report(run: Run) -> None:
    n = run.n
    r, s, c = run.rollout, run.steady, run.churn
    per_op = max(run.churn_ops, 1)
    print(f"\n== N = {n} nodes, C = {CLAIMS_PER_NODE * n} claims, watching: {run.mode} ==")
    if run.mode == "label":
        print(
            f"labeller: every claim labelled {run.label_first_s:.1f} s after its allocation burst"
        )
    print(
        f"roll-out: caches synced in {run.rollout_s:.2f} s; LIST requests "
        f"{r.requests['LIST']:.0f}, LIST bytes {r.list_bytes / 1e6:.2f} MB "
        f"({r.list_bytes / n / 1e3:.1f} kB per node); API server CPU {r.cpu:.2f} s"
    )
    print(
        f"steady ({s.cpu:.1f} s API CPU): watch events {s.watch_events:.0f}, "
        f"writes by nodes 0 (a cache only reads); requests {dict(s.requests) or '{}'}"
    )
    rate = run.churn_ops / run.churn_s
    decoded = run.node_events_churn
    print(
        f"churn: {run.churn_ops} allocations in {run.churn_s:.1f} s ({rate:.1f}/s; a create, a "
        f"status write, a delete each); API server sent {c.watch_events:.0f} watch events "
        f"({c.watch_events / per_op:.1f} per allocation), {c.watch_bytes / 1e6:.2f} MB "
        f"({c.watch_bytes / per_op / 1e3:.1f} kB per allocation); API server CPU {c.cpu:.2f} s "
        f"({c.cpu / run.churn_s * 100:.0f}% of a core)"
    )
    print(
        f"       nodes decoded {decoded} events ({decoded / per_op / n:.2f} per allocation "
        "per node; "
        f"the busiest node {max(run.node_events)} in all); label writes {run.label_writes} "
        f"({run.label_writes / per_op:.1f} per allocation)"
    )
    print(
        f"       a new claim reached its node's cache p50 {pct(run.lags, 0.5) * 1e3:.1f} ms"
        f" / p99 {pct(run.lags, 0.99) * 1e3:.1f} ms after its allocation write "
        f"({len(run.lags)} of {run.churn_ops})"
    )
    print(
        f"requests by verb (roll-out+steady+churn): "
        f"{dict((r.requests + s.requests + c.requests).most_common())}"
    )
    print(
        f"processes: API server RSS {run.api_rss:.0f} MiB; nodes' process CPU {run.nodes_cpu:.1f}"
        f" s ({run.nodes_cpu / n * 1e3:.1f} ms per node), RSS {run.nodes_rss:.0f} MiB "
        f"({run.nodes_rss / n:.2f} MiB per node, one shared interpreter)"
    )


WRITES = ("POST", "PUT", "PATCH", "DELETE", "APPLY")
#: The resources a kubelet plugin writes: its slices, and Events (refusals, the enforcer's).
PLUGIN_WRITES = ("resourceslices", "events")


def write_requests(raw: RawApi) -> Counter[str]:
    """The API server's count of write requests by resource (every client's)."""
    text = apiserver_metrics(raw)
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match or match.group(1) != "apiserver_request_total":
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if labels.get("verb") in WRITES:
            key = labels.get("resource", "") + (
                "/" + labels["subresource"] if labels.get("subresource") else ""
            )
            counts[key] += int(float(match.group(3)))
    return counts


def gpuslice_events(raw: RawApi) -> int:
    """Events whose source is a gpuslice component, counted up included."""
    items = raw.list(resource_path("v1", "events"))["items"]
    return sum(
        int(e.get("count") or 1)
        for e in items
        if str((e.get("source") or {}).get("component", "")).startswith("gpuslice")
        or str(e.get("reportingComponent", "")).startswith("gpuslice")
    )


def steady_plugin(sandbox: ControlPlane, root: Path, seconds: float) -> None:
    """One real kubelet plugin (8 fake H100s, its slices published, its health checks and
    rescans running) left alone: the writes the API server takes meanwhile, per hour."""
    raw = RawApi(new_api_client(sandbox.kubeconfig, user_agent="bench-fleet"))
    # the fleet runs' namespaces are deleted by now: their deletion (every resource's
    # deletecollection) is the controller-manager's write load, not the plugin's
    wait(
        lambda: (
            not [
                n
                for n in raw.list(resource_path("v1", "namespaces"))["items"]
                if n["metadata"]["name"].startswith("fleet-")
            ]
        ),
        300,
        "the fleet namespaces deleted",
    )
    node = "steady-node"
    raw.create(resource_path("v1", "nodes"), {"metadata": {"name": node}})
    config = write_node(root, [{"model": "H100", "count": 8}], node)
    plugin = PluginProcess(
        node=node,
        kubeconfig=sandbox.kubeconfig,
        fake_nvml_config=config,
        state_dir=root / "state",
        cdi_root=root / "cdi",
        registrar_dir=root / "reg",
        plugins_dir=root / "plugins",
        log=root / "plugin.log",
        extra=("--rescan-interval", "10", "--health-check-interval", "5"),
    ).start()
    try:
        slices = resource_path(RESOURCE, "resourceslices")
        wait(
            lambda: bool(raw.list(slices, field_selector=f"spec.nodeName={node}")["items"]),
            60,
            "slices published",
        )
        time.sleep(5)  # the start's own writes land
        before = write_requests(raw)
        ours_before = gpuslice_events(raw)
        time.sleep(seconds)
        after = write_requests(raw)
        ours_events = gpuslice_events(raw) - ours_before
    finally:
        plugin.stop()
    delta = {k: v for k, v in (after - before).items() if v}
    # what the plugin may write: its slices, Events, claims (never), its Node (never)
    ours = {k: v for k, v in delta.items() if k.split("/")[0] in PLUGIN_WRITES}
    print(f"\n== one kubelet plugin left alone for {seconds:.0f} s (rescan 10 s, health 5 s) ==")
    print(
        f"writes to the API server, every client's: {delta or '{}'} (leases: the "
        "controller-manager's and scheduler's leader election; nodes: the node lifecycle "
        "controller on a node with no kubelet)"
    )
    print(f"Events written by gpuslice components meanwhile: {ours_events}")
    per_hour = sum(ours.values()) * 3600 / seconds
    print(
        f"writes to what the plugin writes ({', '.join(PLUGIN_WRITES)}): "
        f"{ours or '{}'}, i.e. {per_hour:.0f} per node per hour"
    )


def project(runs: list[Run]) -> None:
    print("\n== projection to 5,000 nodes (80,000 claims), from the measured curve ==")
    for mode in ("all", "label"):
        mine = sorted((r for r in runs if r.mode == mode), key=lambda r: r.n)
        if len(mine) < 2:
            continue

        def at(f: Callable[[Run], float], a: Run = mine[0], b: Run = mine[-1]) -> float:
            slope = (f(b) - f(a)) / (b.n - a.n)
            return f(b) + slope * (5000 - b.n)

        events = at(lambda r: r.churn.watch_events / max(r.churn_ops, 1))
        kbytes = at(lambda r: r.churn.watch_bytes / max(r.churn_ops, 1) / 1e3)
        # a roll-out: every node lists what it watches: all C claims (N x C in all), or its
        # own 16 (N x 16): the bytes per listed claim times what 5,000 nodes would list
        mine_last = mine[-1]
        per_claim = mine_last.rollout.list_bytes / mine_last.n
        per_claim /= CLAIMS_PER_NODE * mine_last.n if mode == "all" else CLAIMS_PER_NODE
        listed = 5000 * (CLAIMS_PER_NODE * 5000 if mode == "all" else CLAIMS_PER_NODE)
        list_mb = per_claim * listed / 1e6
        print(
            f"{mode:>5}: per claim allocation {events:,.0f} watch events, {kbytes:,.0f} kB sent; "
            f"at 100 allocations/s {events * 100:,.0f} events/s; a roll-out lists {list_mb:,.0f} MB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", default="10,100", help="comma-separated N")
    parser.add_argument("--modes", default="all,label")
    parser.add_argument("--churn", type=float, default=20.0, help="claim allocations per second")
    parser.add_argument("--seconds", type=float, default=15.0, help="churn duration")
    parser.add_argument("--steady", type=float, default=5.0, help="steady-state seconds")
    parser.add_argument(
        "--plugin-seconds", type=float, default=60.0, help="one real plugin left alone (0: skip)"
    )
    args = parser.parse_args()
    gslog.configure(component="bench", level="warning")
    root = Path(tempfile.mkdtemp(prefix="gkf-"))
    sandbox = ControlPlane(root / "cp", binaries=find_binaries())
    sandbox.start()
    runs: list[Run] = []
    try:
        pid = next(p.pid for p in sandbox.processes if p.name == "kube-apiserver")
        for n in (int(x) for x in args.nodes.split(",")):
            for mode in args.modes.split(","):
                run = fleet(sandbox, pid, mode, n, args.churn, args.seconds, args.steady)
                report(run)
                runs.append(run)
        project(runs)
        if args.plugin_seconds > 0:
            steady_plugin(sandbox, root, args.plugin_seconds)
    finally:
        sandbox.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
