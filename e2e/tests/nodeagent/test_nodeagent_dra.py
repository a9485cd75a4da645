"""The node agent against the real control plane with a stand-in DRA plugin: the real
scheduler allocates from a hand-written ResourceSlice, the agent prepares over gRPC, runs the
container with the CDI edits, and unprepares when the pod goes away."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from functools import partial

import pytest

from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import (
    condition,
    events_for,
    get_pod,
    wait_event,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
)
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
from gpuslice_core.cdi import Hook
from gpuslice_kube.raw import Obj, RawApi, resource_path

# kube, namespace, node_agent(s): until e2e/conftest.py imports them
pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)

NodeFactory = Callable[..., NodeAgent]


# ---- objects ------------------------------------------------------------------------------------
def node_slices(kube: RawApi, node: str) -> list[Obj]:
    items: list[Obj] = kube.list(
        resource_path(RESOURCE, "resourceslices"), field_selector=f"spec.nodeName={node}"
    )["items"]
    return items


def pod_log(agent: NodeAgent, pod: Obj, container: str = "main") -> str:
    return agent.pod_log(pod["metadata"]["uid"], container)


# ---- tests --------------------------------------------------------------------------------------
def test_pod_with_claim_template_runs_with_cdi_env_and_is_unprepared_on_delete(
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    standin: StandinDraPlugin,
    device_class: str,
) -> None:
    node = node_agent.name
    create_slice(kube, node, [shareable_gpu()])
    create(
        kube,
        namespace,
        "resourceclaimtemplates",
        claim_template(namespace, "one", device_class, "30"),
        RESOURCE,
    )
    create(kube, namespace, "pods", gpu_pod(namespace, "p1", node, "one"))

    pod = wait_pod_phase(kube, namespace, "p1", "Running", timeout=30)
    assert pod["spec"]["nodeName"] == node
    assert standin.calls.versions[0] == "v1.DRAPlugin"
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    assert standin.calls.prepare == [[claim_name]]
    text = wait_for(lambda: pod_log(node_agent, pod), 10, "the container's output")
    assert "GPU_DEVICE=gpu-0 GPU_CORES=30" in text
    ready = condition(pod, "PodReadyToStartContainers")
    assert ready is not None and ready["status"] == "True"
    status = pod["status"]["containerStatuses"][0]
    assert "running" in status["state"] and status["ready"] is True
    claim_uid = kube.get(
        resource_path(RESOURCE, "resourceclaims", namespace=namespace, name=claim_name)
    )["metadata"]["uid"]
    assert node_agent.config.cdi_dir.joinpath(f"k8s.{DRIVER}-claim_{claim_uid}.json").exists()

    delete_pod(kube, namespace, "p1")
    wait_pod_gone(kube, namespace, "p1")
    assert standin.calls.unprepare == [[claim_name]]
    assert not list(node_agent.config.cdi_dir.glob(f"*{claim_uid}*"))
    reasons = [e["reason"] for e in events_for(kube, namespace, "p1")]
    assert {"Created", "Started", "Killing"} <= set(reasons)


def test_two_pods_share_one_device_and_a_third_stays_pending(
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    standin: StandinDraPlugin,
    device_class: str,
) -> None:
    node = node_agent.name
    create_slice(kube, node, [shareable_gpu()])
    for name, cores in (("c30", "30"), ("c50", "50"), ("c40", "40")):
        create(
            kube,
            namespace,
            "resourceclaimtemplates",
            claim_template(namespace, name, device_class, cores),
            RESOURCE,
        )
    create(kube, namespace, "pods", gpu_pod(namespace, "p30", node, "c30"))
    create(kube, namespace, "pods", gpu_pod(namespace, "p50", node, "c50"))
    p30 = wait_pod_phase(kube, namespace, "p30", "Running", timeout=30)
    p50 = wait_pod_phase(kube, namespace, "p50", "Running", timeout=30)
    assert "GPU_DEVICE=gpu-0 GPU_CORES=30" in wait_for(
        lambda: pod_log(node_agent, p30), 10, "p30 log"
    )
    assert "GPU_DEVICE=gpu-0 GPU_CORES=50" in wait_for(
        lambda: pod_log(node_agent, p50), 10, "p50 log"
    )

    create(kube, namespace, "pods", gpu_pod(namespace, "p40", node, "c40"))

    def unschedulable() -> Obj | None:
        pod = get_pod(kube, namespace, "p40")
        cond = condition(pod, "PodScheduled") if pod else None
        return cond if cond and cond["status"] == "False" else None

    cond = wait_for(unschedulable, 30, "p40's PodScheduled=False")
    assert cond["reason"] == "Unschedulable"
    assert "cannot allocate all claims" in cond["message"], cond["message"]
    p40 = get_pod(kube, namespace, "p40")
    assert p40 is not None and p40["status"]["phase"] == "Pending"
    assert len(standin.calls.prepare) == 2

    # freeing 50 cores lets the third pod in
    delete_pod(kube, namespace, "p50")
    wait_pod_phase(kube, namespace, "p40", "Running", timeout=30)


def test_prepare_error_keeps_pod_pending_with_event_then_retries(
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    standin: StandinDraPlugin,
    device_class: str,
) -> None:
    node = node_agent.name
    standin.fail_prepare = lambda claim: "GPU is on fire"
    create_slice(kube, node, [shareable_gpu()])
    create(
        kube,
        namespace,
        "resourceclaimtemplates",
        claim_template(namespace, "t", device_class, "10"),
        RESOURCE,
    )
    create(kube, namespace, "pods", gpu_pod(namespace, "p", node, "t"))

    # (an earlier attempt may fail otherwise, e.g. Forbidden while the Node authorizer's graph
    # does not know the pod's claim yet: wait for the plugin's error)
    def plugin_error_event() -> Obj | None:
        events = events_for(kube, namespace, "p", "FailedPrepareDynamicResources")
        return next((e for e in events if "GPU is on fire" in e["message"]), None)

    event = wait_for(plugin_error_event, 20, "a FailedPrepareDynamicResources event")
    assert event["type"] == "Warning"
    assert event["message"].startswith(
        "Failed to prepare dynamic resources: prepare dynamic resources: "
    )
    assert "GPU is on fire" in event["message"]
    assert event["source"] == {"component": "kubelet", "host": node}

    def pending_status() -> Obj | None:
        pod = get_pod(kube, namespace, "p")
        return pod if pod and (pod.get("status") or {}).get("containerStatuses") else None

    pod = wait_for(pending_status, 10, "the pod's pending status")
    assert pod["status"]["phase"] == "Pending"
    waiting = pod["status"]["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == "ContainerCreating"
    ready = condition(pod, "PodReadyToStartContainers")
    assert ready is not None and ready["status"] == "False"
    scheduled = condition(pod, "PodScheduled")
    assert scheduled is not None and scheduled["status"] == "True"  # not owned by the kubelet
    wait_for(lambda: len(standin.calls.prepare) >= 2, 10, "a retried NodePrepareResources")

    standin.fail_prepare = None
    wait_pod_phase(kube, namespace, "p", "Running", timeout=20)


def test_agent_restart_does_not_prepare_running_pods_again(
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    standin: StandinDraPlugin,
    device_class: str,
) -> None:
    node = node_agent.name
    create_slice(kube, node, [shareable_gpu()])
    create(
        kube,
        namespace,
        "resourceclaimtemplates",
        claim_template(namespace, "t", device_class, "10"),
        RESOURCE,
    )
    create(kube, namespace, "pods", gpu_pod(namespace, "p", node, "t"))
    pod = wait_pod_phase(kube, namespace, "p", "Running", timeout=30)
    assert len(standin.calls.prepare) == 1
    started = pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]

    node_agent.stop(kill_containers=False)
    node_agent.start()
    # the restarted agent wipes the node's slices; the plugin re-publishes in real life
    create_slice(kube, node, [shareable_gpu()])
    wait_for(lambda: DRIVER in node_agent.registered_drivers(), 10, "re-registration")
    pod = wait_pod_phase(kube, namespace, "p", "Running")
    assert pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] == started
    assert len(standin.calls.prepare) == 1

    delete_pod(kube, namespace, "p")
    wait_pod_gone(kube, namespace, "p")
    assert len(standin.calls.unprepare) == 1


def test_a_stopped_agent_leaves_no_thread_that_could_still_log(
    kube: RawApi, node_agents: NodeFactory
) -> None:
    """When stop() returns, none of the agent's threads runs any more, so none can log into a
    stream its owner closes next (the demo's log file, a test's captured output)."""
    before = set(threading.enumerate())
    agent = node_agents()
    plugin = StandinDraPlugin.for_agent(agent, kube).start()
    try:
        wait_for(lambda: DRIVER in agent.registered_drivers(), 10, "registration")
    finally:
        plugin.stop()  # its socket goes: the plugin watcher deregisters it, and says so
    agent.stop()
    prefixes = (f"{agent.name}-", "pod-", "reflector/")
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith(prefixes)]
    assert left == []


def test_node_slices_are_wiped_at_start_and_after_the_driver_goes_away(
    kube: RawApi, node_agents: NodeFactory
) -> None:
    agent = node_agents()
    node = agent.name
    plugin = StandinDraPlugin.for_agent(agent, kube).start()
    try:
        wait_for(plugin.registered.is_set, 10, "registration")
        create_slice(kube, node, [shareable_gpu()])
        assert len(node_slices(kube, node)) == 1

        # the agent restarts: every slice of its node is deleted at start
        agent.stop()
        agent.start()
        assert node_slices(kube, node) == []

        wait_for(lambda: DRIVER in agent.registered_drivers(), 10, "re-registration")
        create_slice(kube, node, [shareable_gpu()])
        # the plugin goes away: after the wipe delay (2 s in tests) its slices are deleted
        plugin.stop()
        wait_for(lambda: DRIVER not in agent.registered_drivers(), 10, "deregistration")
        assert len(node_slices(kube, node)) == 1
        wait_for(lambda: node_slices(kube, node) == [], 10, "the driver's slices to be wiped")
    finally:
        plugin.stop()


def test_registration_picks_v1beta1_when_the_plugin_lists_it_first(
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    device_class: str,
) -> None:
    plugin = StandinDraPlugin.for_agent(
        node_agent, kube, supported_versions=("v1beta1.DRAPlugin", "v1.DRAPlugin")
    ).start()
    try:
        wait_for(plugin.registered.is_set, 10, "registration")
        node = node_agent.name
        create_slice(kube, node, [shareable_gpu()])
        create(
            kube,
            namespace,
            "resourceclaimtemplates",
            claim_template(namespace, "t", device_class, None),
            RESOURCE,
        )
        create(
            kube,
            namespace,
            "pods",
            gpu_pod(namespace, "p", node, "t", "echo $GPU_DEVICE; sleep 60"),
        )
        pod = wait_pod_phase(kube, namespace, "p", "Running", timeout=30)
        assert plugin.calls.versions == ["v1beta1.DRAPlugin"]
        assert "gpu-0" in wait_for(lambda: pod_log(node_agent, pod), 10, "the log")
    finally:
        plugin.stop()


def test_cdi_hooks_run_and_a_missing_cdi_spec_fails_the_container(
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    device_class: str,
) -> None:
    node = node_agent.name
    state_file = node_agent.config.root / "hook-state.json"
    hook = Hook(
        hook_name="createContainer", path="/bin/sh", args=["sh", "-c", f"cat > {state_file}"]
    )
    plugin = StandinDraPlugin.for_agent(node_agent, kube, hooks=[hook]).start()
    try:
        wait_for(plugin.registered.is_set, 10, "registration")
        create_slice(kube, node, [shareable_gpu()])
        create(
            kube,
            namespace,
            "resourceclaimtemplates",
            claim_template(namespace, "t", device_class, "10"),
            RESOURCE,
        )
        create(kube, namespace, "pods", gpu_pod(namespace, "hooked", node, "t"))
        pod = wait_pod_phase(kube, namespace, "hooked", "Running", timeout=30)
        state = json.loads(state_file.read_text())
        assert state["status"] == "created" and state["ociVersion"]
        assert pod["status"]["containerStatuses"][0]["containerID"].endswith(state["id"])

        plugin.write_specs = False  # the plugin "forgets" the spec: the runtime cannot resolve
        create(kube, namespace, "pods", gpu_pod(namespace, "broken", node, "t"))

        def create_error() -> Obj | None:
            p = get_pod(kube, namespace, "broken")
            statuses = ((p or {}).get("status") or {}).get("containerStatuses") or [{}]
            waiting = statuses[0].get("state", {}).get("waiting") or {}
            return p if waiting.get("reason") == "CreateContainerError" else None

        broken = wait_for(create_error, 30, "CreateContainerError on the broken pod")
        waiting = broken["status"]["containerStatuses"][0]["state"]["waiting"]
        assert "unresolvable CDI devices" in waiting["message"]
        assert broken["status"]["phase"] == "Pending"
        event = wait_event(kube, namespace, "broken", "Failed")
        assert event["type"] == "Warning" and "unresolvable CDI devices" in event["message"]

        delete_pod(kube, namespace, "broken")
        wait_pod_gone(kube, namespace, "broken")
        assert len(plugin.calls.unprepare) == 1  # prepared, never started: still unprepared
    finally:
        plugin.stop()


def test_a_shared_claim_is_prepared_once_and_unprepared_after_its_last_pod(
    kube: RawApi,
    namespace: str,
    node_agent: NodeAgent,
    standin: StandinDraPlugin,
    device_class: str,
) -> None:
    node = node_agent.name
    create_slice(kube, node, [shareable_gpu()])
    claim = claim_template(namespace, "shared", device_class, "20")["spec"]
    create(
        kube,
        namespace,
        "resourceclaims",
        {"apiVersion": RESOURCE, "kind": "ResourceClaim", "metadata": {"name": "shared"}, **claim},
        RESOURCE,
    )
    for name in ("a", "b"):
        obj = gpu_pod(namespace, name, node, "unused")
        obj["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared"}]
        create(kube, namespace, "pods", obj)
    a = wait_pod_phase(kube, namespace, "a", "Running", timeout=30)
    b = wait_pod_phase(kube, namespace, "b", "Running", timeout=30)
    assert standin.calls.prepare == [["shared"]]
    for p in (a, b):
        text = wait_for(partial(pod_log, node_agent, p), 10, "the log")
        assert "GPU_CORES=20" in text

    delete_pod(kube, namespace, "a")
    wait_pod_gone(kube, namespace, "a")
    assert standin.calls.unprepare == []  # b still uses the claim

    # a force delete (grace 0 from the client): the pod object is gone at once, the agent
    # still stops the container and unprepares the claim
    kube._call(
        "DELETE",
        resource_path("v1", "pods", namespace=namespace, name="b"),
        body={"gracePeriodSeconds": 0},
    )
    wait_for(lambda: standin.calls.unprepare == [["shared"]], 10, "the unprepare of the claim")
