"""Kubelet plugin figures on the node sandbox (real control plane, fake NVML). Prints figures;
asserts nothing except that no claim failed or got lost.

    .venv/bin/python bench/bench_kubelet_plugin.py [--claims 100] [--pods 10]

1. NodePrepareResources / NodeUnprepareResources over the DRA socket, one claim per call,
   1, 10 and 100 calls at once (the kubelet sends one call per pod): latency p50/p99 as the
   kubelet sees it and throughput. Every claim is a share (cores and memory from
   consumedCapacity) of one of 8 H100s, allocated in the API as the scheduler writes it, and
   prepared once (every round takes fresh claims, as every pod start brings its own). The
   plugin's own per-claim timings (its "prepared" log line) split getting the claim (from the
   watch-fed cache, or an API read) and planning it from the rest. Once without an enforcer
   (accounting only: CDI spec + one checkpoint commit) and once with a stand-in enforcer over
   real gRPC (intent commit, CreateShare, CDI spec, completion).
2. Cost curve: prepare latency, one claim at a time, with 10, 100 and 1,000 claims already
   prepared on the node (pre-filled checkpoint); bench_checkpoint.py prints the commit's curve.
3. Pod creation to Running for shared-GPU pods (scheduler + node agent + plugin).
4. Publishing 8 H100s in MIG mode with every placement advertised (200 devices, 5 slices):
   discovery, and one full publication against the real API server.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gpuslice_api.names import DRIVER, NODE_LABEL, node_label_value
from gpuslice_core import logging as gslog
from gpuslice_draplugin import HelperMetrics, ResourceApi, detect
from gpuslice_draplugin.slices import SlicePublisher
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord, PluginState, open_store
from gpuslice_kubelet_plugin.discovery import discover
from gpuslice_nvml import open_nvml
from gpuslice_testkit.core import at_once
from gpuslice_testkit.kubelet_plugin.dra import ClaimTuple, DraClient, result
from gpuslice_testkit.kubelet_plugin.harness import write_node
from gpuslice_testkit.kubelet_plugin.process import PluginProcess
from gpuslice_testkit.kubelet_plugin.standins import StandinEnforcer

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the e2e sandbox package
    sys.path.insert(0, str(REPO))

from e2e.sandbox.binaries import find_binaries  # noqa: E402
from e2e.sandbox.controlplane import ControlPlane  # noqa: E402
from e2e.sandbox.nodeagent.fixtures import start_node_agent  # noqa: E402
from e2e.sandbox.nodeagent.testing import wait_for, wait_pod_phase  # noqa: E402

RESOURCE = "resource.k8s.io/v1"


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def fmt(samples: list[float]) -> str:
    return f"p50 {pct(samples, 0.5) * 1e3:7.2f} ms  p99 {pct(samples, 0.99) * 1e3:7.2f} ms"


def make_claims(kube: RawApi, namespace: str, node: str, count: int) -> list[ClaimTuple]:
    claims = []
    for i in range(count):
        path = resource_path(RESOURCE, "resourceclaims", namespace=namespace)
        claim = kube.create(
            path,
            {
                # the node label the controller writes on allocated claims: the plugin's cache
                # watches only the claims that carry its node's
                "metadata": {"name": f"c{i}", "labels": {NODE_LABEL: node_label_value(node)}},
                "spec": {
                    "devices": {
                        "requests": [
                            {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuslice.dev"}}
                        ]
                    }
                },
            },
        )
        claim["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        result(
                            f"gpu-{i % 8}",
                            pool=node,
                            cores="1",
                            memory="512Mi",
                            share_id=str(uuid.uuid4()),
                        )
                    ]
                }
            }
        }
        kube.replace(f"{path}/c{i}/status", claim)
        meta = claim["metadata"]
        claims.append((meta["namespace"], meta["name"], meta["uid"]))
    return claims


def plugin_timings(plugin: PluginProcess) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in plugin.log.read_text().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("msg") == "prepared"]


def apply_device_classes(kube: RawApi) -> None:
    for doc in yaml.safe_load_all((REPO / "e2e/manifests/deviceclasses.yaml").read_text()):
        if doc:
            kube.create(resource_path("resource.k8s.io/v1", "deviceclasses"), doc)


def bench_calls(
    plugin: PluginProcess, claims: list[ClaimTuple], rounds: dict[int, int], title: str
) -> None:
    """``claims`` holds at least sum(width x repeat) claims: each is prepared once."""
    print(f"\n== DRA calls over the socket (one claim per call, shares of 8 H100s), {title} ==")
    clients = [DraClient(plugin.sockets.dra) for _ in range(max(rounds))]
    errors: list[str] = []
    seen = len(plugin_timings(plugin))
    fresh = iter(claims)
    try:
        for width, repeat in rounds.items():
            prep: list[float] = []
            unprep: list[float] = []
            prep_rate, unprep_rate = [], []
            for _ in range(repeat):
                batch = [next(fresh) for _ in range(width)]

                def prepare(i: int, c: ClaimTuple = ("", "", "")) -> Callable[[], None]:
                    def call() -> None:
                        answer = clients[i].prepare([c])[c[2]]
                        if answer.error:
                            errors.append(answer.error)

                    return call

                def unprepare(i: int, c: ClaimTuple = ("", "", "")) -> Callable[[], None]:
                    def call() -> None:
                        error = clients[i].unprepare([c])[c[2]]
                        if error:
                            errors.append(error)

                    return call

                lat, wall = at_once([prepare(i, c) for i, c in enumerate(batch)])
                prep += lat
                prep_rate.append(width / wall)
                lat, wall = at_once([unprepare(i, c) for i, c in enumerate(batch)])
                unprep += lat
                unprep_rate.append(width / wall)
            rate = statistics.median(prep_rate)
            print(f"{width:>3} at once  prepare   {fmt(prep)}  {rate:7.0f} claims/s")
            rate = statistics.median(unprep_rate)
            print(f"{width:>3} at once  unprepare {fmt(unprep)}  {rate:7.0f} claims/s")
            prepared = plugin_timings(plugin)[seen:]
            seen += len(prepared)
            reads = [x["api_read_ms"] / 1e3 for x in prepared]
            local = [x["local_ms"] / 1e3 for x in prepared]
            cached = sum(x.get("claim_source") == "cache" for x in prepared)
            print(
                f"    plugin side: claim + plan {fmt(reads)} ({cached}/{len(prepared)} from the "
                f"cache); the rest {fmt(local)}"
            )
    finally:
        for c in clients:
            c.close()
    print("    (plugin side: its 'prepared' log line; 'claim + plan' = the claim from the cache")
    print("     or an API read, parsed and planned; 'the rest' = checkpoint intent, CDI spec,")
    print("     checkpoint completion)")
    leftovers = plugin.checkpoint_claims()
    print(f"errors: {len(errors)}  claims left prepared after unprepare: {len(leftovers)}")
    for e in errors[:5]:
        print("  error:", e)


def filler(node: str, i: int) -> ClaimRecord:
    """A prepared claim that takes no capacity (admin access), to fill the checkpoint."""
    uid = str(uuid.uuid4())
    return ClaimRecord(
        uid=uid,
        namespace="bench-filler",
        name=f"f{i}",
        state="PrepareCompleted",
        owner="bench",
        devices=[
            DeviceRecord(
                request="gpu",
                pool=node,
                device=f"gpu-{i % 8}",
                admin_access=True,
                cdi_device_ids=[f"k8s.gpu.gpuslice.dev/claim={uid}-gpu-{i % 8}"],
            )
        ],
        enforcement="exclusive",
        updated=time.time(),
    )


def bench_cost_curve(
    sandbox: ControlPlane,
    root: Path,
    config: Path,
    node: str,
    claims: list[ClaimTuple],
    sizes: list[int],
    per_size: int,
) -> None:
    print("\n== cost curve: prepare with N claims already prepared (one call at a time) ==")
    fresh = iter(claims)
    for size in sizes:
        state_dir = root / f"curve-{size}"
        state_dir.mkdir()
        records = (filler(node, i) for i in range(size))
        open_store(state_dir).save(PluginState(claims={r.uid: r for r in records}))
        plugin = PluginProcess(
            node=node,
            kubeconfig=sandbox.kubeconfig,
            fake_nvml_config=config,
            state_dir=state_dir,
            cdi_root=root / f"curve-cdi-{size}",
            registrar_dir=root / "reg",
            plugins_dir=root / "plugins",
            log=root / f"curve-{size}.log",
        ).start()
        client = DraClient(plugin.sockets.dra)
        prep, unprep = [], []
        try:
            for _ in range(per_size):
                c = next(fresh)
                start = time.perf_counter()
                answer = client.prepare([c])[c[2]]
                prep.append(time.perf_counter() - start)
                start = time.perf_counter()
                error = client.unprepare([c])[c[2]]
                unprep.append(time.perf_counter() - start)
                if answer.error or error:
                    print("  error:", answer.error or error)
        finally:
            client.close()
            plugin.stop()
        print(f"{size:>5} prepared  prepare {fmt(prep)}   unprepare {fmt(unprep)}")


def bench_pods(sandbox: ControlPlane, kube: RawApi, root: Path, count: int) -> None:
    print("\n== pod creation to Running, shared GPU (10 cores / 4Gi each) ==")
    name = f"bench-pods-{uuid.uuid4().hex[:6]}"
    config = write_node(root, [{"model": "H100", "count": 8}], name)
    agent = start_node_agent(sandbox, name=name, root=root / "k")
    plugin = PluginProcess(
        node=name,
        kubeconfig=sandbox.kubeconfig,
        fake_nvml_config=config,
        state_dir=root / "pstate",
        cdi_root=agent.config.cdi_dir,
        registrar_dir=agent.config.registry_dir,
        plugins_dir=agent.config.plugins_dir,
        log=root / "pods-plugin.log",
    ).start()
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    try:
        wait_for(lambda: DRIVER in agent.registered_drivers(), 20, "registration")
        kube.create(resource_path("v1", "namespaces"), {"metadata": {"name": ns}})
        kube.create(
            resource_path(RESOURCE, "resourceclaimtemplates", namespace=ns),
            {
                "metadata": {"name": "share"},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "gpu",
                                    "exactly": {
                                        "deviceClassName": "gpu.gpuslice.dev",
                                        "capacity": {"requests": {"cores": "10", "memory": "4Gi"}},
                                    },
                                }
                            ]
                        }
                    }
                },
            },
        )
        wait_for(
            lambda: kube.list(
                resource_path(RESOURCE, "resourceslices"), field_selector=f"spec.nodeName={name}"
            )["items"],
            20,
            "slices",
        )
        times = []
        for i in range(count):
            pod: Obj = {
                "metadata": {"name": f"p{i}"},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": name},
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": "busybox",
                            "command": ["sleep", "300"],
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "share"}],
                },
            }
            start = time.perf_counter()
            kube.create(resource_path("v1", "pods", namespace=ns), pod)
            wait_pod_phase(kube, ns, f"p{i}", "Running", timeout=60)
            times.append(time.perf_counter() - start)
        print(f"{count} pods one after another: {fmt(times)}  (poll interval <= 50 ms)")
    finally:
        kube.delete(resource_path("v1", "namespaces", name=ns))
        plugin.stop()
        agent.stop()


def bench_mig_publish(kube: RawApi, root: Path) -> None:
    print("\n== 8 H100 in MIG mode, every placement published (dynamic MIG) ==")
    name = f"bench-mig-{uuid.uuid4().hex[:6]}"
    config = write_node(root, [{"model": "H100", "count": 8, "migEnabled": True}], name)
    with open_nvml("fake", config) as nvml:
        start = time.perf_counter()
        inventory = discover(nvml, dynamic_mig_enabled=True)
        discovery = time.perf_counter() - start
    api = ResourceApi(kube, detect(kube))
    publisher = SlicePublisher(api, node=name, driver=DRIVER, metrics=HelperMetrics("bench"))
    publisher.set_pools({name: inventory.pool()})
    start = time.perf_counter()
    publisher.reconcile()
    publish = time.perf_counter() - start
    start = time.perf_counter()
    publisher.reconcile()
    noop = time.perf_counter() - start
    slices = kube.list(api.slices_path, field_selector=f"spec.nodeName={name}")["items"]
    print(
        f"devices {len(inventory.devices)}, counter sets {len(inventory.counter_sets)}, "
        f"slices {len(slices)}"
    )
    print(f"discovery (fake NVML)            {discovery * 1e3:8.1f} ms")
    print(f"first publication (5 creates)    {publish * 1e3:8.1f} ms")
    print(f"republish check, nothing changed {noop * 1e3:8.1f} ms")
    for s in slices:
        kube.delete(api.slice_path(s["metadata"]["name"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--claims", type=int, default=100)
    parser.add_argument("--pods", type=int, default=10)
    args = parser.parse_args()
    gslog.configure(component="bench", level="warning")
    root = Path(tempfile.mkdtemp(prefix="gkb-"))
    sandbox = ControlPlane(root / "cp", binaries=find_binaries())
    sandbox.start()
    try:
        kube = RawApi(new_api_client(sandbox.kubeconfig, user_agent="bench"))
        apply_device_classes(kube)
        ns = "bench-claims"
        kube.create(resource_path("v1", "namespaces"), {"metadata": {"name": ns}})
        node = "bench-node"
        config = write_node(root, [{"model": "H100", "count": 8}], node)
        rounds = {1: 100, 10: 10, args.claims: 3}
        per_plugin = sum(width * repeat for width, repeat in rounds.items())
        sizes = [10, 100, 1000]
        curve = 50
        claims = make_claims(kube, ns, node, 3 * per_plugin + len(sizes) * curve)
        enforcer = StandinEnforcer().serve(root / "enforcer.sock")
        for title, extra in (
            ("no enforcer (accounting only)", ()),
            (
                "no enforcer, every claim read from the API (--no-claim-cache)",
                ("--no-claim-cache",),
            ),
            (
                "with an enforcer (stand-in, real gRPC)",
                ("--enforcer-socket", str(root / "enforcer.sock")),
            ),
        ):
            plugin = PluginProcess(
                node=node,
                kubeconfig=sandbox.kubeconfig,
                fake_nvml_config=config,
                state_dir=root / "state",
                cdi_root=root / "cdi",
                registrar_dir=root / "reg",
                plugins_dir=root / "plugins",
                log=root / f"plugin-{len(extra)}.log",
                extra=extra,
            ).start()
            try:
                bench_calls(plugin, claims[:per_plugin], rounds, title)
            finally:
                plugin.stop()
            claims = claims[per_plugin:]
        enforcer.stop()
        bench_cost_curve(sandbox, root, config, node, claims, sizes, curve)
        bench_pods(sandbox, kube, root, args.pods)
        bench_mig_publish(kube, root)
    finally:
        sandbox.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
