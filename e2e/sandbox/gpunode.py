"""GPU nodes on the sandbox: a node agent plus the real kubelet plugin on the fake NVML.

Used by the kubelet-plugin e2e suites and by the sandbox demo (``make demo``).

A "GPU node" is a sandbox node agent (the simulated kubelet) plus the real
``gpuslice-kubelet-plugin`` process on the fake NVML, sharing the agent's registration, plugins
and CDI directories exactly as the DaemonSet shares the kubelet's. Claims for direct DRA-socket
tests are created in the real API with their allocation written into ``status``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import unique, wait_for, wait_pod_phase
from gpuslice_api import names
from gpuslice_api.names import NODE_LABEL, node_label_value
from gpuslice_kube.errors import KubeAlreadyExistsError, KubeForbiddenError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kubelet_plugin.cdispecs import device_env
from gpuslice_nvml import open_nvml
from gpuslice_nvml.fake import FakeNvmlControl
from gpuslice_testkit.kubelet_plugin.harness import write_node
from gpuslice_testkit.kubelet_plugin.process import PluginProcess
from gpuslice_testkit.nvml_mock import NvmlBackend

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST = REPO_ROOT / "e2e" / "manifests" / "deviceclasses.yaml"
RESOURCE = "resource.k8s.io/v1"
DRIVER = names.DRIVER  # what the tests import with the sandbox's other names
GIB = 1024**3

# 8 H100s; GPU 7 is partitioned with MIG (3g.40gb at 4, 2g.20gb at 2, 1g.10gb at 1)
H100X8 = [
    {"model": "H100", "count": 7},
    {
        "model": "H100",
        "migEnabled": True,
        "migInstances": [{"profile": "3g.40gb"}, {"profile": "2g.20gb"}, {"profile": "1g.10gb"}],
    },
]


@dataclass
class GpuNode:
    name: str
    root: Path
    agent: NodeAgent | None
    plugin: PluginProcess
    nvml_config: Path

    @property
    def control(self) -> FakeNvmlControl:
        return FakeNvmlControl.from_config_file(self.nvml_config)

    def slices(self, kube: RawApi) -> list[Obj]:
        items: list[Obj] = kube.list(
            resource_path(RESOURCE, "resourceslices"),
            field_selector=f"spec.nodeName={self.name},spec.driver={DRIVER}",
        )["items"]
        return items

    def devices(self, kube: RawApi) -> dict[str, Obj]:
        return {d["name"]: d for s in self.slices(kube) for d in s["spec"].get("devices") or []}

    def checkpoint_claims(self) -> dict[str, Obj]:
        return self.plugin.checkpoint_claims()

    def gpu_uuid(self, index: int) -> str:
        with open_nvml("fake", self.nvml_config) as nvml:
            return nvml.gpu(index).uuid


def start_gpu_node(
    sandbox: ControlPlane,
    gpus: list[dict[str, Any]],
    *,
    with_agent: bool = True,
    extra: tuple[str, ...] = (),
    name: str | None = None,
    root: Path | None = None,
    nvml_config: Path | None = None,
    backend: NvmlBackend = "fake",
) -> GpuNode:
    """A node agent plus the kubelet plugin (with ``extra`` flags), registered. The fake NVML
    config is written from ``gpus`` unless ``nvml_config`` names one already written. The plugin
    runs on the fake backend, or with ``backend="mock"`` on the real one over the mock library
    (docs/nvml-mock.md), on the same fake node."""
    # imported here: importing the fixtures plugin at collection time defeats its registration
    from e2e.sandbox.nodeagent.fixtures import start_node_agent

    name = name or unique("gpu-node")
    root = root or Path(tempfile.mkdtemp(prefix="gkn-"))
    config = nvml_config or write_node(root, gpus, name)
    agent = start_node_agent(sandbox, name=name, root=root / "k") if with_agent else None
    kubelet = root / "k"
    plugin = PluginProcess(
        node=name,
        kubeconfig=sandbox.kubeconfig,
        fake_nvml_config=config,
        state_dir=root / "state",
        cdi_root=agent.config.cdi_dir if agent else root / "cdi",
        registrar_dir=kubelet / "plugins_registry",
        plugins_dir=kubelet / "plugins",
        log=root / "plugin.log",
        extra=extra,
        backend=backend,
    )
    try:
        plugin.start()
        if agent is not None:
            wait_for(lambda: DRIVER in agent.registered_drivers(), 20, "the plugin's registration")
    except BaseException:
        plugin.stop()
        if agent is not None:
            agent.stop()
        raise
    return GpuNode(name, root, agent, plugin, config)


def stop_gpu_node(node: GpuNode, kube: RawApi, *, keep: bool = False) -> None:
    node.plugin.stop()
    if node.agent is not None:
        node.agent.stop()
    with contextlib.suppress(KubeNotFoundError):
        kube.delete(resource_path("v1", "nodes", name=node.name))
    for s in node.slices(kube):
        with contextlib.suppress(KubeNotFoundError):
            kube.delete(resource_path(RESOURCE, "resourceslices", name=s["metadata"]["name"]))
    if keep:
        print(f"GPU node {node.name}: kept {node.root} (plugin log {node.plugin.log})")
    else:
        shutil.rmtree(node.root, ignore_errors=True)


@contextlib.contextmanager
def running_gpu_node(
    sandbox: ControlPlane, kube: RawApi, gpus: list[dict[str, Any]], *, devices: int
) -> Iterator[GpuNode]:
    """``start_gpu_node``, once its ``devices`` devices are published; stopped after."""
    node = start_gpu_node(sandbox, gpus)
    try:
        wait_for(lambda: len(node.devices(kube)) == devices, 20, f"the node's {devices} devices")
        yield node
    finally:
        stop_gpu_node(node, kube)


def apply_device_classes(kube: RawApi) -> list[str]:
    """Create (or update) the DeviceClasses of e2e/manifests/deviceclasses.yaml; their names."""
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    names = []
    for doc in docs:
        path = resource_path(RESOURCE, "deviceclasses")
        try:
            kube.create(path, doc)
        except KubeAlreadyExistsError:
            one = resource_path(RESOURCE, "deviceclasses", name=doc["metadata"]["name"])
            doc["metadata"]["resourceVersion"] = kube.get(one)["metadata"]["resourceVersion"]
            kube.replace(one, doc)
        names.append(doc["metadata"]["name"])
    return names


def delete_device_classes(kube: RawApi, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(KubeNotFoundError):
            kube.delete(resource_path(RESOURCE, "deviceclasses", name=name))


def create_claim(
    kube: RawApi,
    namespace: str,
    name: str,
    *,
    results: list[Obj] | None = None,
    config: list[Obj] | None = None,
    reserved_for: Sequence[tuple[str, str]] = (),
) -> Obj:
    """A ResourceClaim; with ``results`` its allocation is written into the status, as the
    scheduler would, and it carries the node label, as the controller would (for tests that
    drive the DRA socket directly). The claim requests what the
    results name (``gpu`` without results), since the API server checks that each result
    belongs to a request of the claim. ``reserved_for``: (pod name, pod UID) of pods that exist
    (the resource-claim controller drops reservations of pods it cannot find)."""
    requests = list(dict.fromkeys(r["request"].split("/")[0] for r in results or [])) or ["gpu"]
    pools = sorted(r["pool"] for r in results or [] if r.get("driver") == DRIVER)
    # the node label the controller writes on an allocated claim (gpuslice_controller.claimnodes)
    labels = {NODE_LABEL: node_label_value(pools[0])} if pools else {}
    claim = kube.create(
        resource_path(RESOURCE, "resourceclaims", namespace=namespace),
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": r, "exactly": {"deviceClassName": "gpu.gpuslice.dev"}}
                        for r in requests
                    ]
                }
            },
        },
    )
    if results is None:
        return claim
    status: Obj = {"allocation": {"devices": {"results": results, "config": config or []}}}
    if reserved_for:
        status["reservedFor"] = [
            {"resource": "pods", "name": pod, "uid": uid} for pod, uid in reserved_for
        ]
    claim["status"] = status
    path = resource_path(RESOURCE, "resourceclaims", namespace=namespace, name=name)
    return kube.replace(path + "/status", claim)


def delete_claim(kube: RawApi, namespace: str, name: str) -> None:
    with contextlib.suppress(KubeNotFoundError):
        kube.delete(resource_path(RESOURCE, "resourceclaims", namespace=namespace, name=name))


def delete_claims(kube: RawApi, namespace: str) -> None:
    """Every ResourceClaim of ``namespace`` (one DeleteCollection)."""
    kube.delete_collection(resource_path(RESOURCE, "resourceclaims", namespace=namespace))


def create_gated_pod(kube: RawApi, namespace: str, name: str, *, claim: str | None = None) -> Obj:
    """A pod the scheduler never takes (a scheduling gate), e.g. for a claim's reservedFor.
    Retried while the namespace's ``default`` ServiceAccount does not exist yet."""
    spec: Obj = {
        "schedulingGates": [{"name": "gpuslice.dev/never"}],
        "containers": [{"name": "main", "image": "busybox"}],
    }
    if claim:
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
    path = resource_path("v1", "pods", namespace=namespace)

    def create() -> Obj | None:
        try:
            return kube.create(path, body)
        except KubeForbiddenError as exc:  # "serviceaccount default not found" for a moment
            raise AssertionError(str(exc)) from exc

    return wait_for(create, 10, f"pod {namespace}/{name} to be created")


def node_slices(kube: RawApi, node: str, *, group_version: str = RESOURCE) -> list[Obj]:
    """Every ResourceSlice of ``node`` (any driver), read through ``group_version``."""
    items: list[Obj] = kube.list(
        resource_path(group_version, "resourceslices"), field_selector=f"spec.nodeName={node}"
    )["items"]
    return items


def delete_node_slices(kube: RawApi, node: str) -> None:
    """Every ResourceSlice of ``node`` (stop its plugin first, or it publishes them again)."""
    kube.delete_collection(
        resource_path(RESOURCE, "resourceslices"), field_selector=f"spec.nodeName={node}"
    )


def closed_port() -> int:
    """A loopback TCP port nobody listens on (bound once, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def unreachable_kubeconfig(kubeconfig: Path, path: Path) -> Path:
    """A copy of ``kubeconfig`` whose server is a closed port: the API server is unreachable."""
    doc = yaml.safe_load(kubeconfig.read_text())
    for cluster in doc["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{closed_port()}"
    path.write_text(yaml.safe_dump(doc))
    return path


def claim_template(
    namespace: str,
    name: str,
    device_class: str,
    *,
    cores: str | None = None,
    memory: str | None = None,
    selector: str | None = None,
) -> Obj:
    exactly: Obj = {"deviceClassName": device_class}
    requests = {k: v for k, v in (("cores", cores), ("memory", memory)) if v is not None}
    if requests:
        exactly["capacity"] = {"requests": requests}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def claim_request(
    name: str, device_class: str, selector: str | None = None, **capacity: str
) -> Obj:
    """One ``exactly`` request of a claim spec (``capacity``: cores, memory to ask for)."""
    exactly: Obj = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"name": name, "exactly": exactly}


def on_gpu(index: int) -> str:
    return f'device.attributes["{DRIVER}"].index == {index}'


def mig_profile(name: str) -> str:
    return f'device.attributes["{DRIVER}"].profile == "{name}"'


def create_multi_request_template(
    kube: RawApi, namespace: str, name: str, requests: list[Obj], **devices: object
) -> None:
    """A ResourceClaimTemplate with these requests (``devices``: constraints, config)."""
    kube.create(
        resource_path(RESOURCE, "resourceclaimtemplates", namespace=namespace),
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": requests, **devices}}},
        },
    )


ENV_SCRIPT = "env | grep -E '^(CUDA_VISIBLE_DEVICES|GPUSLICE_)' | sort; echo READY; sleep 300"


def gpu_pod(
    namespace: str,
    name: str,
    node: str,
    *,
    template: str | None = None,
    claim: str | None = None,
    limits: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> Obj:
    container: Obj = {"name": "main", "image": "busybox", "command": ["sh", "-c", ENV_SCRIPT]}
    spec: Obj = {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": 2,
        "containers": [container],
    }
    if template or claim:
        container["resources"] = {"claims": [{"name": "gpu"}]}
        source = (
            {"resourceClaimTemplateName": template} if template else {"resourceClaimName": claim}
        )
        spec["resourceClaims"] = [{"name": "gpu", **source}]
    if limits:
        container["resources"] = {"limits": limits}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": spec,
    }


def multi_container_pod(
    namespace: str, name: str, node: str, containers: dict[str, list[Obj]]
) -> Obj:
    """A pod whose claims come from the templates its containers name (pod claim name =
    template name); ``containers``: name → that container's ``resources.claims`` entries.
    Every container prints its environment like ``gpu_pod``'s."""
    templates = sorted({ref["name"] for refs in containers.values() for ref in refs})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 2,
            "resourceClaims": [{"name": t, "resourceClaimTemplateName": t} for t in templates],
            "containers": [
                {
                    "name": c,
                    "image": "busybox",
                    "command": ["sh", "-c", ENV_SCRIPT],
                    "resources": {"claims": refs},
                }
                for c, refs in containers.items()
            ],
        },
    }


def run_pod(
    kube: RawApi, node: GpuNode, namespace: str, name: str, containers: dict[str, list[Obj]]
) -> Obj:
    """Create ``multi_container_pod`` on ``node`` and wait until it runs."""
    pod = multi_container_pod(namespace, name, node.name, containers)
    kube.create(resource_path("v1", "pods", namespace=namespace), pod)
    return wait_pod_phase(kube, namespace, name, "Running", timeout=60)


def pod_env(
    node: GpuNode, pod: Obj, timeout: float = 15, container: str = "main"
) -> dict[str, str]:
    """The CUDA/gpuslice environment the container printed (from its log)."""
    assert node.agent is not None
    agent = node.agent

    def log() -> str | None:
        text = agent.pod_log(pod["metadata"]["uid"], container)
        return text if "READY" in text else None

    text = wait_for(log, timeout, f"the log of {container} in pod {pod['metadata']['name']}")
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def pod_devices(
    node: GpuNode, pod: Obj, timeout: float = 15, container: str = "main"
) -> list[dict[str, str]]:
    """The gpuslice devices a container got, as its environment states them: one
    ``{field: value}`` per device (UUID, CLAIM, REQUEST, CORES, MEMORY, ENFORCEMENT, ...)."""
    return list(device_env(pod_env(node, pod, timeout, container)).values())


def allocated_devices(kube: RawApi, namespace: str, pod: Obj) -> list[str]:
    name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = kube.get(resource_path(RESOURCE, "resourceclaims", namespace=namespace, name=name))
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
