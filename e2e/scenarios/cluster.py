"""What a scenario needs of a cluster, and the steps every scenario takes on it.

A ``Cluster`` is a kubeconfig's API plus the few things the Kubernetes API cannot do: kill a
container and restart a kubelet (``NodeOps``). The real-node tier (e2e/sandbox/realnode.py) and
kind (hack/e2e-kind.sh) each give one; the scenarios in ``e2e.scenarios.user`` run unchanged on
both. Everything is read the way a user would read it: pod status, pod logs, claims, Events and
the services' own metrics through the API server's proxy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes.client import ApiClient, CoreV1Api

from e2e.sandbox.gpunode import claim_request
from e2e.sandbox.nodeagent.testing import summary, unique, wait_for, wait_pod_phase
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kubelet_plugin.cdispecs import device_env

DRIVER = "gpu.gpuslice.dev"
RESOURCE = "resource.k8s.io/v1"
GPU_CLASS = "gpu.gpuslice.dev"
MIG_CLASS = "mig.gpuslice.dev"
READY = "READY"
# Every workload prints the variables gpuslice and CUDA give it, then stays up.
# what a workload sees of its GPUs: the environment, and the NVIDIA device nodes (DEV:<path>)
ENV_SCRIPT = (
    "env | grep -E '^(CUDA_|GPUSLICE_|NVIDIA_)' | sort;"
    ' for d in /dev/nvidia* /dev/nvidia-caps/*; do [ -e "$d" ] && echo "DEV:$d"; done;'
    f" echo {READY}; exec sleep 3600"
)
POD_TIMEOUT = 90.0  # image unpack and CDI hooks on a loaded 2-core machine


class NodeOps(Protocol):
    """What only the node's owner can do (the sandbox's processes, or `docker exec` in kind)."""

    def kill_container(self, node: str, container_id: str) -> None:
        """SIGKILL the container's process (``container_id`` as pod status has it)."""

    def restart_kubelet(self, node: str) -> None:
        """Stop the node's kubelet and start it again with the same root directory."""


def delete_and_wait(kube: RawApi, path: str, what: str, timeout: float) -> None:
    """Delete the object at ``path`` (gone already is fine) and wait until the API server no
    longer has it (its finalizers done)."""
    with contextlib.suppress(KubeNotFoundError):
        kube.delete(path)

    def gone() -> bool:
        try:
            kube.get(path)
        except KubeNotFoundError:
            return True
        return False

    wait_for(gone, timeout, f"{what} to be deleted")


@dataclass
class Cluster:
    """A cluster running the gpuslice chart with the fake NVML config of ``e2e.scenarios.nodes``.

    ``gpu_nodes``: the nodes our DRA node DaemonSet runs on; ``device_plugin_nodes``: the
    nodes labelled gpuslice.dev/mode=device-plugin, where the device plugin runs instead
    (empty where the cluster has none); ``image``: a workload image with sh, env,
    grep and sleep, pulled as any workload's image is (imagePullPolicy IfNotPresent: from the
    tier's registry on the real nodes, already on the node where kind loaded it);
    ``release_namespace``: where the chart is installed; ``upgrade``: `helm upgrade` of the
    release with these values merged into the installed ones (waits until the node pods are
    ready again).
    """

    api_client: ApiClient
    gpu_nodes: list[str]
    image: str
    release_namespace: str
    ops: NodeOps
    upgrade: Callable[[dict[str, Any]], None]
    device_plugin_nodes: list[str] = field(default_factory=list)
    # the nodes' driver root has the driver's device nodes (a GPU node, or the real-node tier's
    # driver root of files), so a container gets its GPUs' nodes; not with the fake backend
    driver_files: bool = False
    kube: RawApi = field(init=False)
    core: CoreV1Api = field(init=False)

    def __post_init__(self) -> None:
        self.kube = RawApi(self.api_client)
        self.core = CoreV1Api(self.api_client)

    # ---- namespaces ----------------------------------------------------------------------
    @contextlib.contextmanager
    def namespace(self, prefix: str) -> Iterator[str]:
        """A fresh namespace, deleted afterwards together with its pods and claims; returns
        once they are gone, so the next scenario starts with every device free."""
        name = unique(prefix)
        self.kube.create(
            resource_path("v1", "namespaces"),
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        )
        try:
            yield name
        finally:
            self.delete_namespace(name)

    def delete_namespace(self, name: str, timeout: float = 120) -> None:
        path = resource_path("v1", "namespaces", name=name)
        delete_and_wait(self.kube, path, f"namespace {name}", timeout)

    # ---- objects -------------------------------------------------------------------------
    def create(self, namespace: str, resource: str, obj: Obj, group_version: str = "v1") -> Obj:
        return self.kube.create(resource_path(group_version, resource, namespace=namespace), obj)

    def template(self, namespace: str, name: str, *requests: Obj, **devices: object) -> None:
        """A ResourceClaimTemplate with these requests (``devices``: constraints, config)."""
        self.create(
            namespace,
            "resourceclaimtemplates",
            {
                "apiVersion": RESOURCE,
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name},
                "spec": {"spec": {"devices": {"requests": list(requests), **devices}}},
            },
            RESOURCE,
        )

    def claim(self, namespace: str, name: str, *requests: Obj) -> Obj:
        return self.create(
            namespace,
            "resourceclaims",
            {
                "apiVersion": RESOURCE,
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {"devices": {"requests": list(requests)}},
            },
            RESOURCE,
        )

    def get_claim(self, namespace: str, name: str) -> Obj:
        return self.kube.get(
            resource_path(RESOURCE, "resourceclaims", namespace=namespace, name=name)
        )

    def pod(
        self,
        namespace: str,
        name: str,
        node: str,
        *,
        templates: dict[str, str] | None = None,
        claims: dict[str, str] | None = None,
        limits: dict[str, str] | None = None,
        containers: dict[str, list[Obj]] | None = None,
    ) -> Obj:
        """A workload pod on ``node``. ``templates``/``claims``: pod claim name → template or
        claim name. ``containers``: container name → its ``resources.claims`` entries (default:
        one container ``main`` that names every pod claim). ``limits``: extended resources."""
        refs = [{"name": n, "resourceClaimTemplateName": t} for n, t in (templates or {}).items()]
        refs += [{"name": n, "resourceClaimName": c} for n, c in (claims or {}).items()]
        if containers is None:
            containers = {"main": [{"name": r["name"]} for r in refs]}
        specs: list[Obj] = []
        for cname, claim_refs in containers.items():
            container: Obj = {
                "name": cname,
                "image": self.image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", ENV_SCRIPT],
                "resources": {},
            }
            if claim_refs:
                container["resources"]["claims"] = claim_refs
            if limits:
                container["resources"]["limits"] = limits
            specs.append(container)
        spec: Obj = {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 1,
            "containers": specs,
        }
        if refs:
            spec["resourceClaims"] = refs
        return self.create(
            namespace,
            "pods",
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec},
        )

    def running(self, namespace: str, name: str, timeout: float = POD_TIMEOUT) -> Obj:
        return wait_pod_phase(self.kube, namespace, name, "Running", timeout=timeout)

    def get_pod(self, namespace: str, name: str) -> Obj:
        return self.kube.get(resource_path("v1", "pods", namespace=namespace, name=name))

    def unschedulable(self, namespace: str, name: str, timeout: float = 30) -> str:
        """The scheduler's message once it has given up on the pod for now."""

        def message() -> str | None:
            pod = self.get_pod(namespace, name)
            for cond in (pod.get("status") or {}).get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    return str(cond.get("message", ""))
            raise AssertionError(f"pod status now: {summary(pod)}")

        return wait_for(message, timeout, f"pod {namespace}/{name} to be unschedulable")

    def delete_pod(self, namespace: str, name: str, timeout: float = 60) -> None:
        path = resource_path("v1", "pods", namespace=namespace, name=name)
        delete_and_wait(self.kube, path, f"pod {namespace}/{name}", timeout)

    # ---- what a pod got ------------------------------------------------------------------
    def log(self, namespace: str, name: str, container: str = "main") -> str:
        text: str = self.core.read_namespaced_pod_log(name, namespace, container=container)
        return text

    def _printed(self, namespace: str, name: str, container: str) -> str:
        def printed() -> str | None:
            text = self.log(namespace, name, container)
            return text if READY in text else None

        return wait_for(printed, 30, f"the log of {namespace}/{name}/{container}")

    def env(self, namespace: str, name: str, container: str = "main") -> dict[str, str]:
        """The CUDA/gpuslice environment the container printed (``kubectl logs``)."""
        text = self._printed(namespace, name, container)
        return dict(
            line.split("=", 1)
            for line in text.splitlines()
            if "=" in line and not line.startswith("DEV:")
        )

    def device_nodes(self, namespace: str, name: str, container: str = "main") -> list[str]:
        """The NVIDIA device nodes the container has (/dev/nvidia*, /dev/nvidia-caps/*)."""
        text = self._printed(namespace, name, container)
        return sorted(line[4:] for line in text.splitlines() if line.startswith("DEV:"))

    def devices(self, namespace: str, name: str, container: str = "main") -> list[dict[str, str]]:
        """The gpuslice devices the container got, one ``{field: value}`` each (UUID, CLAIM,
        REQUEST, CORES, MEMORY, ENFORCEMENT, ...), as its environment states them."""
        return list(device_env(self.env(namespace, name, container)).values())

    def pod_claim(self, pod: Obj, pod_claim: str) -> Obj:
        """The ResourceClaim behind one of the pod's claims (template-made or named)."""
        namespace = pod["metadata"]["namespace"]
        for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if status.get("name") == pod_claim:
                return self.get_claim(namespace, status["resourceClaimName"])
        for ref in pod["spec"].get("resourceClaims") or []:
            if ref["name"] == pod_claim and ref.get("resourceClaimName"):
                return self.get_claim(namespace, ref["resourceClaimName"])
        raise AssertionError(f"pod {pod['metadata']['name']} has no claim {pod_claim!r}")

    # ---- our node pods -------------------------------------------------------------------
    def node_pod(self, node: str) -> Obj:
        """The gpuslice node pod (DaemonSet) on ``node``."""
        running = self.component_pods(node, "node")
        if len(running) != 1:
            raise AssertionError(f"{len(running)} gpuslice node pods on {node}")
        return running[0]

    def component_pods(self, node: str, component: str) -> list[Obj]:
        """The release's pods of one component (node, device-plugin) on ``node``."""
        pods: list[Obj] = self.kube.list(
            resource_path("v1", "pods", namespace=self.release_namespace),
            label_selector=f"app.kubernetes.io/component={component}",
            field_selector=f"spec.nodeName={node}",
        )["items"]
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def container_status(self, pod: Obj, container: str) -> Obj:
        status = pod.get("status") or {}
        for c in (status.get("containerStatuses") or []) + (
            status.get("initContainerStatuses") or []
        ):
            if c["name"] == container:
                return dict(c)
        raise AssertionError(f"no status of container {container} in {summary(pod)}")

    def metrics(self, pod: Obj, port: int) -> str:
        """A pod's Prometheus text, through the API server's pod proxy."""
        meta = pod["metadata"]
        text: str = self.core.connect_get_namespaced_pod_proxy_with_path(
            f"{meta['name']}:{port}", meta["namespace"], "metrics"
        )
        return text


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        found = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        if all(found.get(k, "").strip('"') == v for k, v in labels.items()):
            total += float(value)
    return total


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` merged in, map by map (as helm merges values files)."""
    out = dict(base)
    for key, value in changes.items():
        old = out.get(key)
        out[key] = (
            merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
        )
    return out


def request(
    name: str, device_class: str = GPU_CLASS, selector: str | None = None, **capacity: str
) -> Obj:
    """One ``exactly`` request (``capacity``: cores and memory to ask for)."""
    return claim_request(name, device_class, selector, **capacity)


def attribute(name: str, value: object) -> str:
    """A CEL selector on one of our attributes."""
    shown = f'"{value}"' if isinstance(value, str) else str(value)
    return f'device.attributes["{DRIVER}"].{name} == {shown}'
