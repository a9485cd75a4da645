"""The node DaemonSet pod on the real control plane: the real kubelet plugin, enforcer and MIG
manager processes of one sandbox GPU node (e2e/sandbox/nodeservices.py) talking over their
unix sockets, as the three containers of the node pod do, with pods allocated by the real
scheduler and started by the node agent (each container in cgroups of its own, the enforcer's
CDI hook run as runc runs it)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    DRIVER,
    RESOURCE,
    allocated_devices,
    claim_template,
    gpu_pod,
    pod_devices,
)
from e2e.sandbox.nodeagent.testing import (
    condition,
    events_for,
    get_pod,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
)
from e2e.sandbox.nodeservices import (
    NodePod,
    NodeServices,
    serve_node_pod,
    start_gpu_node_for,
    start_node_pod,
)
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml import open_nvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as epb
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as mpb
from gpuslice_testkit.core import http_probe

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(90)

GIB = 1024**3
# driver 615: memory partitioning by cgroup (hard memory, set by the CDI hook on the container's
# own cgroup v2 directory); MPS off: SM limits only by the watchdog, so the GPUs are soft and a
# strict hard share is refused
SHARED_NODE = [{"model": "L4", "count": 2}]
SHARED_NVML = {"driverVersion": "615.20"}
MIG_NODE = [{"model": "A100-SXM4-40GB", "migEnabled": True}]


@pytest.fixture
def shared_pod(
    sandbox: ControlPlane, kube: RawApi, device_classes: list[str], request: pytest.FixtureRequest
) -> Iterator[NodePod]:
    pod = start_node_pod(
        sandbox, SHARED_NODE, enforcer=True, enforcer_args=("--mps=off",), nvml=SHARED_NVML
    )
    yield from serve_node_pod(pod, kube, lambda: request.session.testsfailed)


@pytest.fixture
def mig_pod(
    sandbox: ControlPlane, kube: RawApi, device_classes: list[str], request: pytest.FixtureRequest
) -> Iterator[NodePod]:
    pod = start_node_pod(sandbox, MIG_NODE, enforcer=True, mig_manager=True, dynamic_mig=True)
    yield from serve_node_pod(pod, kube, lambda: request.session.testsfailed)


def create(kube: RawApi, namespace: str, plural: str, obj: Obj, gv: str = "v1") -> Obj:
    return kube.create(resource_path(gv, plural, namespace=namespace), obj)


def delete_pod(kube: RawApi, namespace: str, name: str) -> None:
    kube.delete(resource_path("v1", "pods", namespace=namespace, name=name))


def claim_uid(kube: RawApi, namespace: str, pod: Obj) -> str:
    name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = kube.get(resource_path(RESOURCE, "resourceclaims", namespace=namespace, name=name))
    return str(claim["metadata"]["uid"])


def usage(pod: NodePod) -> dict[str, epb.ShareUsage]:
    with pod.services.enforcer() as stub:
        reply = stub.GetUsage(epb.GetUsageRequest(), timeout=10)
    return {s.claim_uid: s for s in reply.shares}


def test_shares_are_enforced_by_the_real_enforcer(
    shared_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    node = shared_pod.node
    assert node.agent is not None
    with shared_pod.services.enforcer() as stub:
        caps = stub.GetCapabilities(epb.GetCapabilitiesRequest(), timeout=10)
    levels = {g.uuid: epb.EnforcementLevel.Name(g.level) for g in caps.gpus}
    assert set(levels.values()) == {"ENFORCEMENT_LEVEL_SOFT"}, levels

    def published() -> dict[str, Obj] | None:
        devices = node.devices(kube)
        found = {
            d["attributes"]["uuid"]["string"]: d["attributes"].get("enforcement")
            for d in devices.values()
        }
        return devices if found and all(v == {"string": "soft"} for v in found.values()) else None

    devices = wait_for(published, 20, "slices with the enforcer's enforcement attribute")
    assert sorted(devices) == ["gpu-0", "gpu-1"]
    for device in devices.values():  # the mechanisms the enforcer reported, for CEL selectors
        assert device["attributes"]["memoryEnforcement"] == {"string": "memory-partition"}
        assert device["attributes"]["coresEnforcement"] == {"string": "watchdog"}
    assert {d["attributes"]["uuid"]["string"] for d in devices.values()} == set(levels)

    on_gpu0 = 'device.attributes["gpu.gpuslice.dev"].index == 0'
    for name, cores in (("s30", "30"), ("s50", "50")):
        create(
            kube,
            namespace,
            "resourceclaimtemplates",
            claim_template(
                namespace, name, "gpu.gpuslice.dev", cores=cores, memory="8Gi", selector=on_gpu0
            ),
            RESOURCE,
        )
        create(kube, namespace, "pods", gpu_pod(namespace, name, node.name, template=name))
    pods = {n: wait_pod_phase(kube, namespace, n, "Running", timeout=30) for n in ("s30", "s50")}
    uids = {n: claim_uid(kube, namespace, p) for n, p in pods.items()}
    shares = usage(shared_pod)
    assert set(shares) == set(uids.values())
    for name, percent in (("s30", 30), ("s50", 50)):
        assert allocated_devices(kube, namespace, pods[name]) == ["gpu-0"]
        [got] = pod_devices(node, pods[name])
        share = shares[uids[name]]
        # the plugin's limits and what the enforcer granted, in the device's own variables
        assert (got["CORES"], got["MEMORY"]) == (str(percent), str(8 * GIB))
        assert got["CLAIM_UID"] == uids[name]
        assert got["SHARE_ID"] == share.share_id
        assert got["ENFORCEMENT"] == "soft"
        assert got["MEMORY_MECHANISM"] == "memory-partition"
        assert got["CORES_MECHANISM"] == "watchdog"
        assert [d.memory_limit_bytes for d in share.devices] == [8 * GIB]
        # the createContainer hook attached the container: its own cgroup v2 directory holds
        # the memory partition
        container = node.agent.runtime.adopt(pods[name]["metadata"]["uid"], "main")
        assert container is not None and container.cgroups
        v2 = [p for p in container.cgroups if (p / "cgroup.controllers").exists()]
        if v2:
            with open_nvml("fake", node.nvml_config) as nvml:
                assert nvml.memory_limits(0, str(v2[0])).hard_limit == 8 * GIB

    gone_cgroups = node.agent.runtime.adopt(pods["s30"]["metadata"]["uid"], "main")
    assert gone_cgroups is not None
    delete_pod(kube, namespace, "s30")
    wait_pod_gone(kube, namespace, "s30")
    wait_for(
        lambda: set(usage(shared_pod)) == {uids["s50"]}, 15, "the deleted pod's share released"
    )
    wait_for(lambda: not any(p.exists() for p in gone_cgroups.cgroups), 10, "its cgroups removed")


def test_strict_hard_share_on_a_soft_gpu_is_refused_at_prepare(
    shared_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    node = shared_pod.node
    template = claim_template(namespace, "strict", "gpu.gpuslice.dev", cores="20", memory="1Gi")
    template["spec"]["spec"]["devices"]["config"] = [
        {
            "opaque": {
                "driver": DRIVER,
                "parameters": {
                    "apiVersion": "gpu.gpuslice.dev/v1alpha1",
                    "kind": "GpuConfig",
                    "enforcement": {"mode": "Hard", "strict": True},
                },
            }
        }
    ]
    create(kube, namespace, "resourceclaimtemplates", template, RESOURCE)
    create(kube, namespace, "pods", gpu_pod(namespace, "strict", node.name, template="strict"))

    def refused() -> Obj | None:
        # (an earlier one may say the Node authorizer did not know the claim yet: retried)
        found = events_for(kube, namespace, "strict", "FailedPrepareDynamicResources")
        return next((e for e in found if "NodePrepareResources" in e["message"]), None)

    event = wait_for(refused, 30, "the FailedPrepareDynamicResources event")
    message = event["message"]
    assert "NodePrepareResources failed for ResourceClaim" in message
    assert "enforcer CreateShare" in message and "FAILED_PRECONDITION" in message
    assert "strict hard enforcement is not available" in message

    def creating() -> Obj | None:  # the status patch may trail the Event
        pod = get_pod(kube, namespace, "strict")
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
        waiting = [s["state"].get("waiting", {}).get("reason") for s in statuses]
        return pod if waiting == ["ContainerCreating"] else None

    pod = wait_for(creating, 10, "the pod's container waiting in ContainerCreating")
    assert pod["status"]["phase"] == "Pending"
    assert usage(shared_pod) == {}


def test_an_enforcer_that_starts_after_the_plugin_is_picked_up(
    sandbox: ControlPlane, kube: RawApi, request: pytest.FixtureRequest
) -> None:
    """The node pod's containers start in any order: slices gain the enforcement attribute as
    soon as the enforcer answers, not a whole --rescan-interval (60 s) later."""
    services = NodeServices.start(sandbox, SHARED_NODE, enforcer=False, nvml=SHARED_NVML)
    try:
        node = start_gpu_node_for(
            sandbox, services, ("--enforcer-socket", str(services.enforcer_socket))
        )
    except BaseException:
        services.stop()
        raise
    for _ in serve_node_pod(NodePod(node, services), kube, lambda: request.session.testsfailed):
        devices = wait_for(lambda: node.devices(kube) or None, 20, "the node's slices")
        assert all("enforcement" not in d["attributes"] for d in devices.values())
        services.enforcer_args = ["--mps=off"]
        services.start_enforcer()
        wait_for(
            lambda: all(
                d["attributes"].get("enforcement") == {"string": "soft"}
                for d in node.devices(kube).values()
            ),
            10,
            "the enforcement attribute once the enforcer runs",
        )


def _mig_instances(pod: NodePod) -> list[mpb.MigInstance]:
    with pod.services.mig_manager() as stub:
        reply = stub.ListGpus(mpb.ListGpusRequest(), timeout=10)
    return [i for g in reply.gpus for i in g.instances]


def test_dynamic_mig_instances_come_from_the_real_mig_manager(
    mig_pod: NodePod, kube: RawApi, namespace: str
) -> None:
    node = mig_pod.node
    assert _mig_instances(mig_pod) == []
    wait_for(lambda: len(node.devices(kube)) > 10, 20, "the MIG placements published")
    for name, profile in (("big", "3g.20gb"), ("mid", "2g.10gb"), ("over", "3g.20gb")):
        selector = f'device.attributes["gpu.gpuslice.dev"].profile == "{profile}"'
        create(
            kube,
            namespace,
            "resourceclaimtemplates",
            claim_template(namespace, name, "mig.gpuslice.dev", selector=selector),
            RESOURCE,
        )
    pods: dict[str, Obj] = {}
    for name in ("big", "mid"):
        create(kube, namespace, "pods", gpu_pod(namespace, name, node.name, template=name))
        pods[name] = wait_pod_phase(kube, namespace, name, "Running", timeout=30)
    instances = {i.profile_name: i for i in _mig_instances(mig_pod)}
    assert sorted(instances) == ["2g.10gb", "3g.20gb"]
    for name, profile in (("big", "3g.20gb"), ("mid", "2g.10gb")):
        (device,) = allocated_devices(kube, namespace, pods[name])
        start = int(device.rsplit("-", 1)[1])
        assert device == f"gpu-0-mig-{profile.replace('.', '-')}-{start}"
        instance = instances[profile]
        assert instance.placement.start == start, (device, instance)
        assert instance.owner.endswith(claim_uid(kube, namespace, pods[name]))
        assert [d["UUID"] for d in pod_devices(node, pods[name])] == [instance.mig_uuid]

    # 3 + 2 compute slices and the memory slices they hold: a second 3g.20gb cannot fit
    create(kube, namespace, "pods", gpu_pod(namespace, "over", node.name, template="over"))

    def unschedulable() -> Obj | None:
        pod = get_pod(kube, namespace, "over")
        cond = condition(pod, "PodScheduled") if pod else None
        return cond if cond and cond["status"] == "False" else None

    assert "cannot allocate all claims" in wait_for(unschedulable, 30, "Unschedulable")["message"]
    assert len(_mig_instances(mig_pod)) == 2

    for name in ("over", "big", "mid"):
        delete_pod(kube, namespace, name)
    for name in ("over", "big", "mid"):
        wait_pod_gone(kube, namespace, name)
    wait_for(lambda: _mig_instances(mig_pod) == [], 15, "the instances destroyed")


def test_the_sidecars_answer_the_charts_http_probes(mig_pod: NodePod) -> None:
    """The enforcer and the MIG manager serve /healthz and /readyz as the chart probes them
    (httpGet, no interpreter started): 200 while they serve; a stopped MIG manager answers
    503 or nothing, and the enforcer next to it stays ready."""
    ports = mig_pod.services.health_ports
    for service in ("enforcer", "mig-manager"):
        assert http_probe(ports[service], "/readyz") == 200, service
        assert http_probe(ports[service], "/healthz") == 200, service
    mig_pod.services.running["mig-manager"].signal_group(signal.SIGTERM)
    wait_for(
        lambda: http_probe(ports["mig-manager"], "/readyz") in (503, None),
        10,
        "the stopping MIG manager to leave readiness",
    )
    wait_for(
        lambda: not mig_pod.services.running["mig-manager"].alive(), 15, "the MIG manager gone"
    )
    assert http_probe(ports["mig-manager"], "/readyz") is None
    assert http_probe(ports["enforcer"], "/readyz") == 200
