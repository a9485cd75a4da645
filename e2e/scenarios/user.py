"""The end-to-end scenarios that matter to users, written once for every real cluster tier.

Each scenario takes a ``Cluster`` running the gpuslice chart on nodes with the fake GPUs of
``e2e.scenarios.nodes``, works in a namespace of its own and leaves every device free again.
``SCENARIOS`` lists them in the order the tiers run them;
e2e/tests/realnode/test_realnode_scenarios.py (real kubelets here) and
e2e/kind/test_kind_scenarios.py (kind, users' CI) parametrize over it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from e2e.sandbox.nodeagent.testing import wait_for
from e2e.scenarios.cluster import (
    DRIVER,
    GPU_CLASS,
    MIG_CLASS,
    RESOURCE,
    Cluster,
    attribute,
    request,
    sample,
)
from e2e.scenarios.examples import examples_run_as_documented
from e2e.scenarios.nodes import MIG_GPU, SHARE_GPU, SHARED_CLAIM_GPU, WHOLE_GPU, gpu_count
from gpuslice_kube.errors import KubeError
from gpuslice_kube.raw import Obj, resource_path

GIB = 1024**3
ENFORCER_METRICS_PORT = 9402
KUBELET_PLUGIN_METRICS_PORT = 9400


def _allocated(cluster: Cluster, pod: Obj, pod_claim: str = "gpu") -> list[str]:
    claim = cluster.pod_claim(pod, pod_claim)
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]


def exclusive_gpu(cluster: Cluster) -> None:
    """A whole GPU: the pod runs with that GPU's UUID and nothing shares it."""
    node = cluster.gpu_nodes[0]
    with cluster.namespace("exclusive") as ns:
        cluster.template(ns, "whole", request("gpu", selector=attribute("index", WHOLE_GPU)))
        cluster.pod(ns, "whole", node, templates={"gpu": "whole"})
        pod = cluster.running(ns, "whole")
        [device] = cluster.devices(ns, "whole")
        assert _allocated(cluster, pod) == [f"gpu-{WHOLE_GPU}"]
        assert device["DEVICE"] == f"gpu-{WHOLE_GPU}" and device["UUID"].startswith("GPU-")
        assert (device["ENFORCEMENT"], device["CORES"]) == ("exclusive", "100")
        if cluster.driver_files:  # its GPU's device node and the control nodes, no other GPU's
            nodes = cluster.device_nodes(ns, "whole")
            gpus = [n for n in nodes if re.fullmatch(r"/dev/nvidia[0-9]+", n)]
            assert gpus == [f"/dev/nvidia{WHOLE_GPU}"] and "/dev/nvidiactl" in nodes, nodes
            # NVIDIA's own hook, where installed, must add nothing: the CDI spec decides
            assert cluster.env(ns, "whole")["NVIDIA_VISIBLE_DEVICES"] == "void"
        # the claim holds all of the GPU: a second claim for it waits
        cluster.template(ns, "again", request("gpu", selector=attribute("index", WHOLE_GPU)))
        cluster.pod(ns, "again", node, templates={"gpu": "again"})
        message = cluster.unschedulable(ns, "again")
        assert "cannot allocate all claims" in message, message


def two_shares_and_one_that_does_not_fit(cluster: Cluster) -> None:
    """30 + 50 cores share one GPU, each container bound to its share by the enforcer's CDI
    hook with the claim's limits; a third 40-core share stays Pending with the reason."""
    node = cluster.gpu_nodes[0]
    on_gpu = attribute("index", SHARE_GPU)
    enforcer = cluster.node_pod(node)
    attached_before = sample(
        cluster.metrics(enforcer, ENFORCER_METRICS_PORT),
        "gpuslice_enforcer_attach_container_total",
        result="success",
    )
    with cluster.namespace("shares") as ns:
        for name, cores, quantity in (("s30", "30", "4Gi"), ("s50", "50", "8Gi")):
            cluster.template(
                ns, name, request("gpu", selector=on_gpu, cores=cores, memory=quantity)
            )
            cluster.pod(ns, name, node, templates={"gpu": name})
        pods = {name: cluster.running(ns, name) for name in ("s30", "s50")}
        got = {name: cluster.devices(ns, name) for name in pods}
        uuids = {d["UUID"] for devices in got.values() for d in devices}
        assert len(uuids) == 1, got  # one GPU, two shares
        for name, cores, limit in (("s30", "30", 4 * GIB), ("s50", "50", 8 * GIB)):
            [device] = got[name]
            assert (device["CORES"], device["MEMORY"]) == (cores, str(limit)), device
            assert device["ENFORCEMENT"] in ("hard", "soft"), device
            assert device["SHARE_ID"], device
            assert _allocated(cluster, pods[name]) == [f"gpu-{SHARE_GPU}"]

        # runc ran the enforcer's createContainer hook for both containers, and the enforcer
        # holds each share at its claim's limits
        text = cluster.metrics(enforcer, ENFORCER_METRICS_PORT)
        attached = sample(text, "gpuslice_enforcer_attach_container_total", result="success")
        assert attached - attached_before >= 2, text
        for name, expected in (("s30", 4 * GIB), ("s50", 8 * GIB)):
            uid = got[name][0]["CLAIM_UID"]
            held = sample(text, "gpuslice_enforcer_share_memory_limit_bytes", claim_uid=uid)
            assert held == expected, (name, uid, held)

        cluster.template(ns, "s40", request("gpu", selector=on_gpu, cores="40", memory="4Gi"))
        cluster.pod(ns, "s40", node, templates={"gpu": "s40"})
        message = cluster.unschedulable(ns, "s40")
        assert "cannot allocate all claims" in message, message


def static_mig_device(cluster: Cluster) -> None:
    """A MIG device of a GPU in MIG mode: the pod gets that instance's UUID."""
    node = cluster.gpu_nodes[-1]
    with cluster.namespace("mig") as ns:
        selector = f"{attribute('profile', '1g.5gb')} && {attribute('index', MIG_GPU)}"
        cluster.template(ns, "mig", request("mig", MIG_CLASS, selector=selector))
        cluster.pod(ns, "mig", node, templates={"gpu": "mig"})
        pod = cluster.running(ns, "mig")
        [device] = cluster.devices(ns, "mig")
        [allocated] = _allocated(cluster, pod)
        assert allocated.startswith(f"gpu-{MIG_GPU}-mig-1g-5gb-"), allocated
        assert device["UUID"].startswith("MIG-") and device["ENFORCEMENT"] == "mig", device
        if cluster.driver_files:  # the parent GPU's node and the MIG capability nodes
            nodes = cluster.device_nodes(ns, "mig")
            caps = [n for n in nodes if n.startswith("/dev/nvidia-caps/nvidia-cap")]
            assert f"/dev/nvidia{MIG_GPU}" in nodes and caps, nodes


def each_container_sees_its_requests(cluster: Cluster) -> None:
    """A container gets exactly the devices of the requests it names, through containerd's CDI
    injection: four MIG devices of one claim in four containers, one container naming two of
    them, and a whole GPU and a share of one claim in two containers (issue 19's shapes)."""
    node = cluster.gpu_nodes[-1]
    on_mig = attribute("index", MIG_GPU)
    profiles = {"a": "2g.10gb", "b": "1g.5gb", "c": "1g.5gb", "d": "3g.20gb"}
    with cluster.namespace("isolation") as ns:
        cluster.template(
            ns,
            "quad",
            *(
                request(r, MIG_CLASS, selector=f"{on_mig} && {attribute('profile', p)}")
                for r, p in profiles.items()
            ),
        )
        containers = {f"mig-{r}": [{"name": "quad", "request": r}] for r in profiles}
        containers["mig-ad"] = [{"name": "quad", "request": "a"}, {"name": "quad", "request": "d"}]
        cluster.pod(ns, "quad", node, templates={"quad": "quad"}, containers=containers)
        cluster.running(ns, "quad")
        seen: dict[str, list[dict[str, str]]] = {
            c: cluster.devices(ns, "quad", c) for c in containers
        }
        for r in profiles:
            [device] = seen[f"mig-{r}"]
            assert device["REQUEST"] == r and device["UUID"].startswith("MIG-"), (r, seen)
        uuids = {seen[f"mig-{r}"][0]["UUID"] for r in profiles}
        assert len(uuids) == 4, seen  # four different instances
        both = sorted(d["REQUEST"] for d in seen["mig-ad"])
        assert both == ["a", "d"], seen["mig-ad"]

        cluster.template(
            ns,
            "mixed",
            request("whole", selector=attribute("index", WHOLE_GPU)),
            request("share", selector=attribute("index", SHARE_GPU), cores="20", memory="2Gi"),
        )
        split = {c: [{"name": "mixed", "request": c}] for c in ("whole", "share")}
        cluster.pod(
            ns, "mixed", cluster.gpu_nodes[0], templates={"mixed": "mixed"}, containers=split
        )
        cluster.running(ns, "mixed")
        [whole] = cluster.devices(ns, "mixed", "whole")
        [share] = cluster.devices(ns, "mixed", "share")
        assert (whole["REQUEST"], whole["CORES"], whole["ENFORCEMENT"]) == (
            "whole",
            "100",
            "exclusive",
        ), whole
        assert (share["REQUEST"], share["CORES"]) == ("share", "20"), share
        assert share["ENFORCEMENT"] in ("hard", "soft") and share["SHARE_ID"], share


def legacy_extended_resource(cluster: Cluster) -> None:
    """A pod that writes ``nvidia.com/gpu: 1`` gets a whole GPU through DRA (the DeviceClass's
    extendedResourceName), with no ResourceClaim of its own."""
    node = cluster.gpu_nodes[0]
    with cluster.namespace("legacy") as ns:
        cluster.pod(ns, "legacy", node, limits={"nvidia.com/gpu": "1"})
        pod = cluster.running(ns, "legacy")
        [device] = cluster.devices(ns, "legacy")
        assert device["ENFORCEMENT"] == "exclusive" and device["CORES"] == "100", device
        extended = pod["status"].get("extendedResourceClaimStatus") or {}
        assert extended.get("resourceClaimName"), pod["status"]
        claim = cluster.get_claim(ns, extended["resourceClaimName"])
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] == device["DEVICE"], (result, device)


def dialect_pod_through_the_controller(cluster: Cluster) -> None:
    """The controller's webhooks, called by the API server at its Service: a pod written for
    HAMi (``nvidia.com/gpu`` + ``gpucores`` + ``gpumem``) is translated into a DRA pod that runs
    with those limits, and a claim with a bad GpuConfig is denied with the field named."""
    node = cluster.gpu_nodes[0]
    hami = {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30", "nvidia.com/gpumem": "4096"}
    with cluster.namespace("dialect") as ns:
        created = cluster.pod(ns, "hami", node, limits=hami)
        assert created["spec"].get("resourceClaims"), created["spec"]
        assert "limits" not in created["spec"]["containers"][0]["resources"], created["spec"]
        translated = created["metadata"]["annotations"]["gpu.gpuslice.dev/translated-from"]
        assert json.loads(translated)["dialect"] == "hami", translated
        pod = cluster.running(ns, "hami")
        [device] = cluster.devices(ns, "hami")
        assert (device["CORES"], device["MEMORY"]) == ("30", str(4 * GIB)), device
        assert device["ENFORCEMENT"] in ("hard", "soft") and device["SHARE_ID"], device
        [pod_claim] = pod["spec"]["resourceClaims"]
        assert cluster.pod_claim(pod, pod_claim["name"])["status"]["allocation"], pod_claim

        bad = {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": "bad"},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_CLASS}}],
                    "config": [
                        {
                            "opaque": {
                                "driver": DRIVER,
                                "parameters": {
                                    "apiVersion": "gpu.gpuslice.dev/v1alpha1",
                                    "kind": "GpuConfig",
                                    "limits": {"cores": 500},
                                },
                            }
                        }
                    ],
                }
            },
        }
        try:
            cluster.create(ns, "resourceclaims", bad, RESOURCE)
        except KubeError as exc:
            message = str(exc)
        else:
            raise AssertionError("a GpuConfig with limits.cores 500 was admitted")
        assert 'admission webhook "claims.gpu.gpuslice.dev" denied the request' in message, message
        assert "spec.devices.config[0].opaque.parameters" in message, message
        assert "limits.cores: 500" in message, message


def claim_shared_by_two_pods(cluster: Cluster) -> None:
    """One ResourceClaim, two pods: both run on the same GPU, prepared once."""
    node = cluster.gpu_nodes[0]
    with cluster.namespace("shared-claim") as ns:
        cluster.claim(ns, "team", request("gpu", selector=attribute("index", SHARED_CLAIM_GPU)))
        for name in ("p1", "p2"):
            cluster.pod(ns, name, node, claims={"gpu": "team"})
        for name in ("p1", "p2"):
            cluster.running(ns, name)
        [a], [b] = cluster.devices(ns, "p1"), cluster.devices(ns, "p2")
        assert a["UUID"] == b["UUID"] and a["CLAIM"] == b["CLAIM"] == f"{ns}/team", (a, b)
        reserved = cluster.get_claim(ns, "team")["status"]["reservedFor"]
        assert sorted(r["name"] for r in reserved) == ["p1", "p2"], reserved


def plugin_killed_while_pods_run(cluster: Cluster) -> None:
    """The kubelet plugin's container is killed: running pods keep their devices, the
    container restarts and registers again, and a new pod gets a GPU after that."""
    node = cluster.gpu_nodes[0]
    with cluster.namespace("plugin-kill") as ns:
        cluster.template(ns, "share", request("gpu", cores="20", memory="2Gi"))
        cluster.pod(ns, "before", node, templates={"gpu": "share"})
        cluster.running(ns, "before")
        [before] = cluster.devices(ns, "before")

        node_pod = cluster.node_pod(node)
        plugin = cluster.container_status(node_pod, "kubelet-plugin")
        cluster.ops.kill_container(node, plugin["containerID"])

        def restarted() -> Obj | None:
            status = cluster.container_status(cluster.node_pod(node), "kubelet-plugin")
            return (
                status
                if status["restartCount"] > plugin["restartCount"] and status.get("ready")
                else None
            )

        wait_for(restarted, 120, "the kubelet plugin container to restart and be ready")
        pod = cluster.get_pod(ns, "before")
        [main] = pod["status"]["containerStatuses"]
        assert pod["status"]["phase"] == "Running" and main["restartCount"] == 0, main
        assert cluster.devices(ns, "before") == [before]

        cluster.pod(ns, "after", node, templates={"gpu": "share"})
        cluster.running(ns, "after")
        [after] = cluster.devices(ns, "after")
        assert after["CORES"] == "20" and after["CLAIM_UID"] != before["CLAIM_UID"]


def kubelet_restarted(cluster: Cluster) -> None:
    """The kubelet restarts: prepared claims stay prepared (no second prepare of the claim by
    the plugin, the pod is not restarted) and new pods still get GPUs."""
    node = cluster.gpu_nodes[0]
    with cluster.namespace("kubelet-restart") as ns:
        cluster.template(ns, "share", request("gpu", cores="25", memory="2Gi"))
        cluster.pod(ns, "before", node, templates={"gpu": "share"})
        pod = cluster.running(ns, "before")
        [before] = cluster.devices(ns, "before")
        claim_uid = cluster.pod_claim(pod, "gpu")["metadata"]["uid"]
        node_pod = cluster.node_pod(node)
        prepared = _prepare_lines(cluster, node_pod, claim_uid)
        assert prepared == 1, prepared

        cluster.ops.restart_kubelet(node)

        def ready() -> bool:
            obj = cluster.kube.get(resource_path("v1", "nodes", name=node))
            conditions = {c["type"]: c for c in obj["status"].get("conditions") or []}
            return bool(conditions.get("Ready", {}).get("status") == "True")

        wait_for(ready, 90, f"node {node} Ready after the kubelet restart")
        cluster.pod(ns, "after", node, templates={"gpu": "share"})
        cluster.running(ns, "after")
        pod = cluster.get_pod(ns, "before")
        [main] = pod["status"]["containerStatuses"]
        assert pod["status"]["phase"] == "Running" and main["restartCount"] == 0, main
        assert cluster.devices(ns, "before") == [before]
        assert _prepare_lines(cluster, cluster.node_pod(node), claim_uid) == 1


def _prepare_lines(cluster: Cluster, node_pod: Obj, claim_uid: str) -> int:
    """How often the kubelet plugin did the work of preparing ``claim_uid`` (its "prepared"
    log line; a repeated call is answered from the checkpoint without that line)."""
    meta = node_pod["metadata"]
    text = cluster.log(meta["namespace"], meta["name"], "kubelet-plugin")
    return sum(1 for line in text.splitlines() if '"msg": "prepared"' in line and claim_uid in line)


def node_drain(cluster: Cluster) -> None:
    """Draining a node evicts its GPU pods; their claims are released and the GPU can be
    allocated again once the node is back."""
    node = cluster.gpu_nodes[0]
    nodes = resource_path("v1", "nodes", name=node)
    with cluster.namespace("drain") as ns:
        cluster.template(ns, "whole", request("gpu", selector=attribute("index", WHOLE_GPU)))
        cluster.pod(ns, "before", node, templates={"gpu": "whole"})
        pod = cluster.running(ns, "before")
        claim_name = cluster.pod_claim(pod, "gpu")["metadata"]["name"]
        cluster.kube.patch(nodes, {"spec": {"unschedulable": True}})
        try:
            cluster.create(
                ns,
                "pods/before/eviction",
                {
                    "apiVersion": "policy/v1",
                    "kind": "Eviction",
                    "metadata": {"name": "before", "namespace": ns},
                },
            )
            cluster.delete_pod(ns, "before", timeout=90)
            claims = resource_path(RESOURCE, "resourceclaims", namespace=ns)
            wait_for(
                lambda: (
                    not any(
                        c["metadata"]["name"] == claim_name
                        for c in cluster.kube.list(claims)["items"]
                    )
                ),
                60,
                "the evicted pod's claim to be deleted",
            )
        finally:
            cluster.kube.patch(nodes, {"spec": {"unschedulable": False}})
        cluster.pod(ns, "after", node, templates={"gpu": "whole"})
        cluster.running(ns, "after")
        [device] = cluster.devices(ns, "after")
        assert device["DEVICE"] == f"gpu-{WHOLE_GPU}", device


def dynamic_mig(cluster: Cluster) -> None:
    """Switching the chart to dynamic MIG: the MIG manager destroys the instances no claim owns,
    the plugin publishes every placement, an instance is created when a claim is prepared and
    destroyed when it is released (a whole-GPU 7g.40gb fits again afterwards). Runs last: it
    leaves the release in dynamic mode."""
    node = cluster.gpu_nodes[-1]
    cluster.upgrade({"migManager": {"dynamic": True}})
    placement = f"gpu-{MIG_GPU}-mig-3g-20gb-0"  # overlaps the static 2g.10gb at 0: dynamic only

    def published() -> bool:
        slices = cluster.kube.list(
            resource_path(RESOURCE, "resourceslices"), field_selector=f"spec.nodeName={node}"
        )["items"]
        return any(d["name"] == placement for s in slices for d in s["spec"].get("devices") or [])

    wait_for(published, 90, f"the dynamic MIG placement {placement} published on {node}")
    on_mig_gpu = attribute("index", MIG_GPU)
    with cluster.namespace("dynamic-mig") as ns:
        for name, profile in (("half", "3g.20gb"), ("whole", "7g.40gb")):
            selector = f"{on_mig_gpu} && {attribute('profile', profile)}"
            cluster.template(ns, name, request("mig", MIG_CLASS, selector=selector))
        cluster.pod(ns, "half", node, templates={"gpu": "half"})
        pod = cluster.running(ns, "half")
        [device] = cluster.devices(ns, "half")
        [allocated] = _allocated(cluster, pod)
        assert allocated.startswith(f"gpu-{MIG_GPU}-mig-3g-20gb-"), allocated
        assert device["UUID"].startswith("MIG-") and device["DEVICE"] == allocated, device
        cluster.delete_pod(ns, "half")
        # the 3g.20gb instance is gone with its claim: the whole GPU fits in one instance now
        cluster.pod(ns, "whole", node, templates={"gpu": "whole"})
        cluster.running(ns, "whole", timeout=120)
        [device] = cluster.devices(ns, "whole")
        assert device["DEVICE"] == f"gpu-{MIG_GPU}-mig-7g-40gb-0", device


def legacy_device_plugin_node(cluster: Cluster) -> None:
    """A node in device-plugin mode (label gpuslice.dev/mode=device-plugin): the device plugin,
    not the DRA node pod, runs there and advertises every fake GPU as ``nvidia.com/gpu``; a pod
    that asks for one gets one GPU UUID in NVIDIA_VISIBLE_DEVICES."""
    assert cluster.device_plugin_nodes, "the scenario cluster has no device-plugin-mode node"
    node = cluster.device_plugin_nodes[0]
    want = str(gpu_count())

    def advertised() -> bool:
        status = cluster.kube.get(resource_path("v1", "nodes", name=node))["status"]
        return bool((status.get("allocatable") or {}).get("nvidia.com/gpu") == want)

    wait_for(advertised, 120, f"{node} to advertise {want} nvidia.com/gpu")
    assert not cluster.component_pods(node, "node"), f"a DRA node pod on {node}"
    assert len(cluster.component_pods(node, "device-plugin")) == 1
    for dra in cluster.gpu_nodes:
        assert not cluster.component_pods(dra, "device-plugin"), f"a device plugin on {dra}"
    with cluster.namespace("device-plugin") as ns:
        cluster.pod(ns, "legacy", node, limits={"nvidia.com/gpu": "1"})
        cluster.running(ns, "legacy")
        env = cluster.env(ns, "legacy")
        visible = env.get("NVIDIA_VISIBLE_DEVICES", "")
        [uuid] = visible.split(",")
        assert uuid.startswith("GPU-"), env


SCENARIOS: list[Callable[[Cluster], None]] = [
    exclusive_gpu,
    two_shares_and_one_that_does_not_fit,
    static_mig_device,
    each_container_sees_its_requests,
    legacy_extended_resource,
    dialect_pod_through_the_controller,
    claim_shared_by_two_pods,
    plugin_killed_while_pods_run,
    kubelet_restarted,
    node_drain,
    legacy_device_plugin_node,
    examples_run_as_documented,  # examples/ as a user applies them (e2e/scenarios/examples.py)
    dynamic_mig,
]
