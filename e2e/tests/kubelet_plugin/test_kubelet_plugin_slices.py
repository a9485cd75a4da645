"""ResourceSlice publishing on the real API server: generations, stale slices, other nodes'
slices left alone, a wiped pool and an edited slice put back, republishing on a health change,
and the older resource.k8s.io versions (v1beta2, v1beta1) when the server does not offer v1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import RESOURCE, delete_node_slices, node_slices
from e2e.sandbox.nodeagent.testing import unique, wait_for
from gpuslice_draplugin import HelperMetrics, Pool, ResourceApi, detect
from gpuslice_draplugin.kubeapi import read_node
from gpuslice_draplugin.slices import SlicePublisher, node_owner
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml import open_nvml
from gpuslice_testkit.kubelet_plugin.harness import Harness, Node, Running, write_node

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)

DRIVER = "gpu.gpuslice.dev"


def plain(n: int, start: int = 0) -> list[Obj]:
    return [{"name": f"d-{i}", "attributes": {}} for i in range(start, start + n)]


class Publishers:
    """SlicePublishers on the sandbox's API server; stopped and their slices deleted after."""

    def __init__(self, sandbox: ControlPlane, kube: RawApi) -> None:
        self.raw = RawApi(new_api_client(sandbox.kubeconfig, user_agent="t"), deadline=5)
        self.server = detect(self.raw)
        self.kube = kube
        self.made: list[SlicePublisher] = []

    def new(
        self,
        pool: Pool,
        node: str,
        owner: Callable[[], Obj | None] = lambda: None,
    ) -> SlicePublisher:
        """A publisher of ``node``'s pool (named after the node), not started."""
        pub = SlicePublisher(
            ResourceApi(self.raw, self.server),
            node=node,
            driver=DRIVER,
            metrics=HelperMetrics("test"),
            owner=owner,
        )
        pub.set_pools({node: pool})
        self.made.append(pub)
        return pub

    def close(self) -> None:
        for pub in self.made:
            pub.stop()
            delete_node_slices(self.kube, pub.node)


@pytest.fixture
def publishers(sandbox: ControlPlane, kube: RawApi) -> Iterator[Publishers]:
    made = Publishers(sandbox, kube)
    yield made
    made.close()


def test_the_sandbox_is_detected_as_serving_v1(publishers: Publishers) -> None:
    assert publishers.server.version == "v1"
    assert publishers.server.group_version == "resource.k8s.io/v1"
    assert publishers.server.minor >= 34


def test_generation_count_and_stale_slices(
    publishers: Publishers, kube: RawApi, node_name: str
) -> None:
    other = unique("other")
    foreign = kube.create(
        resource_path(RESOURCE, "resourceslices"),
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceSlice",
            "metadata": {"generateName": f"{other}-"},
            "spec": {
                "driver": DRIVER,
                "nodeName": other,
                "pool": {"name": other, "generation": 7, "resourceSliceCount": 1},
                "devices": [],
            },
        },
    )

    def untouched(before: Obj) -> bool:
        after = node_slices(kube, other)
        return [(s["metadata"], s["spec"]) for s in after] == [(before["metadata"], before["spec"])]

    try:
        pub = publishers.new(Pool(plain(200)), node_name)
        assert pub.reconcile() is True
        slices = node_slices(kube, node_name)
        assert len(slices) == 2
        assert {s["spec"]["pool"]["generation"] for s in slices} == {1}
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
        assert sorted(len(s["spec"]["devices"]) for s in slices) == [72, 128]
        assert pub.reconcile() is False  # nothing changed: nothing written
        assert node_slices(kube, node_name) == slices  # not even a resourceVersion

        pub.set_pools({node_name: Pool(plain(100))})  # shrinks to one slice
        assert pub.reconcile() is True
        slices = node_slices(kube, node_name)
        assert len(slices) == 1
        assert slices[0]["spec"]["pool"] == {
            "name": node_name,
            "generation": 2,
            "resourceSliceCount": 1,
        }
        assert untouched(foreign)

        pub.set_pools({node_name: Pool(plain(100) + plain(100, start=500))})  # grows again
        assert pub.reconcile() is True
        slices = node_slices(kube, node_name)
        assert {s["spec"]["pool"]["generation"] for s in slices} == {3}
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
        assert untouched(foreign)
    finally:
        delete_node_slices(kube, other)


def test_pools_are_published_each_with_its_own_generation_and_dropped_when_left_out(
    publishers: Publishers, kube: RawApi, node_name: str
) -> None:
    def by_pool() -> dict[str, list[tuple[int, int, int]]]:
        out: dict[str, list[tuple[int, int, int]]] = {}
        for s in node_slices(kube, node_name):
            pool = s["spec"]["pool"]
            out.setdefault(pool["name"], []).append(
                (pool["generation"], pool["resourceSliceCount"], len(s["spec"]["devices"]))
            )
        return {name: sorted(slices) for name, slices in out.items()}

    pub = publishers.new(Pool(plain(3)), node_name)
    pub.set_pools({"a": Pool(plain(3)), "b": Pool(plain(130))})
    assert pub.reconcile() is True
    assert by_pool() == {"a": [(1, 1, 3)], "b": [(1, 2, 2), (1, 2, 128)]}
    pub.set_pools({"a": Pool(plain(3)), "b": Pool(plain(2))})
    assert pub.reconcile() is True
    assert by_pool() == {"a": [(1, 1, 3)], "b": [(2, 1, 2)]}  # only b was rewritten
    pub.set_pools({"a": Pool(plain(3))})
    assert pub.reconcile() is True
    assert by_pool() == {"a": [(1, 1, 3)]}  # b is no longer published: its slices go
    assert pub.reconcile() is False


def test_a_wiped_pool_is_published_again_with_a_higher_generation(
    publishers: Publishers, kube: RawApi, node_name: str
) -> None:
    pub = publishers.new(Pool(plain(3)), node_name)
    pub.start()
    wait_for(lambda: len(node_slices(kube, node_name)) == 1, 10, "the pool")
    delete_node_slices(kube, node_name)  # the kubelet wipes the node's slices
    back = wait_for(lambda: node_slices(kube, node_name), 10, "the pool to be published again")
    assert back[0]["spec"]["pool"]["generation"] == 2
    assert len(back[0]["spec"]["devices"]) == 3


def test_the_node_owns_its_pool_and_takes_it_along_when_deleted(
    publishers: Publishers, kube: RawApi, node_name: str
) -> None:
    def owner() -> Obj | None:
        node = read_node(publishers.raw, node_name)
        return node_owner(node) if node is not None else None

    def owners() -> list[list[Obj]]:
        return [s["metadata"].get("ownerReferences") or [] for s in node_slices(kube, node_name)]

    nodes = resource_path("v1", "nodes")
    pub = publishers.new(Pool(plain(200)), node_name, owner)
    assert pub.reconcile() is True
    assert owners() == [[], []]  # no Node yet: published without an owner
    assert pub.reconcile() is False
    node = kube.create(nodes, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node_name}})
    try:
        assert pub.reconcile() is True  # the Node is there now: it becomes the owner
        ref = {
            "apiVersion": "v1",
            "kind": "Node",
            "name": node_name,
            "uid": node["metadata"]["uid"],
            "controller": True,
        }
        assert owners() == [[ref], [ref]]
        generation = node_slices(kube, node_name)[0]["spec"]["pool"]["generation"]
        assert pub.reconcile() is False
    finally:
        kube.delete(resource_path("v1", "nodes", name=node_name))
    assert generation == 2
    # the garbage collector (kube-controller-manager) deletes the pool with its Node
    wait_for(lambda: not node_slices(kube, node_name), 20, "the slices collected with the Node")


def test_a_slice_edited_by_someone_else_is_rewritten(
    publishers: Publishers, kube: RawApi, node_name: str
) -> None:
    pub = publishers.new(Pool(plain(3)), node_name)
    pub.start()
    [s] = wait_for(lambda: node_slices(kube, node_name), 10, "the pool")
    s["spec"]["devices"] = []
    kube.replace(resource_path(RESOURCE, "resourceslices", name=s["metadata"]["name"]), s)
    fixed = wait_for(
        lambda: [
            x for x in node_slices(kube, node_name) if len(x["spec"].get("devices") or []) == 3
        ],
        10,
        "the slice to be rewritten",
    )
    assert fixed[0]["spec"]["pool"]["generation"] == 2


class OlderServer(RawApi):
    """The sandbox's API server, except that its resource.k8s.io discovery answer leaves out
    the versions newer than ``newest`` (as a server without them would): the version
    detection then runs on a real answer; every read and write goes to the real server."""

    def __init__(self, raw: RawApi, newest: str) -> None:
        super().__init__(raw.api_client, deadline=raw.deadline)
        order = ["v1beta1", "v1beta2", "v1"]
        self.hidden = set(order[order.index(newest) + 1 :])

    def get(self, path: str) -> Obj:
        answer = super().get(path)
        if path == "/apis/resource.k8s.io":
            versions = answer["versions"]
            answer["versions"] = [v for v in versions if v["version"] not in self.hidden]
            answer["preferredVersion"] = answer["versions"][0]
        return answer


@pytest.mark.parametrize("version", ["v1beta2", "v1beta1"])
def test_falls_back_to_an_older_version_when_the_server_lacks_v1(
    sandbox: ControlPlane, kube: RawApi, short_dir: Path, version: str
) -> None:
    node = unique("old")
    config = write_node(short_dir, [{"model": "L4", "count": 2}], node)
    with open_nvml("fake", config) as nvml:
        harness = Harness(short_dir, sandbox.kubeconfig, nvml, node_name=node)
        try:
            running = harness.start(raw=OlderServer(harness.raw(), version))
            assert running.app.helper.api.server.group_version == f"resource.k8s.io/{version}"
            group_version = f"resource.k8s.io/{version}"
            slices = wait_for(
                lambda: node_slices(kube, node, group_version=group_version), 10, "the slices"
            )
            devices = slices[0]["spec"]["devices"]
            assert [d["name"] for d in devices] == ["gpu-0", "gpu-1"]
            fields: dict[str, Any] = devices[0]["basic"] if version == "v1beta1" else devices[0]
            assert fields["attributes"]["productName"] == {"string": "NVIDIA L4"}
            assert fields["allowMultipleAllocations"] is True
            # written through the older version only (the server records it per manager) ...
            managers = {
                (m["manager"], m["apiVersion"])
                for s in slices
                for m in s["metadata"]["managedFields"]
            }
            assert {api for _, api in managers} == {group_version}, managers
            # ... and it means the same as v1: the server converts it losslessly
            [v1] = node_slices(kube, node)
            gpu0 = v1["spec"]["devices"][0]
            assert gpu0["allowMultipleAllocations"] is True
            assert gpu0["capacity"]["cores"]["requestPolicy"]["validRange"]["max"] == "100"
        finally:
            harness.stop_all()
            delete_node_slices(kube, node)


def test_the_plugin_republishes_when_health_changes(
    plugin: Running, kube: RawApi, fake_node: Node, node_name: str
) -> None:
    wait_for(lambda: node_slices(kube, node_name), 10, "the slices")
    fake_node.control.inject_xid(0, 79)
    tainted = wait_for(
        lambda: [
            d
            for s in node_slices(kube, node_name)
            for d in s["spec"]["devices"]
            if d.get("taints") and d["name"] == "gpu-0"
        ],
        10,
        "gpu-0 to be tainted",
    )
    taint = tainted[0]["taints"][0]
    assert taint["key"] == "gpu.gpuslice.dev/xid"
    assert taint["value"] == "79"
    assert taint["effect"] == "NoSchedule"
    assert taint["timeAdded"].endswith("Z")
