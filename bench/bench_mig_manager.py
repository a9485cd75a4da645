"""MIG manager figures on the fake NVML (8x A100-SXM4-40GB): layout application, planning and
the gRPC API over a unix socket. Prints figures; asserts nothing.

    .venv/bin/python bench/bench_mig_manager.py [--rounds N]

The fake keeps its state in one JSON file that every NVML call reads (and every change
rewrites, fsynced), so absolute times are the fake's; the ratios between operations and the
planner's share are what carry over to a real node, where NVML calls cost less and MIG mode
changes (GPU resets) cost seconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import yaml

from gpuslice_core import logging as gslog
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_mig_manager.apply import apply_layout
from gpuslice_mig_manager.layouts import parse_layouts
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.planner import Shape, Want, plan, total_compute_slices
from gpuslice_mig_manager.servicer import SERVICE_NAME, MigManagerServicer
from gpuslice_mig_manager.state import open_store
from gpuslice_nvml.fake import FakeNvml
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as pb
from gpuslice_protos.gpuslice.v1 import migmanager_pb2_grpc as pbgrpc

REPO = Path(__file__).resolve().parents[1]
NODE = "name: bench\nstatePath: fake.json\ngpus:\n  - model: A100-SXM4-40GB\n    count: 8\n"


def timed(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median and max seconds of ``rounds`` calls."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), max(samples)


def row(what: str, median: float, worst: float, note: str = "") -> None:
    print(f"{what:<52} {median * 1e3:9.2f} ms  (max {worst * 1e3:8.2f} ms)  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    gslog.configure(component="bench", level="warning")
    text = yaml.safe_load((REPO / "e2e/manifests/mig-configs.yaml").read_text())["data"]
    layouts = parse_layouts(text["config.yaml"])
    with tempfile.TemporaryDirectory(prefix="gsmm-bench-") as tmp:
        root = Path(tmp)
        (root / "node.yaml").write_text(NODE)
        fake = FakeNvml.from_config_file(root / "node.yaml")
        manager = MigManager(fake, open_store(root / "state", boot_id="bench"), dynamic=True)

        profiles = fake.gpu_instance_profiles(0)
        shapes = {p.name: Shape.of(p) for p in profiles}
        wants = [Want("1g.5gb", shapes["1g.5gb"])] * 2 + [
            Want("2g.10gb", shapes["2g.10gb"]),
            Want("3g.20gb", shapes["3g.20gb"]),
        ]
        total = total_compute_slices(profiles)
        row("plan all-balanced for one GPU (pure)", *timed(lambda: plan(wants, [], total), 200))

        def switch(a: str, b: str) -> Callable[[], object]:
            def go() -> None:
                apply_layout(manager, a, layouts)
                apply_layout(manager, b, layouts)

            return go

        apply_layout(manager, "all-disabled", layouts)
        start = time.perf_counter()
        first = apply_layout(manager, "all-1g.5gb", layouts)
        row("all-1g.5gb from MIG off (8 resets, 56 creates)", *(time.perf_counter() - start,) * 2)
        assert first.state.value == "success"
        row(
            "re-apply all-1g.5gb (no change)",
            *timed(lambda: apply_layout(manager, "all-1g.5gb", layouts), rounds),
        )
        row(
            "all-1g.5gb <-> all-balanced (both ways)",
            *timed(switch("all-balanced", "all-1g.5gb"), rounds),
            "40 destroys + 16 creates, then back",
        )

        socket = root / "mm.sock"
        server = UnixGrpcServer([socket], name="bench")
        server.add(
            pbgrpc.add_MigManagerServicer_to_server, MigManagerServicer(manager, None), SERVICE_NAME
        )
        server.start()
        try:
            with grpc.insecure_channel(f"unix://{socket}") as channel:
                stub = pbgrpc.MigManagerStub(channel)
                row(
                    "ListGpus, 8 GPUs / 56 instances",
                    *timed(lambda: stub.ListGpus(pb.ListGpusRequest(), timeout=10), rounds * 4),
                )
                apply_layout(manager, "all-enabled", layouts)
                apply_layout(manager, "all-disabled", layouts)
                apply_layout(manager, "all-enabled", layouts)
                gpu = fake.gpu(0).uuid

                def create_destroy() -> None:
                    made = stub.CreateInstance(
                        pb.CreateInstanceRequest(
                            gpu_uuid=gpu, profile_name="3g.20gb", placement_start=4, owner="b"
                        ),
                        timeout=10,
                    )
                    stub.DestroyInstance(
                        pb.DestroyInstanceRequest(
                            gpu_uuid=gpu, gpu_instance_id=made.instance.gpu_instance_id, owner="b"
                        ),
                        timeout=10,
                    )

                row(
                    "CreateInstance + DestroyInstance (dynamic)", *timed(create_destroy, rounds * 4)
                )
                request = pb.CreateInstanceRequest(
                    gpu_uuid=gpu, profile_name="2g.10gb", placement_start=0, owner="c"
                )
                stub.CreateInstance(request, timeout=10)
                row(
                    "CreateInstance again (idempotent, no change)",
                    *timed(lambda: stub.CreateInstance(request, timeout=10), rounds * 4),
                )
        finally:
            server.stop(1)


if __name__ == "__main__":
    main()
