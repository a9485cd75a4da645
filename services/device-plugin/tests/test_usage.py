"""Per-container metrics: attribution of NVML processes to the containers the pod resources API
names, and the collector's series, on the fake NVML with fake pod-resources answers, fake
cgroups and fake pods (no kubelet, no API server)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuslice_core.errors import TransientError
from gpuslice_device_plugin.devices import Resource, discover
from gpuslice_device_plugin.mps import ReplicaShare
from gpuslice_device_plugin.podresources import Holder, PodResourcesError, holders
from gpuslice_device_plugin.usage import (
    ContainerCollector,
    Sources,
    device_limits,
    pod_ids,
    proc_cgroups,
)
from gpuslice_kube.raw import Obj
from gpuslice_nvml import Nvml, open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_protos.kubelet.podresources.v1 import api_pb2 as pb
from gpuslice_testkit.device_plugin import H100_MIXED, settings, write_node

pytestmark = pytest.mark.timeout(20)

GIB = 1024**3
UID_A = "0f4e7a1c-1111-4c3b-9d2e-aaaaaaaaaaaa"
UID_B = "0f4e7a1c-2222-4c3b-9d2e-bbbbbbbbbbbb"
TIME_SLICING = """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


@dataclass
class Node:
    nvml: Nvml
    control: FakeNvmlControl
    resources: list[Resource]

    def uuid(self, gpu: int) -> str:
        return self.nvml.gpus()[gpu].uuid

    def replica(self, gpu: int, n: int) -> str:
        return f"{self.uuid(gpu)}::{n}"


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    opened: list[Nvml] = []

    def make(doc: dict[str, Any], config: str = "") -> Node:
        path = write_node(tmp_path, doc, f"node-{len(opened)}")
        nvml = open_nvml("fake", path)
        opened.append(nvml)
        return Node(nvml, FakeNvmlControl.from_config_file(path), discover(nvml, settings(config)))

    yield make
    for nvml in opened:
        nvml.close()


def pod(namespace: str, name: str, uid: str, containers: dict[str, str] | None = None) -> Obj:
    ids = containers or {}
    statuses = [{"name": c, "containerID": f"containerd://{i}"} for c, i in ids.items()]
    return {
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "status": {"containerStatuses": statuses},
    }


def collect(
    node: Node,
    held: Callable[[], list[Holder]],
    *,
    pods: Callable[[], list[Obj]] | None = None,
    cgroups: Callable[[int], list[str] | None] | None = None,
    shares: dict[str, ReplicaShare] | None = None,
    errors: list[str] | None = None,
) -> CollectorRegistry:
    gpu_memory = {g.index: g.memory_total_bytes for g in node.nvml.gpus()}
    mig_memory = {
        m.uuid: m.memory_bytes for g in node.nvml.gpus() for m in node.nvml.mig_devices(g.index)
    }
    table = device_limits(node.resources, shares or {}, gpu_memory, mig_memory)

    def no_cgroups(pid: int) -> list[str] | None:
        raise AssertionError(f"cgroup of {pid} read although one container holds the device")

    sources = Sources(held, node.nvml, pods=pods, cgroups=cgroups or no_cgroups)
    registry = CollectorRegistry()
    on_error = errors.append if errors is not None else None
    registry.register(ContainerCollector(sources, table, on_error=on_error))
    return registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def series(registry: CollectorRegistry, name: str) -> list[dict[str, str]]:
    return [s.labels for m in registry.collect() for s in m.samples if s.name == name]


def labels(node: Node, pod_name: str, gpu: int, container: str = "main") -> dict[str, str]:
    return {
        "namespace": "ns",
        "pod": pod_name,
        "container": container,
        "gpu": str(gpu),
        "UUID": node.uuid(gpu),
        "GPU_I_PROFILE": "",
        "GPU_I_ID": "",
        "resource": "nvidia.com/gpu",
    }


def test_one_holder_gets_every_process_on_its_gpu_without_reading_cgroups(
    make_node: Callable[..., Node],
) -> None:
    node = make_node({"gpus": [{"model": "H100", "count": 2}]})
    node.control.add_process(4001, 1, used_memory_bytes=3 * GIB, sm_percent=30)
    node.control.add_process(4002, 1, used_memory_bytes=1 * GIB, sm_percent=20)
    node.control.add_process(4003, 0, used_memory_bytes=GIB)  # GPU 0: nobody holds it
    held = [Holder("ns", "a", "main", "nvidia.com/gpu", node.uuid(1))]
    registry = collect(node, lambda: held)

    want = labels(node, "a", 1)
    assert value(registry, "gpuslice_container_gpu_memory_used_bytes", **want) == 4 * GIB
    total = node.nvml.gpus()[1].memory_total_bytes
    assert value(registry, "gpuslice_container_gpu_memory_limit_bytes", **want) == total
    assert value(registry, "gpuslice_container_gpu_sm_ratio", **want) == 0.5
    assert value(registry, "gpuslice_container_gpu_sm_limit_ratio", **want) == 1
    assert value(registry, "gpuslice_container_gpu_limit_enforced", **want) == 0
    assert value(registry, "gpuslice_container_gpu_processes", **want) == 2
    assert series(registry, "gpuslice_container_gpu_memory_used_bytes") == [want]
    assert series(registry, "gpuslice_device_plugin_unattributed_processes") == []


def test_time_slicing_replicas_are_told_apart_by_the_pod_uid_in_the_cgroup(
    make_node: Callable[..., Node],
) -> None:
    node = make_node({"gpus": [{"model": "L4", "count": 1}]}, TIME_SLICING)
    node.control.add_process(501, 0, used_memory_bytes=2 * GIB, sm_percent=10)
    node.control.add_process(502, 0, used_memory_bytes=5 * GIB, sm_percent=40)
    node.control.add_process(503, 0, used_memory_bytes=GIB)  # a process of neither pod
    held = [
        Holder("ns", "a", "main", "nvidia.com/gpu", node.replica(0, 0)),
        Holder("ns", "b", "main", "nvidia.com/gpu", node.replica(0, 1)),
    ]
    cgroups = {
        # cgroupfs driver, and systemd's form with underscores
        501: [f"/kubepods/besteffort/pod{UID_A}/3f2a9c"],
        502: [
            f"/kubepods.slice/kubepods-pod{UID_B.replace('-', '_')}.slice/cri-containerd-9e.scope"
        ],
        503: ["/system.slice/ollama.service"],
    }
    listed = 0

    def pods() -> list[Obj]:
        nonlocal listed
        listed += 1
        return [pod("ns", "a", UID_A), pod("ns", "b", UID_B)]

    registry = collect(node, lambda: held, pods=pods, cgroups=cgroups.get)

    used = "gpuslice_container_gpu_memory_used_bytes"
    assert value(registry, used, **labels(node, "a", 0)) == 2 * GIB
    assert value(registry, used, **labels(node, "b", 0)) == 5 * GIB
    assert value(registry, "gpuslice_container_gpu_sm_ratio", **labels(node, "b", 0)) == 0.4
    lost = {"gpu": "0", "UUID": node.uuid(0), "GPU_I_PROFILE": "", "GPU_I_ID": ""}
    assert value(registry, "gpuslice_device_plugin_unattributed_processes", **lost) == 1
    listed = 0
    series(registry, used)  # one scrape
    assert listed == 1  # one list of the node's pods per scrape, not one per process


def test_without_the_api_server_shared_gpus_are_not_guessed(
    make_node: Callable[..., Node],
) -> None:
    node = make_node({"gpus": [{"model": "L4", "count": 1}]}, TIME_SLICING)
    node.control.add_process(501, 0, used_memory_bytes=GIB)
    held = [
        Holder("ns", "a", "main", "nvidia.com/gpu", node.replica(0, 0)),
        Holder("ns", "b", "main", "nvidia.com/gpu", node.replica(0, 1)),
    ]
    errors: list[str] = []

    def failing() -> list[Obj]:
        raise TransientError("the API server is away")

    registry = collect(
        node, lambda: held, pods=failing, cgroups=lambda _: [f"/kubepods/pod{UID_A}"], errors=errors
    )

    assert value(registry, "gpuslice_container_gpu_memory_used_bytes", **labels(node, "a", 0)) == 0
    lost = {"gpu": "0", "UUID": node.uuid(0), "GPU_I_PROFILE": "", "GPU_I_ID": ""}
    assert value(registry, "gpuslice_device_plugin_unattributed_processes", **lost) == 1
    assert errors == ["apiserver", "apiserver"]  # one per scrape (two above)


def test_two_containers_of_one_pod_on_one_gpu_are_told_apart_by_container_id(
    make_node: Callable[..., Node],
) -> None:
    node = make_node({"gpus": [{"model": "L4", "count": 1}]}, TIME_SLICING)
    node.control.add_process(601, 0, used_memory_bytes=GIB)
    held = [
        Holder("ns", "a", "main", "nvidia.com/gpu", node.replica(0, 0)),
        Holder("ns", "a", "side", "nvidia.com/gpu", node.replica(0, 1)),
    ]
    ids = {"main": "a" * 64, "side": "b" * 64}
    registry = collect(
        node,
        lambda: held,
        pods=lambda: [pod("ns", "a", UID_A, ids)],
        cgroups=lambda _: [f"/kubepods/pod{UID_A}/cri-containerd-{'b' * 64}.scope"],
    )

    used = "gpuslice_container_gpu_memory_used_bytes"
    assert value(registry, used, **labels(node, "a", 0, "side")) == GIB
    assert value(registry, used, **labels(node, "a", 0, "main")) == 0


def test_an_mps_replica_reports_its_enforced_share(make_node: Callable[..., Node]) -> None:
    node = make_node({"gpus": [{"model": "L4", "count": 1}]})
    share_memory = 5 * GIB
    (resource,) = node.resources
    replica = resource.devices[0]
    share = ReplicaShare(
        device_id=replica.id,
        share_id="s1",
        cores=25,
        memory_bytes=share_memory,
        level="hard",
        memory_mechanism="memory-partition",
        cores_mechanism="mps",
        reason="",
        cdi_id="k8s.gpu.gpuslice.dev/device-plugin=gpu-0-0",
    )
    held = [Holder("ns", "a", "main", "nvidia.com/gpu", replica.id)]
    registry = collect(node, lambda: held, shares={replica.id: share})

    want = labels(node, "a", 0)
    assert value(registry, "gpuslice_container_gpu_memory_limit_bytes", **want) == share_memory
    assert value(registry, "gpuslice_container_gpu_sm_limit_ratio", **want) == 0.25
    assert value(registry, "gpuslice_container_gpu_limit_enforced", **want) == 1


def test_mig_devices_have_their_memory_as_limit_and_no_sm_series(
    make_node: Callable[..., Node],
) -> None:
    node = make_node(H100_MIXED, "version: v1\nflags:\n  migStrategy: mixed\n")
    mig = next(r for r in node.resources if r.name == "nvidia.com/mig-1g.10gb").devices[0]
    node.control.add_process(701, mig.uuid, used_memory_bytes=GIB)
    held = [Holder("ns", "a", "main", "nvidia.com/mig-1g.10gb", mig.id)]
    registry = collect(node, lambda: held)

    # a MIG device as dcgm-exporter labels it: its parent GPU, its GPU instance's profile and id
    want = {**labels(node, "a", mig.gpu_index), "GPU_I_PROFILE": "1g.10gb"}
    want["GPU_I_ID"] = str(mig.gpu_instance_id)
    want["resource"] = "nvidia.com/mig-1g.10gb"
    assert value(registry, "gpuslice_container_gpu_memory_used_bytes", **want) == GIB
    mig_memory = next(m for m in node.nvml.mig_devices(mig.gpu_index) if m.uuid == mig.uuid)
    limit = value(registry, "gpuslice_container_gpu_memory_limit_bytes", **want)
    assert limit == mig_memory.memory_bytes
    assert value(registry, "gpuslice_container_gpu_limit_enforced", **want) == 1
    assert series(registry, "gpuslice_container_gpu_sm_ratio") == []


def test_series_follow_the_kubelet_at_every_scrape_and_a_failure_drops_them(
    make_node: Callable[..., Node],
) -> None:
    node = make_node({"gpus": [{"model": "H100", "count": 1}]})
    held = [Holder("ns", "a", "main", "nvidia.com/gpu", node.uuid(0))]
    answer: list[list[Holder] | Exception] = [held]
    errors: list[str] = []

    def from_kubelet() -> list[Holder]:
        current = answer[0]
        if isinstance(current, Exception):
            raise current
        return current

    registry = collect(node, from_kubelet, errors=errors)
    name = "gpuslice_container_gpu_memory_limit_bytes"
    assert len(series(registry, name)) == 1
    answer[0] = []  # the pod is gone
    assert series(registry, name) == []
    answer[0] = PodResourcesError("pod resources List: UNAVAILABLE")
    assert series(registry, name) == []
    assert errors == ["podresources"]


def test_holders_keeps_our_resources_only() -> None:
    response = pb.ListPodResourcesResponse(
        pod_resources=[
            pb.PodResources(
                name="a",
                namespace="ns",
                containers=[
                    pb.ContainerResources(
                        name="main",
                        devices=[
                            pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["G0"]),
                            pb.ContainerDevices(resource_name="example.com/nic", device_ids=["n"]),
                        ],
                        dynamic_resources=[pb.DynamicResource(claim_name="c")],
                    )
                ],
            )
        ]
    )
    assert holders(response, {"nvidia.com/gpu"}) == [
        Holder("ns", "a", "main", "nvidia.com/gpu", "G0")
    ]


def test_pod_ids_strip_the_runtime_prefix() -> None:
    ids = pod_ids([pod("ns", "a", UID_A, {"main": "abc123"})])
    assert ids[("ns", "a")].uid == UID_A
    assert ids[("ns", "a")].containers == {"main": "abc123"}


def test_proc_cgroups_reads_every_hierarchy(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text("12:freezer:/kubepods/podX\n0::/kubepods/podX/c\n")
    assert proc_cgroups(42, tmp_path) == ["/kubepods/podX", "/kubepods/podX/c"]
    assert proc_cgroups(43, tmp_path) is None
