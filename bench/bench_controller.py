"""The controller's admission webhooks on the sandbox (real kube-apiserver, the chart's webhook
configurations). Prints figures; asserts nothing except that every review was answered as
expected (target from issue 16: p99 <= 20 ms for a translated pod).

    .venv/bin/python bench/bench_controller.py [--pods 200] [--burst 100] [--rounds 3]
                                               [--reviews 500] [--parts 1,2,3]

The controller runs the sources on ``PYTHONPATH`` when it is set (a worktree, or an older
version's ``services/controller/src`` to compare with), the installed ones otherwise.

The controller runs as a process, as in the chart's Deployment (leader election, certificates
it makes itself, one replica); its webhook configurations are the chart's, rendered with
``controller.webhook.url`` and a namespace selector, so the API server sends reviews from one
labelled namespace and none from a second, otherwise equal namespace. Pods name a scheduler
that does not exist, so no scheduler or kubelet work competes with admission (a translated
pod's claims are still made by the resource claim controller, as in a cluster).

1. The controller alone: AdmissionReviews posted straight to /mutate (a HAMi pod,
   ``nvidia.com/gpu: 1`` + ``nvidia.com/gpumem``) and /validate (a claim with cores, memory and
   a GpuConfig) over one kept-alive HTTPS connection: round trip and the controller's own time
   per review (its "admission" log line, the same figure its duration histogram records).
2. Through the API server, one request at a time: a HAMi pod created in the webhook's namespace
   and the same pod in the other namespace, interleaved; the difference is what admission costs
   a user. The same for claims, and an ordinary pod in the webhook's namespace (the
   matchConditions keep it away from the controller).
3. A burst: ``--burst`` HAMi pods created at once (one thread each), with and without the
   webhook: wall time, pods/s and per-create latency.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import yaml

from gpuslice_core import logging as gslog
from gpuslice_kube.client import new_api_client
from gpuslice_kube.errors import KubeError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.core import at_once

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the e2e sandbox package
    sys.path.insert(0, str(REPO))

from e2e.sandbox import procs  # noqa: E402
from e2e.sandbox.binaries import find_binaries  # noqa: E402
from e2e.sandbox.controlplane import ControlPlane  # noqa: E402
from e2e.sandbox.nodeagent.testing import wait_for  # noqa: E402

RESOURCE = "resource.k8s.io/v1"
DRIVER = "gpu.gpuslice.dev"
GIB = 1024**3
BIN = Path(sys.executable).parent
HAMI = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096"}
TARGET_P99 = 0.020


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def fmt(samples: list[float]) -> str:
    return (
        f"p50 {pct(samples, 0.5) * 1e3:7.2f} ms  p99 {pct(samples, 0.99) * 1e3:7.2f} ms  "
        f"max {max(samples) * 1e3:7.2f} ms"
    )


def helm_bin() -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "hack/install-helm.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def webhook_configs(name: str, port: int, namespace: str, selector: dict[str, str]) -> list[Obj]:
    """The chart's two webhook configurations, calling the controller at 127.0.0.1:``port``."""
    args = [
        str(helm_bin()),
        "template",
        "bench",
        str(REPO / "charts/gpuslice"),
        "-n",
        namespace,
        "--set",
        "controller.enabled=true",
        "--set",
        f"controller.webhook.url=https://127.0.0.1:{port}",
        "--show-only",
        "templates/controller-webhooks.yaml",
    ]
    for key, value in selector.items():
        args += ["--set", f"controller.webhook.namespaceSelector.matchLabels.{key}={value}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    configs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    for config in configs:
        config["metadata"]["name"] = name
    return configs


def gpu_slice(name: str, gpus: int, memory: int) -> Obj:
    """A slice of our driver with ``gpus`` whole GPUs of ``memory`` bytes (what the controller
    reads to size translated requests); no node serves it."""
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "nodeName": name,
            "devices": [
                {
                    "name": f"gpu-{i}",
                    "attributes": {"type": {"string": "gpu"}},
                    "capacity": {"memory": {"value": str(memory)}},
                }
                for i in range(gpus)
            ],
        },
    }


def hami_pod(name: str, limits: dict[str, str] | None = None) -> Obj:
    resources = {"limits": limits} if limits else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": "bench-none",  # nothing schedules it: admission alone is measured
            "containers": [
                {"name": "main", "image": "busybox", "command": ["true"], "resources": resources}
            ],
        },
    }


def share_claim(name: str) -> Obj:
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.gpuslice.dev",
                            "capacity": {"requests": {"cores": "30", "memory": "4Gi"}},
                        },
                    }
                ],
                "config": [
                    {
                        "requests": ["gpu"],
                        "opaque": {
                            "driver": DRIVER,
                            "parameters": {
                                "apiVersion": "gpu.gpuslice.dev/v1alpha1",
                                "kind": "GpuConfig",
                                "sharing": {"strategy": "MPS"},
                            },
                        },
                    }
                ],
            }
        },
    }


class Controller:
    """gpuslice-controller as a process serving on 127.0.0.1, with its log and metrics."""

    def __init__(self, sandbox: ControlPlane, root: Path, name: str, namespace: str) -> None:
        self.port = procs.free_port()
        self.metrics_port = procs.free_port()
        self.log = root / "controller.log"
        argv = [
            str(BIN / "gpuslice-controller"),
            "--kubeconfig",
            str(sandbox.kubeconfig),
            "--namespace",
            namespace,
            "--identity",
            "bench-0",
            "--webhook-addr",
            f"127.0.0.1:{self.port}",
            "--metrics-addr",
            f"127.0.0.1:{self.metrics_port}",
            "--tls-secret",
            f"{name}-tls",
            "--cert-hosts",
            "127.0.0.1",
            "--cert-dir",
            str(root / "certs"),
            "--validating-webhooks",
            name,
            "--mutating-webhooks",
            name,
            "--lease-name",
            name,
        ]
        env = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "HOME": str(root)}
        if os.environ.get("PYTHONPATH"):  # a worktree's sources, or an older version's
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.proc = procs.start("controller", argv, self.log, env, cwd=REPO, die_with_parent=True)
        self.context = ssl.create_default_context()
        self.context.check_hostname = False
        self.context.verify_mode = ssl.CERT_NONE  # a bench client; the API server verifies

    def connection(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=10)

    def ready(self) -> bool:
        try:
            conn = self.connection()
            conn.request("GET", "/readyz")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def review_times(self, webhook: str, since: int) -> list[float]:
        """Seconds per review from the controller's log lines after byte ``since``."""
        times = []
        with self.log.open("rb") as f:
            f.seek(since)
            for line in f:
                if line.startswith(b"{"):
                    entry = json.loads(line)
                    if entry.get("msg") == "admission" and entry.get("webhook") == webhook:
                        times.append(entry["duration_ms"] / 1e3)
        return times

    def log_size(self) -> int:
        return self.log.stat().st_size

    def histogram(self) -> dict[str, dict[str, float]]:
        """The admission duration histogram per webhook: count, sum and the share under 20 ms."""
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        out: dict[str, dict[str, float]] = {}
        prefix = "gpuslice_controller_admission_duration_seconds"
        for line in text.splitlines():
            if not line.startswith(prefix):
                continue
            series, value = line.rsplit(" ", 1)
            webhook = series.split('webhook="', 1)[1].split('"', 1)[0]
            entry = out.setdefault(webhook, {})
            if series.startswith(prefix + "_count"):
                entry["count"] = float(value)
            elif series.startswith(prefix + "_sum"):
                entry["sum"] = float(value)
            elif 'le="0.02"' in series:
                entry["le_20ms"] = float(value)
        return out

    def stop(self) -> None:
        procs.stop([self.proc], grace=10)


def review(kind: Obj, resource: Obj, namespace: str, obj: Obj) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": kind,
                "resource": resource,
                "namespace": namespace,
                "name": obj["metadata"]["name"],
                "operation": "CREATE",
                "userInfo": {"username": "bench"},
                "object": {**obj, "metadata": {**obj["metadata"], "namespace": namespace}},
                "dryRun": False,
            },
        }
    ).encode()


def bench_direct(ctl: Controller, namespace: str, count: int) -> None:
    print("\n== 1. the controller alone: AdmissionReviews posted to it (one kept-alive conn) ==")
    cases: dict[str, tuple[str, Callable[[int], bytes], Callable[[Obj], bool]]] = {
        "pods": (
            "/mutate",
            lambda i: review(
                {"group": "", "version": "v1", "kind": "Pod"},
                {"group": "", "version": "v1", "resource": "pods"},
                namespace,
                hami_pod(f"direct-{i}", HAMI),
            ),
            lambda r: bool(r["allowed"] and r.get("patch")),
        ),
        "claims": (
            "/validate",
            lambda i: review(
                {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
                {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
                namespace,
                share_claim(f"direct-{i}"),
            ),
            lambda r: bool(r["allowed"]),
        ),
    }
    for webhook, (path, body, good) in cases.items():
        conn = ctl.connection()
        since = ctl.log_size()
        trips = []
        bad = 0
        for i in range(count):
            data = body(i)
            start = time.perf_counter()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            answer = conn.getresponse().read()
            trips.append(time.perf_counter() - start)
            bad += not good(json.loads(answer)["response"])
        conn.close()
        own = wait_for(partial(_at_least, count, ctl.review_times, webhook, since), 10, "log lines")
        print(f"{path:<10} round trip      {fmt(trips)}   ({count} reviews, {bad} unexpected)")
        print(f"{'':<10} controller's own {fmt(own)}")


def interleaved(calls: dict[str, Callable[[int], object]], count: int) -> dict[str, list[float]]:
    """Each call ``count`` times, taking turns, so load from elsewhere hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(count):
        for name, call in calls.items():
            start = time.perf_counter()
            call(i)
            times[name].append(time.perf_counter() - start)
    return times


def bench_serial(
    kube: RawApi, ctl: Controller, hooked: str, plain: str, count: int, tag: str
) -> None:
    print(f"\n== 2. through the API server, one create at a time ({count} each, interleaved) ==")
    pods = {ns: resource_path("v1", "pods", namespace=ns) for ns in (hooked, plain)}
    claims = {ns: resource_path(RESOURCE, "resourceclaims", namespace=ns) for ns in (hooked, plain)}
    since = ctl.log_size()
    times = interleaved(
        {
            "HAMi pod, webhook": lambda i: _create_translated(kube, pods[hooked], f"{tag}h{i}"),
            "HAMi pod, no webhook": lambda i: kube.create(
                pods[plain], hami_pod(f"{tag}h{i}", HAMI)
            ),
            "plain pod, webhook ns": lambda i: kube.create(pods[hooked], hami_pod(f"{tag}p{i}")),
            "share claim, webhook": lambda i: kube.create(
                claims[hooked], share_claim(f"{tag}c{i}")
            ),
            "share claim, no webhook": lambda i: kube.create(
                claims[plain], share_claim(f"{tag}c{i}")
            ),
        },
        count,
    )
    for name, samples in times.items():
        print(f"{name:<24} {fmt(samples)}")
    for what in ("HAMi pod", "share claim"):
        on, off = times[f"{what}, webhook"], times[f"{what}, no webhook"]
        print(
            f"admission cost, {what:<12} p50 {(pct(on, 0.5) - pct(off, 0.5)) * 1e3:+6.2f} ms  "
            f"p99 {(pct(on, 0.99) - pct(off, 0.99)) * 1e3:+6.2f} ms"
        )
    for webhook in ("pods", "claims"):
        own = ctl.review_times(webhook, since)
        print(f"controller's own, {webhook:<6} {fmt(own)}  ({len(own)} reviews)")


def _create_translated(kube: RawApi, path: str, name: str) -> None:
    created = kube.create(path, hami_pod(name, HAMI))
    if not created["spec"].get("resourceClaims"):
        raise AssertionError(f"pod {name} was not translated")


def _create_untranslated(kube: RawApi, path: str, name: str) -> None:
    kube.create(path, hami_pod(name, HAMI))


def _at_least(
    count: int, read: Callable[[str, int], list[float]], webhook: str, since: int
) -> list[float] | None:
    times = read(webhook, since)
    return times if len(times) >= count else None


def bench_burst(
    kube: RawApi, ctl: Controller, hooked: str, plain: str, width: int, rounds: int
) -> None:
    print(f"\n== 3. {width} HAMi pods created at once (one thread each), {rounds} rounds ==")
    for r in range(rounds):
        for label, ns in (("webhook", hooked), ("no webhook", plain)):
            path = resource_path("v1", "pods", namespace=ns)
            since = ctl.log_size()

            make = _create_translated if ns == hooked else _create_untranslated
            calls = [partial(make, kube, path, f"b{r}-{i}") for i in range(width)]
            latencies, wall = at_once(calls)
            print(
                f"round {r + 1} {label:<10} wall {wall:6.2f} s  {width / wall:6.0f} pods/s  "
                f"{fmt(latencies)}"
            )
            if ns == hooked:
                own = ctl.review_times("pods", since)
                print(f"{'':<19}controller's own {fmt(own)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=200, help="creates of each kind in part 2")
    parser.add_argument("--burst", type=int, default=100, help="pods created at once in part 3")
    parser.add_argument("--rounds", type=int, default=3, help="bursts of each kind in part 3")
    parser.add_argument("--reviews", type=int, default=500, help="reviews posted in part 1")
    parser.add_argument(
        "--parts",
        default="1,2,3",
        help="the parts to run, comma-separated (1: the controller alone; 2: one request at a "
        "time through the API server; 3: bursts)",
    )
    args = parser.parse_args()
    gslog.configure(component="bench", level="warning")
    root = Path(tempfile.mkdtemp(prefix="gcb-"))
    sandbox = ControlPlane(root / "cp", binaries=find_binaries())
    sandbox.start()
    ctl: Controller | None = None
    try:
        kube = RawApi(
            new_api_client(sandbox.kubeconfig, user_agent="bench", pool_size=2 * args.burst)
        )
        name = "bench-ctl"
        selector = {"gpuslice-bench": "webhooks"}
        for ns, labels in ((name, {}), ("hooked", selector), ("plain", {})):
            kube.create(
                resource_path("v1", "namespaces"), {"metadata": {"name": ns, "labels": labels}}
            )
            wait_for(partial(_default_sa, kube, ns), 30, f"the default ServiceAccount in {ns}")
        for doc in yaml.safe_load_all((REPO / "e2e/manifests/deviceclasses.yaml").read_text()):
            if doc:
                kube.create(resource_path(RESOURCE, "deviceclasses"), doc)
        kube.create(resource_path(RESOURCE, "resourceslices"), gpu_slice("bench-node", 8, 24 * GIB))
        ctl = Controller(sandbox, root, name, name)
        for config in webhook_configs(name, ctl.port, name, selector):
            plural = config["kind"].lower() + "s"
            kube.create(f"/apis/admissionregistration.k8s.io/v1/{plural}", config)
        wait_for(lambda: ctl.ready() or None, 60, "the controller to be ready")
        # The API server learns the CA bundle from a watch: wait until it calls us.
        wait_for(
            lambda: _try_translated(kube, "hooked", f"warm-{uuid.uuid4().hex[:6]}"),
            60,
            "the API server to call the webhook",
        )
        print(f"machine: {_machine()}; target p99 <= {TARGET_P99 * 1e3:.0f} ms")
        parts = set(args.parts.split(","))
        if "1" in parts:
            bench_direct(ctl, "hooked", args.reviews)
        if "2" in parts:
            bench_serial(kube, ctl, "hooked", "plain", args.pods, "s")
        if "3" in parts:
            bench_burst(kube, ctl, "hooked", "plain", args.burst, args.rounds)
        print("\n== the controller's duration histogram (every review above) ==")
        for webhook, h in sorted(ctl.histogram().items()):
            count = h.get("count", 0.0)
            if count:
                print(
                    f"{webhook:<7} {count:6.0f} reviews  mean {h['sum'] / count * 1e3:6.2f} ms  "
                    f"under 20 ms {h.get('le_20ms', 0.0) / count:6.1%}"
                )
    finally:
        if ctl is not None:
            ctl.stop()
        sandbox.stop()
        shutil.rmtree(root, ignore_errors=True)


def _default_sa(kube: RawApi, namespace: str) -> list[Obj]:
    path = resource_path("v1", "serviceaccounts", namespace=namespace)
    items: list[Obj] = kube.list(path, field_selector="metadata.name=default")["items"]
    return items


def _try_translated(kube: RawApi, namespace: str, name: str) -> bool | None:
    try:
        created = kube.create(
            resource_path("v1", "pods", namespace=namespace), hami_pod(name, HAMI)
        )
    except KubeError:  # the webhook not callable yet (no CA bundle): failurePolicy Fail
        return None
    return True if created["spec"].get("resourceClaims") else None


def _machine() -> str:
    cores = os.cpu_count()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cores} cores, load average {load}"


if __name__ == "__main__":
    main()
