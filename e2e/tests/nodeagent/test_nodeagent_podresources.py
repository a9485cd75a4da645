"""The node agent's pod resources API (``<root>/pod-resources/kubelet.sock``) on the real control
plane with the stand-in DRA plugin: List and Get show a claim's devices for the container that
references it and nothing for one that does not; a deleted pod leaves List."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import wait_for, wait_pod_gone, wait_pod_phase
from e2e.support.dra_objects import (
    RESOURCE,
    claim_template,
    create,
    create_slice,
    delete_pod,
    gpu_pod,
    shareable_gpu,
)
from e2e.support.standin_dra_plugin import DRIVER, StandinDraPlugin
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_protos.kubelet.podresources.v1 import api_pb2 as pb
from gpuslice_protos.kubelet.podresources.v1 import api_pb2_grpc as pb_grpc

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lister(node_agent: NodeAgent) -> Iterator[pb_grpc.PodResourcesListerStub]:
    socket = node_agent.config.root / "pod-resources" / "kubelet.sock"
    assert socket.is_socket()
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        yield pb_grpc.PodResourcesListerStub(channel)


def two_container_pod(namespace: str, node: str, template: str) -> Obj:
    pod = gpu_pod(namespace, "p1", node, template, script="sleep 60")
    pod["spec"]["containers"].append(
        {"name": "bystander", "image": "busybox", "command": ["sleep", "60"]}
    )
    return pod


def listed(stub: pb_grpc.PodResourcesListerStub, namespace: str) -> list[pb.PodResources]:
    pods = stub.List(pb.ListPodResourcesRequest(), timeout=5).pod_resources
    return [p for p in pods if p.namespace == namespace]


def test_list_and_get_show_the_claim_for_the_container_that_uses_it(
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    standin: StandinDraPlugin,
    device_class: str,
    lister: pb_grpc.PodResourcesListerStub,
) -> None:
    node = node_agent.name
    create_slice(kube, node, [shareable_gpu()])
    template = claim_template(namespace, "one", device_class, "30")
    create(kube, namespace, "resourceclaimtemplates", template, RESOURCE)
    create(kube, namespace, "pods", two_container_pod(namespace, node, "one"))
    pod = wait_pod_phase(kube, namespace, "p1", "Running", timeout=15)
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim_uid = kube.get(f"/apis/{RESOURCE}/namespaces/{namespace}/resourceclaims/{claim_name}")[
        "metadata"
    ]["uid"]

    (pr,) = listed(lister, namespace)
    assert pr.name == "p1"
    by_name = {c.name: c for c in pr.containers}
    assert list(by_name) == ["main", "bystander"]
    main = by_name["main"]
    assert not main.devices
    (dyn,) = main.dynamic_resources
    assert (dyn.claim_name, dyn.claim_namespace) == (claim_name, namespace)
    (res,) = dyn.claim_resources
    assert (res.driver_name, res.pool_name, res.device_name) == (DRIVER, node, "gpu-0")
    # the stand-in names its CDI device after the claim UID, the device and the share id
    ids = [c.name for c in res.cdi_devices]
    assert len(ids) == 1 and ids[0].startswith(f"k8s.{DRIVER}/claim=") and claim_uid in ids[0]
    assert res.HasField("share_id") and res.share_id  # a shareable device: v1 returns one
    assert res.share_id in ids[0]
    bystander = by_name["bystander"]
    assert not bystander.devices and not bystander.dynamic_resources

    got = lister.Get(pb.GetPodResourcesRequest(pod_name="p1", pod_namespace=namespace), timeout=5)
    assert got.pod_resources == pr
    with pytest.raises(grpc.RpcError) as err:
        lister.Get(pb.GetPodResourcesRequest(pod_name="nope", pod_namespace=namespace), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    delete_pod(kube, namespace, "p1")
    wait_pod_gone(kube, namespace, "p1", timeout=15)
    wait_for(lambda: listed(lister, namespace) == [], 5, "the pod to leave List")
