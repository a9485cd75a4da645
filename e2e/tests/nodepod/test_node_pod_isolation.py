"""Each container sees exactly the devices of the requests and claims it names.

The real scheduler allocates, the real kubelet plugin and enforcer prepare (one sandbox node
pod, e2e/sandbox/nodeservices.py), and the node agent hands every container only the CDI ids of
the requests it lists, in the kubelet's order. Per container this checks the CDI devices the
runtime got, the device variables it printed (one set per device, none claim-wide, no
``CUDA_VISIBLE_DEVICES``) and that the enforcer's hooks run only where a share is: four MIG
devices of one claim in four containers, a whole GPU and a share of one claim in two containers,
a container naming both requests, and one container with two claims of one GPU each.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    DRIVER,
    RESOURCE,
    GpuNode,
    claim_request,
    create_multi_request_template,
    mig_profile,
    on_gpu,
    pod_devices,
    pod_env,
    run_pod,
)
from e2e.sandbox.nodeservices import NodePod, serve_node_pod, start_node_pod
from e2e.scenarios.nodes import QUICKSTART_MIG_A100
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kubelet_plugin.cdispecs import env_key
from gpuslice_nvml import open_nvml

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)

GIB = 1024**3
KIND = "k8s.gpu.gpuslice.dev/claim"
# GPU 0: an A100 in MIG mode cut as in NVIDIA's MIG quickstart; GPUs 1-4: L4s to share. Driver
# 615: the CDI hook sets a memory partition on the container's cgroup.
NODE = [QUICKSTART_MIG_A100, {"model": "L4", "count": 4}]


@pytest.fixture(scope="module")
def node_pod(
    sandbox: ControlPlane, kube: RawApi, device_classes: list[str], request: pytest.FixtureRequest
) -> Iterator[NodePod]:
    pod = start_node_pod(
        sandbox, NODE, enforcer=True, enforcer_args=("--mps=off",), nvml={"driverVersion": "615.20"}
    )
    yield from serve_node_pod(pod, kube, lambda: request.session.testsfailed)


class Allocation:
    """What the scheduler gave the pod: per pod claim and request, the device, its UUID (from
    the slice), its share ID and its CDI id."""

    def __init__(self, kube: RawApi, node: GpuNode, namespace: str, pod: Obj) -> None:
        uuids = {name: d["attributes"]["uuid"]["string"] for name, d in node.devices(kube).items()}
        self.devices: dict[tuple[str, str], tuple[str, str, str, str]] = {}
        for status in pod["status"]["resourceClaimStatuses"]:
            path = resource_path(
                RESOURCE, "resourceclaims", namespace=namespace, name=status["resourceClaimName"]
            )
            claim = kube.get(path)
            uid = claim["metadata"]["uid"]
            for r in claim["status"]["allocation"]["devices"]["results"]:
                share = r.get("shareID") or ""
                name = f"{uid}-{r['device']}" + (f"-{share}" if share else "")
                key = (status["name"], r["request"])
                self.devices[key] = (r["device"], uuids[r["device"]], f"{KIND}={name}", share)

    def uuids(self, *keys: tuple[str, str]) -> list[str]:
        return [self.devices[k][1] for k in keys]

    def cdi_ids(self, *keys: tuple[str, str]) -> list[str]:
        return [self.devices[k][2] for k in keys]

    def env_key(self, key: tuple[str, str]) -> str:
        device, _, _, share = self.devices[key]
        return env_key(device, share or None)


def container_view(node: GpuNode, pod: Obj, container: str) -> tuple[list[str], list[str], Obj]:
    """(UUIDs in its device variables, sorted; its CDI devices in the order the runtime got
    them; the edits the runtime applied)."""
    assert node.agent is not None
    uid = pod["metadata"]["uid"]
    env = pod_env(node, pod, container=container)
    assert "CUDA_VISIBLE_DEVICES" not in env  # one variable cannot hold a union of devices
    devices = sorted(d["UUID"] for d in pod_devices(node, pod, container=container))
    return (
        devices,
        node.agent.container_cdi_devices(uid, container),
        node.agent.container_edits(uid, container),
    )


def hooks(edits: Obj) -> list[str]:
    return [h["hookName"] for h in edits.get("hooks") or []]


def test_four_mig_devices_of_one_claim_go_one_to_each_of_four_containers(
    node_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    """NVIDIA's MIG quickstart: four requests bound to one parent GPU by ``matchAttribute``."""
    node = node_pod.node
    requests = [
        ("small-0", "1g.5gb"),
        ("small-1", "1g.5gb"),
        ("medium", "2g.10gb"),
        ("large", "3g.20gb"),
    ]
    create_multi_request_template(
        kube,
        namespace,
        "mig",
        [claim_request(r, "mig.gpuslice.dev", mig_profile(p)) for r, p in requests],
        constraints=[{"matchAttribute": f"{DRIVER}/parentUUID"}],
    )
    containers = {f"ctr{i}": [{"name": "mig", "request": r}] for i, (r, _) in enumerate(requests)}
    pod = run_pod(kube, node, namespace, "mig", containers)
    alloc = Allocation(kube, node, namespace, pod)
    assert len(set(alloc.uuids(*alloc.devices))) == 4
    for i, (request, _) in enumerate(requests):
        devices, cdi_ids, edits = container_view(node, pod, f"ctr{i}")
        assert devices == alloc.uuids(("mig", request)), f"ctr{i}"
        assert cdi_ids == alloc.cdi_ids(("mig", request)), f"ctr{i}"
        assert hooks(edits) == []


def test_a_whole_gpu_and_a_share_of_one_claim_in_their_own_containers_and_together(
    node_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    node = node_pod.node
    create_multi_request_template(
        kube,
        namespace,
        "mixed",
        [
            claim_request("whole", "gpu.gpuslice.dev", on_gpu(1)),
            claim_request("share", "gpu.gpuslice.dev", on_gpu(2), cores="30", memory="4Gi"),
        ],
    )
    containers = {
        "whole": [{"name": "mixed", "request": "whole"}],
        "share": [{"name": "mixed", "request": "share"}],
        "both": [{"name": "mixed", "request": "share"}, {"name": "mixed", "request": "whole"}],
    }
    pod = run_pod(kube, node, namespace, "mixed", containers)
    alloc = Allocation(kube, node, namespace, pod)
    whole, share = ("mixed", "whole"), ("mixed", "share")

    devices, cdi_ids, edits = container_view(node, pod, "whole")
    assert (devices, cdi_ids) == (alloc.uuids(whole), alloc.cdi_ids(whole))
    assert hooks(edits) == []  # nothing to enforce on a GPU of its own

    devices, cdi_ids, edits = container_view(node, pod, "share")
    assert (devices, cdi_ids) == (alloc.uuids(share), alloc.cdi_ids(share))
    assert hooks(edits) == ["createContainer", "poststop"]
    env = pod_env(node, pod, container="share")
    prefix = f"GPUSLICE_{alloc.env_key(share)}"
    assert (env[f"{prefix}_CORES"], env[f"{prefix}_MEMORY"]) == ("30", str(4 * GIB))
    assert env[f"{prefix}_ENFORCEMENT"] == "soft"

    # a container naming both requests gets both, in the kubelet's order (its entries' order
    # within one claim), each device's variables beside the other's
    devices, cdi_ids, edits = container_view(node, pod, "both")
    assert devices == sorted(alloc.uuids(share, whole))
    assert cdi_ids == alloc.cdi_ids(share, whole)
    assert hooks(edits) == ["createContainer", "poststop"]
    env = pod_env(node, pod, container="both")
    assert env[f"GPUSLICE_{alloc.env_key(whole)}_ENFORCEMENT"] == "exclusive"
    assert env[f"{prefix}_ENFORCEMENT"] == "soft"
    # the share's limit is set on the cgroups of exactly the containers that have the share
    assert node.agent is not None
    limited = []
    with open_nvml("fake", node.nvml_config) as nvml:
        for name in containers:
            container = node.agent.runtime.adopt(pod["metadata"]["uid"], name)
            assert container is not None
            v2 = [p for p in container.cgroups if (p / "cgroup.controllers").exists()]
            if v2 and nvml.memory_limits(2, str(v2[0])).hard_limit == 4 * GIB:
                limited.append(name)
    if limited:  # (no cgroup v2 without root: then the hooks above are the evidence)
        assert limited == ["share", "both"]


def test_one_container_with_two_claims_of_one_gpu_each_sees_both(
    node_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    node = node_pod.node
    create_multi_request_template(
        kube, namespace, "a", [claim_request("gpu", "gpu.gpuslice.dev", on_gpu(3))]
    )
    create_multi_request_template(
        kube,
        namespace,
        "b",
        [claim_request("gpu", "gpu.gpuslice.dev", on_gpu(4), cores="20", memory="2Gi")],
    )
    pod = run_pod(kube, node, namespace, "two", {"main": [{"name": "b"}, {"name": "a"}]})
    alloc = Allocation(kube, node, namespace, pod)
    devices, cdi_ids, edits = container_view(node, pod, "main")
    # the kubelet's order is the pod's claims' (a, b), not the container's entries' (b, a)
    assert devices == sorted(alloc.uuids(("a", "gpu"), ("b", "gpu")))
    assert cdi_ids == alloc.cdi_ids(("a", "gpu"), ("b", "gpu"))
    assert hooks(edits) == ["createContainer", "poststop"]  # b's share only
    got = {d["CLAIM"].split("/")[1]: d for d in pod_devices(node, pod)}
    assert sorted(got) == sorted(
        pod["status"]["resourceClaimStatuses"][i]["resourceClaimName"] for i in range(2)
    )
    enforcement = sorted(d["ENFORCEMENT"] for d in got.values())
    assert enforcement == ["exclusive", "soft"]
