"""``make demo``: gpuslice on a real Kubernetes control plane with two fake-GPU nodes.

What a user sees, step by step: the control plane (etcd, kube-apiserver, controller-manager,
scheduler of the pinned release) starts on loopback; two nodes join, each a simulated kubelet
with the real ``gpuslice-kubelet-plugin`` on the fake NVML; the plugin publishes the nodes' GPUs
as ResourceSlices; pods with ResourceClaimTemplates are allocated by the real scheduler and
started by the node agent with the CDI environment the plugin prepared — so each pod's log says
which GPU it got and with which limits. A share that does not fit stays Pending with the
scheduler's reason. Everything is stopped at the end; nothing is left running.

Run: ``python -m e2e.sandbox.demo`` (``--keep`` leaves the run directory for a look at the
logs, CDI specs and checkpoints).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from e2e.sandbox.binaries import BinariesMissingError, find_binaries
from e2e.sandbox.controlplane import ControlPlane, StartError, install_signal_handlers
from e2e.sandbox.gpunode import (
    DRIVER,
    RESOURCE,
    GpuNode,
    apply_device_classes,
    claim_template,
    gpu_pod,
    pod_devices,
    start_gpu_node,
    stop_gpu_node,
)
from e2e.sandbox.nodeagent.testing import condition, wait_for, wait_pod_phase
from gpuslice_core import logging as gs_logging
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import Obj, RawApi, resource_path

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "gpuslice-demo"
GIB = 1024**3

# Node A: four H100s on NVLink, GPU 3 partitioned with MIG. Node B: one L4 that pods share.
NODE_A = [
    {"model": "H100", "count": 3},
    {
        "model": "H100",
        "migEnabled": True,
        "migInstances": [{"profile": "3g.40gb"}, {"profile": "2g.20gb"}, {"profile": "1g.10gb"}],
    },
]
NODE_B = [{"model": "L4"}]

# name, node, device class, cores, memory, CEL selector
Workload = tuple[str, str, str, str | None, str | None, str | None]
WORKLOADS: list[Workload] = [
    ("train", "a", "gpu.gpuslice.dev", None, None, None),
    ("infer-30", "b", "gpu.gpuslice.dev", "30", "8Gi", None),
    ("infer-50", "b", "gpu.gpuslice.dev", "50", "8Gi", None),
    (
        "notebook-mig",
        "a",
        "mig.gpuslice.dev",
        None,
        None,
        "device.attributes['gpu.gpuslice.dev'].profile == '3g.40gb'",
    ),
]
TOO_BIG = ("infer-40", "b", "gpu.gpuslice.dev", "40", "4Gi", None)
# NVIDIA's MIG profile names lead with the compute slices: 3g.40gb has 3, 1c.3g.40gb has 1
PROFILE_SLICES = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.")


def say(text: str = "") -> None:
    print(text, flush=True)


def step(n: int, total: int, text: str) -> None:
    say(f"\n[{n}/{total}] {text}")


def ensure_binaries() -> None:
    """Build the Kubernetes binaries on the first run (with progress), reuse them later."""
    try:
        find_binaries()
        return
    except BinariesMissingError:
        say("    first run: building etcd and Kubernetes from their Go modules (about 10 min)")
    subprocess.run(["bash", str(REPO_ROOT / "hack" / "kube-binaries.sh")], check=True)


def human_bytes(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def attributes(device: Obj) -> dict[str, object]:
    return {k: next(iter(v.values())) for k, v in (device.get("attributes") or {}).items()}


def share(device: Obj | None, cores: str) -> str:
    """What a pod got of its device: ``cores  30%`` of a GPU. A MIG device has no cores to
    share (the slice table shows ``-`` for them); it has compute slices, read off its profile."""
    attrs = attributes(device) if device is not None else {}
    if attrs.get("type") != "mig":
        return f"cores {cores:>3}%"
    m = PROFILE_SLICES.match(str(attrs.get("profile", "")))
    return f"compute slices {m.group(1) or m.group(2)}" if m else "cores   -"


def slice_table(kube: RawApi, nodes: Sequence[GpuNode]) -> None:
    say(f"    {'NODE':<16} {'DEVICE':<24} {'TYPE':<4} {'MODEL':<22} {'CORES':>5} {'MEMORY':>10}")
    for node in nodes:
        slices = node.slices(kube)
        for device in sorted(node.devices(kube).values(), key=lambda d: d["name"]):
            attrs = attributes(device)
            capacity = device.get("capacity") or {}
            cores = (capacity.get("cores") or {}).get("value", "-")
            memory = (capacity.get("memory") or {}).get("value")
            mem = human_bytes(_quantity(memory)) if memory else "-"
            say(
                f"    {node.name:<16} {device['name']:<24} {attrs.get('type', ''):<4} "
                f"{attrs.get('productName', '')!s:<22} {cores:>5} {mem:>10}"
            )
        generation = slices[0]["spec"]["pool"]["generation"] if slices else "-"
        say(f"    {'':<16} ({len(slices)} ResourceSlice(s), pool generation {generation})")


def _quantity(text: str) -> int:
    suffixes = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def create_workload(kube: RawApi, nodes: dict[str, GpuNode], spec: Workload) -> Obj:
    name, node_key, device_class, cores, memory, selector = spec
    template = claim_template(
        NAMESPACE, name, device_class, cores=cores, memory=memory, selector=selector
    )
    kube.create(resource_path(RESOURCE, "resourceclaimtemplates", namespace=NAMESPACE), template)
    pod = gpu_pod(NAMESPACE, name, nodes[node_key].name, template=name)
    return kube.create(resource_path("v1", "pods", namespace=NAMESPACE), pod)


def report_pod(kube: RawApi, node: GpuNode, pod: Obj) -> None:
    name = pod["metadata"]["name"]
    running = wait_pod_phase(kube, NAMESPACE, name, "Running", timeout=60)
    devices = pod_devices(node, running)  # one set of GPUSLICE_<DEVICE>_* variables each
    first = devices[0] if devices else {}
    shown = ",".join(d.get("DEVICE", "?") for d in devices) or "?"
    got = share(node.devices(kube).get(first.get("DEVICE", "")), first.get("CORES", "?"))
    memory = first.get("MEMORY", "0")
    say(
        f"    {name:<14} Running on {node.name:<12} {shown:<22} {got:<16}  "
        f"memory {human_bytes(int(memory or 0)):>9}  {first.get('UUID', '?')[:26]}…"
    )


def report_pending(kube: RawApi, name: str) -> None:
    def unschedulable() -> Obj | None:
        pod = kube.get(resource_path("v1", "pods", namespace=NAMESPACE, name=name))
        scheduled = condition(pod, "PodScheduled")
        return scheduled if scheduled and scheduled.get("reason") == "Unschedulable" else None

    scheduled = wait_for(unschedulable, 60, f"pod {name} to be judged unschedulable")
    say(f"    {name:<14} Pending: {scheduled.get('message', '')}")


@contextlib.contextmanager
def demo_cluster(run_dir: Path) -> Iterator[tuple[ControlPlane, RawApi]]:
    cp = ControlPlane(run_dir / "control-plane")
    try:
        cp.start()
        yield cp, RawApi(new_api_client(cp.kubeconfig, user_agent="gpuslice-demo"))
    finally:
        left = cp.stop()
        if left:
            say(f"    WARNING: still running after stop: {', '.join(left)}")


def run(keep: bool) -> int:
    total = 5
    run_dir = Path(tempfile.mkdtemp(prefix="gpuslice-demo-"))
    say("gpuslice sandbox demo: a real Kubernetes control plane on loopback, two fake-GPU nodes")
    step(1, total, "Kubernetes binaries")
    ensure_binaries()
    binaries = find_binaries()
    say(f"    {binaries.kube_version} from {binaries.bin_dir}")
    install_signal_handlers()
    # The node agents' and our libraries' logs go to a file; the terminal shows the story.
    log_file = (run_dir / "demo.log").open("w")
    gs_logging.configure(component="demo", stream=log_file)
    started = time.monotonic()
    nodes: dict[str, GpuNode] = {}
    kube: RawApi | None = None
    try:
        step(2, total, "control plane: etcd, kube-apiserver, kube-controller-manager, scheduler")
        with demo_cluster(run_dir) as (cp, kube):
            say(f"    up at {cp.server} ({cp.timings})")
            step(3, total, "nodes: a simulated kubelet + gpuslice-kubelet-plugin on the fake NVML")
            for key, gpus in (("a", NODE_A), ("b", NODE_B)):
                (run_dir / key).mkdir()
                nodes[key] = start_gpu_node(cp, gpus, name=f"gpu-node-{key}", root=run_dir / key)
            say("    gpu-node-a: 4x NVIDIA H100 80GB HBM3 (GPU 3 in MIG mode: 3g.40gb, 2g.20gb,")
            say("                1g.10gb); gpu-node-b: 1x NVIDIA L4")
            classes = apply_device_classes(kube)
            say(f"    DeviceClasses: {', '.join(classes)}")
            for node in nodes.values():
                wait_for(
                    lambda n=node: n.slices(kube) or None,  # type: ignore[misc]
                    30,
                    f"{node.name}'s ResourceSlices",
                )
            say(f"    published by {DRIVER}:")
            slice_table(kube, list(nodes.values()))

            step(4, total, "pods with ResourceClaimTemplates, allocated by the real scheduler")
            kube.create(
                resource_path("v1", "namespaces"),
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            )
            pods = [create_workload(kube, nodes, w) for w in WORKLOADS]
            for pod, spec in zip(pods, WORKLOADS, strict=True):
                report_pod(kube, nodes[spec[1]], pod)
            create_workload(kube, nodes, TOO_BIG)
            report_pending(kube, TOO_BIG[0])

            step(5, total, "teardown")
            for node in nodes.values():
                stop_gpu_node(node, kube, keep=keep)
            nodes.clear()
    except (StartError, TimeoutError, AssertionError, subprocess.CalledProcessError) as exc:
        say(f"\ndemo failed: {exc}")
        say(f"logs kept in {run_dir} (demo.log, */plugin.log, control-plane/logs)")
        return 1
    finally:
        for node in nodes.values():
            if kube is not None:
                with contextlib.suppress(Exception):
                    stop_gpu_node(node, kube, keep=True)
    log_file.close()
    say(f"    everything stopped; demo took {time.monotonic() - started:.0f}s")
    if keep:
        say(f"    run directory kept: {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.sandbox.demo", description=__doc__)
    parser.add_argument("--keep", action="store_true", help="Keep the run directory.")
    args = parser.parse_args(argv)
    return run(args.keep)


if __name__ == "__main__":
    sys.exit(main())
