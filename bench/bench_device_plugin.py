"""The legacy device plugin's hot paths, as the kubelet calls them. Prints figures; asserts
nothing (targets from issue 15: Allocate p99 <= 5 ms, GetPreferredAllocation <= 50 ms).

    .venv/bin/python bench/bench_device_plugin.py [--calls 500]

The plugin's own servers (PluginManager, one gRPC server per resource on a unix socket) run in
this process on the fake NVML; a stand-in kubelet Registration service accepts Register, and
the calls go over the plugin's socket like the kubelet's:

- Allocate of one GPU and of 8 GPUs (envvar): p50 / p99 / max;
- GetPreferredAllocation, whole GPUs by NVLink/PCIe score: 2 of 8 and 4 of 16 (and 8 of 16,
  the largest exhaustive search), p50 / p99 / max;
- ListAndWatch update latency: from an injected XID (the fake NVML's event, as a GPU would
  raise it) to the update with the device Unhealthy arriving on an open stream.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_device_plugin.allocate import Topology
from gpuslice_device_plugin.devices import discover
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.server import PluginManager
from gpuslice_nvml import open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuslice_testkit.device_plugin import settings


class Kubelet(pb_grpc.RegistrationServicer):
    def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:  # noqa: N802
        return pb.Empty()


def node(directory: Path, gpus: int) -> Path:
    """``gpus`` H100s in NVLink islands of 4 (two NUMA nodes), like an HGX board."""
    islands = [list(range(i, min(i + 4, gpus))) for i in range(0, gpus, 4)]
    half = gpus // 2
    doc = {
        "name": f"bench-{gpus}",
        "statePath": f"bench-{gpus}-state.json",
        "gpus": [
            {"model": "H100", "count": half, "numaNode": 0},
            {"model": "H100", "count": gpus - half, "numaNode": 1},
        ],
        "topology": {"nvlink": [{"gpus": g, "links": 18} for g in islands]},
    }
    path = directory / f"bench-{gpus}-nvml.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def figures(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"p50 {statistics.median(ms):6.2f} ms  p99 {p99:6.2f} ms  max {ms[-1]:6.2f} ms"


def timed(call: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


class Plugin:
    """The plugin's servers for one fake node, registered with a stand-in kubelet."""

    def __init__(self, root: Path, gpus: int, *flags: str) -> None:
        self.config = node(root, gpus)
        self.nvml = open_nvml("fake", self.config)
        s = settings("", *flags)
        self.resources = discover(self.nvml, s)
        self.dir = root / f"dp-{gpus}"
        self.dir.mkdir()
        self.kubelet = UnixGrpcServer([self.dir / "kubelet.sock"], name="kubelet")
        self.kubelet.add(
            pb_grpc.add_RegistrationServicer_to_server, Kubelet(), "v1beta1.Registration"
        )
        self.kubelet.start()
        self.health = HealthTracker(self.nvml, quiet_period=3600, check_interval=3600)
        self.health.start()
        gpu_ids = sorted({d.gpu_index for r in self.resources for d in r.devices})
        self.manager = PluginManager(
            self.dir,
            self.resources,
            s,
            self.health,
            Topology.from_nvml(self.nvml, gpu_ids),
            Metrics(),
        )
        self.manager.start()
        self.channel = grpc.insecure_channel(f"unix://{self.dir / 'gpuslice-gpu.sock'}")
        self.stub = pb_grpc.DevicePluginStub(self.channel)
        self.ids = [d.id for d in self.resources[0].devices]

    def close(self) -> None:
        self.channel.close()
        self.manager.stop(grace=0.1)
        self.health.stop()
        self.kubelet.stop(0.1)
        self.nvml.close()


def bench_allocate(plugin: Plugin, calls: int) -> None:
    one = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=plugin.ids[:1])]
    )
    eight = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=plugin.ids[:8])]
    )
    timed(lambda: plugin.stub.Allocate(one, timeout=5), 20)  # warm the channel
    for label, request in (("Allocate 1 GPU", one), ("Allocate 8 GPUs", eight)):

        def call(r: pb.AllocateRequest = request) -> object:
            return plugin.stub.Allocate(r, timeout=5)

        print(f"{label:<40}{figures(timed(call, calls))}")


def bench_preferred(plugin: Plugin, size: int, calls: int, seed: int = 7) -> None:
    rng = random.Random(seed)  # noqa: S311 - a reproducible order, not a secret

    def call() -> object:
        available = list(plugin.ids)
        rng.shuffle(available)  # the kubelet's order carries no meaning
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, allocation_size=size
                )
            ]
        )
        return plugin.stub.GetPreferredAllocation(request, timeout=30)

    samples = timed(call, calls)
    label = f"GetPreferredAllocation {size} of {len(plugin.ids)}"
    print(f"{label:<40}{figures(samples)}")


def bench_xid(plugin: Plugin, rounds: int) -> None:
    """XID → the Unhealthy update on an open ListAndWatch stream (then recovery, by hand)."""
    control = FakeNvmlControl.from_config_file(plugin.config)
    samples: list[float] = []
    stream = plugin.stub.ListAndWatch(pb.Empty())
    next(stream)  # the initial list
    updates: list[tuple[float, pb.ListAndWatchResponse]] = []
    got = threading.Condition()

    def read() -> None:
        try:
            for response in stream:
                with got:
                    updates.append((time.perf_counter(), response))
                    got.notify_all()
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for i in range(rounds):
        gpu = i % len(plugin.ids)
        with got:
            seen = len(updates)
        t0 = time.perf_counter()
        control.inject_xid(gpu, 79)
        with got:
            if not got.wait_for(lambda s=seen: len(updates) > s, timeout=10):  # type: ignore[misc]
                print("ListAndWatch: no update within 10 s")
                break
            at, response = updates[seen]
        assert any(d.health == "Unhealthy" for d in response.devices)
        samples.append(at - t0)
        # recover by hand (the real rule waits --xid-quiet-period): clear the problems
        plugin.health.quiet_period = 0
        plugin.health.check_recovery()
        plugin.health.quiet_period = 3600
        with got:
            got.wait_for(lambda s=seen: len(updates) > s + 1, timeout=10)  # type: ignore[misc]
    stream.cancel()
    print(f"ListAndWatch update after an XID        {figures(samples)}  ({len(samples)} XIDs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="Calls per figure.")
    parser.add_argument("--xids", type=int, default=30, help="XIDs injected for the latency.")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gdpb-"))  # unix socket paths are short
    try:
        eight = Plugin(root, 8)
        sixteen = Plugin(root, 16)
        try:
            bench_allocate(eight, args.calls)
            bench_preferred(eight, 2, args.calls)
            bench_preferred(sixteen, 4, max(50, args.calls // 5))
            bench_preferred(sixteen, 8, 20)
            bench_xid(eight, args.xids)
        finally:
            eight.close()
            sixteen.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
