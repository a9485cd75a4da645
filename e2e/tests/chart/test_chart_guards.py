"""The chart's guards (templates/validation.yaml; docs/helm.md, "Guards").

Each guard is made to fire the way a user meets it, and its message must name the cause and the
exact flags that fix it; then those flags must make the same install pass:

- the `default` namespace, with `helm template` (no cluster needed);
- a cluster that serves no resource.k8s.io version: `helm install --dry-run=server` against a
  stand-in API server whose discovery lists no resource.k8s.io (the sandbox serves DRA, and
  `helm template --api-versions` only adds to helm's built-in list, which has it);
- other GPU software, found by `lookup`: `helm install --dry-run=server` against the sandbox's
  real API server after creating NVIDIA's device plugin and MIG manager DaemonSets (on no node),
  NVIDIA's DeviceClass gpu.nvidia.com and a HAMi pod webhook (matching no object); and
  `helm template` of the same chart, which cannot look and passes.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.support.chart import CHART, helm, render, sets
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(180)


Obj = dict[str, Any]
ADMISSION = "admissionregistration.k8s.io/v1"


def refusal(helm_bin: Path, *args: str) -> str:
    """The message of a refused install (helm's stderr); fails the test when it passed."""
    out = helm(helm_bin, *args, check=False)
    assert out.returncode != 0, f"helm {' '.join(args)} passed:\n{out.stdout[-2000:]}"
    assert "gpuslice cannot be installed as asked" in out.stderr, out.stderr
    return " ".join(out.stderr.split())


# ---- the namespace ----------------------------------------------------------------------------
def test_the_default_namespace_is_refused_with_the_flags_that_fix_it(helm_bin: Path) -> None:
    message = refusal(helm_bin, "template", "gs", str(CHART))  # no -n: helm's "default"
    assert 'the release namespace is "default"' in message
    assert "helm install gs <chart> -n gpuslice --create-namespace" in message
    assert "--set guards.allowDefaultNamespace=true" in message
    assert "guards.coexistence" not in message  # only where other GPU software was found
    assert render(helm_bin, *sets("guards.allowDefaultNamespace=true"), namespace="default")
    assert render(helm_bin, namespace="gpuslice")


# ---- the API ----------------------------------------------------------------------------------
GROUPS = {  # what the stand-in API server serves: core, apps, admission; no resource.k8s.io
    "": ("v1", ["namespaces", "nodes", "secrets", "configmaps", "services", "serviceaccounts"]),
    "apps": ("v1", ["daemonsets", "deployments"]),
    "admissionregistration.k8s.io": (
        "v1",
        ["mutatingwebhookconfigurations", "validatingwebhookconfigurations"],
    ),
}
CLUSTER_SCOPED = {"namespaces", "nodes", "mutatingwebhookconfigurations"}
CLUSTER_SCOPED |= {"validatingwebhookconfigurations"}


def _resources(group: str) -> Obj:
    version, names = GROUPS[group]
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [
            {
                "name": n,
                "singularName": n[:-1],
                "namespaced": n not in CLUSTER_SCOPED,
                "kind": n[:-1].capitalize(),
                "verbs": ["get", "list", "watch", "create", "update", "delete"],
            }
            for n in names
        ],
    }


class _Discovery(BaseHTTPRequestHandler):
    """Discovery of a Kubernetes 1.33 without DRA; every list is empty, every get not found."""

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        body: Obj | None
        if path == "/version":
            body = {"major": "1", "minor": "33", "gitVersion": "v1.33.4", "platform": "linux/amd64"}
        elif path == "/api":
            body = {"kind": "APIVersions", "versions": ["v1"]}
        elif path == "/apis":
            body = {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                        "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v},
                    }
                    for g, (v, _) in GROUPS.items()
                    if g
                ],
            }
        elif path == "/api/v1":
            body = _resources("")
        elif path.startswith("/apis/") and path.count("/") == 3:
            group = path.split("/")[2]
            body = _resources(group) if group in GROUPS else None
        else:
            parts = path.split("/")
            named = len(parts) % 2 == 1 if path.startswith("/apis/") else len(parts) % 2 == 0
            named = named and "namespaces" not in parts[-2:-1]
            body = None if named else {"kind": "List", "apiVersion": "v1", "items": []}
        data = json.dumps(
            body
            if body is not None
            else {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
        ).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def no_dra_cluster(tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig for a stand-in API server that serves no resource.k8s.io."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discovery)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    address = f"http://127.0.0.1:{server.server_address[1]}"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": address}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    kubeconfig.chmod(0o600)
    try:
        yield kubeconfig
    finally:
        server.shutdown()
        server.server_close()


def test_a_cluster_without_dra_is_told_which_api_is_missing(
    helm_bin: Path, no_dra_cluster: Path
) -> None:
    message = refusal(
        helm_bin,
        "install",
        "gs",
        str(CHART),
        *("-n", "gpuslice", f"--kubeconfig={no_dra_cluster}", "--dry-run=server"),
    )
    assert "the cluster (Kubernetes v1.33.4) serves none of the APIs gpuslice needs" in message
    for api in ("resource.k8s.io/v1 ", "resource.k8s.io/v1beta2 ", "resource.k8s.io/v1beta1 "):
        assert api in message, api
    assert "start kube-apiserver with --runtime-config=resource.k8s.io/v1beta2=true" in message
    assert "DynamicResourceAllocation=true" in message


# ---- other GPU software -----------------------------------------------------------------------
def _daemonset(
    name: str, container: str, labels: dict[str, str], command: list[str] | None = None
) -> Obj:
    """A DaemonSet shaped like NVIDIA's, on no node (its selector matches none)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": {"gpuslice.dev/no-such-node": "true"},
                    "containers": [
                        {
                            "name": container,
                            "image": "registry.invalid/x:1",
                            **({"command": command} if command else {}),
                        }
                    ],
                },
            },
        },
    }


@contextlib.contextmanager
def created(kube: RawApi, collection: str, obj: Obj) -> Iterator[Obj]:
    made = kube.create(collection, obj)
    try:
        yield made
    finally:
        with contextlib.suppress(KubeNotFoundError):
            kube.delete(f"{collection}/{made['metadata']['name']}")


@pytest.fixture
def other_gpu_software(kube: RawApi, namespace: str) -> Iterator[dict[str, Obj]]:
    """NVIDIA's device plugin and the Operator's MIG manager (DaemonSets in ``namespace``),
    NVIDIA's DeviceClass gpu.nvidia.com and HAMi's pod webhook (matching no object)."""
    daemonsets = resource_path("apps/v1", "daemonsets", namespace=namespace)
    hami: Obj = {
        "apiVersion": ADMISSION,
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": f"{namespace}-hami-webhook"},
        "webhooks": [
            {
                "name": "vgpu.hami.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Ignore",
                "clientConfig": {"url": "https://127.0.0.1:1/webhook/mutating"},
                "objectSelector": {"matchLabels": {"gpuslice.dev/no-such-object": "true"}},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                        "operations": ["CREATE"],
                    }
                ],
            }
        ],
    }
    device_class: Obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "gpu.nvidia.com"},
        "spec": {
            "selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}],
            # as NVIDIA's chart sets it; dropped by API servers without DRAExtendedResource
            "extendedResourceName": "nvidia.com/gpu",
        },
    }
    with (
        created(
            kube,
            daemonsets,
            _daemonset(
                "nvidia-device-plugin-daemonset",
                "nvidia-device-plugin-ctr",
                {"app": "nvidia-device-plugin-daemonset"},
            ),
        ) as device_plugin,
        created(
            kube,
            daemonsets,
            _daemonset("nvidia-mig-manager", "nvidia-mig-manager", {"app": "nvidia-mig-manager"}),
        ) as mig_manager,
        created(  # HAMi's fork: its own names, NVIDIA's binary
            kube,
            daemonsets,
            _daemonset(
                "hami-device-plugin",
                "device-plugin",
                {"app.kubernetes.io/component": "hami-device-plugin"},
                ["nvidia-device-plugin", "--config-file=/device-config.yaml"],
            ),
        ),
        created(
            kube, resource_path("resource.k8s.io/v1", "deviceclasses"), device_class
        ) as dra_driver,
        created(kube, resource_path(ADMISSION, "mutatingwebhookconfigurations"), hami) as webhook,
    ):
        yield {
            "device-plugin": device_plugin,
            "mig-manager": mig_manager,
            "dra-driver": dra_driver,
            "hami": webhook,
        }


COEXIST = [
    "--set-string",
    "node.nodeSelector.gpuslice\\.dev/mode=dra",
    "--set-string",
    "node.nodeSelector.nvidia\\.com/gpu\\.deploy\\.mig-manager=false",
    "--set",
    "devicePlugin.enabled=false",
    "--set-string",
    "controller.webhook.namespaceSelector.matchLabels.hami\\.io/webhook=ignore",
    # the sandbox is 1.36+: gpu.gpuslice.dev would map nvidia.com/gpu as well
    "--set",
    "deviceClasses.extendedResourceMapping=false",
]


def test_other_gpu_software_is_found_and_each_fix_is_accepted(
    helm_bin: Path,
    sandbox: ControlPlane,
    namespace: str,
    other_gpu_software: dict[str, Obj],
) -> None:
    install = (
        "install",
        "gs",
        str(CHART),
        *("-n", namespace, f"--kubeconfig={sandbox.kubeconfig}", "--dry-run=server"),
    )
    message = refusal(helm_bin, *install)
    hami = other_gpu_software["hami"]["metadata"]["name"]
    expected = [
        "NVIDIA's device plugin (or a fork of it, such as HAMi's) runs in this cluster "
        f"(DaemonSet {namespace}/hami-device-plugin, DaemonSet {namespace}/"
        "nvidia-device-plugin-daemonset)",
        "--set-string node.nodeSelector.gpuslice\\.dev/mode=dra --set devicePlugin.enabled=false",
        "nvidia.com/gpu.deploy.device-plugin=false",
        "NVIDIA's DRA driver is installed (DeviceClass gpu.nvidia.com)",
        f"the GPU Operator's MIG manager runs in this cluster (DaemonSet {namespace}/"
        "nvidia-mig-manager)",
        "--set-string node.nodeSelector.nvidia\\.com/gpu\\.deploy\\.mig-manager=false",
        f"HAMi's webhook is installed (MutatingWebhookConfiguration {hami})",
        "--set controller.webhook.pods.enabled=false",
        "--set-string controller.webhook.namespaceSelector.matchLabels.hami\\.io/webhook=ignore",
        "--set guards.coexistence=false",
    ]
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"

    # Each fix alone clears its own guard: leave one out, and only that one is left.
    cases = [
        (2, "the GPU Operator's MIG manager"),
        (4, "NVIDIA's device plugin"),
        (6, "HAMi's webhook"),
    ]
    if other_gpu_software["dra-driver"]["spec"].get("extendedResourceName"):
        cases.append((8, "(gpu.nvidia.com already maps nvidia.com/gpu)"))
    for left_out, cause in cases:
        args = COEXIST[:left_out] + COEXIST[left_out + 2 :]
        message = refusal(helm_bin, *install, *args)
        assert cause in message, f"{cause!r} not in:\n{message}"
        assert message.count(" 1. ") == 1 and " 2. " not in message, message

    # All of them: the install passes the server's dry run.
    out = helm(helm_bin, *install, *COEXIST)
    assert "STATUS: pending-install" in out.stdout or "NOTES" in out.stdout, out.stdout
    # So does the escape hatch, and rendering without a cluster never looks.
    helm(helm_bin, *install, *sets("guards.coexistence=false"))
    assert render(helm_bin, namespace=namespace)


# ---- which nodes the node pods select (NOTES.txt) ---------------------------------------------
def test_notes_name_the_selected_nodes_or_the_label_to_set(
    helm_bin: Path, sandbox: ControlPlane, kube: RawApi, namespace: str
) -> None:
    """NOTES evaluate node.affinity and node.nodeSelector against the cluster's Nodes (lookup):
    the nodes selected, or a warning with the exact label command when none is."""
    mark = f"gpuslice-test/{namespace}"
    gpu, plain = f"{namespace}-gpu", f"{namespace}-plain"
    nodes = resource_path("v1", "nodes")
    for name, labels in (
        (gpu, {mark: "yes", "nvidia.com/gpu.present": "true"}),
        (plain, {mark: "yes"}),
    ):
        kube.create(
            nodes,
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}},
        )
    try:
        install = ["install", "gs", str(CHART), "-n", namespace]
        install += [f"--kubeconfig={sandbox.kubeconfig}", "--dry-run=server"]
        mine = ["--set-string", f"node.nodeSelector.gpuslice-test/{namespace}=yes"]
        notes = helm(helm_bin, *install, *mine).stdout
        assert re.search(rf"1 of \d+ nodes are selected: {gpu}\n", notes), notes
        assert "WARNING" not in notes
        # the device-plugin mode takes the node out of the default affinity
        kube.patch(
            f"{nodes}/{gpu}", {"metadata": {"labels": {"gpuslice.dev/mode": "device-plugin"}}}
        )
        notes = " ".join(helm(helm_bin, *install, *mine).stdout.split())
        assert "WARNING: none of the cluster's" in notes, notes
        assert "kubectl label node <node> nvidia.com/gpu.present=true" in notes
        # without a cluster (a client dry run) nothing is looked up: the instruction only
        offline = helm(helm_bin, *install[:5], "--dry-run=client", *mine).stdout
        assert "nvidia.com/gpu.present=true" in offline, offline
        assert "nodes are selected" not in offline and "WARNING" not in offline
    finally:
        for name in (gpu, plain):
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(f"{nodes}/{name}")
