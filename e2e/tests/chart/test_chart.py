"""The Helm chart charts/gpuslice (tier 3 of docs/architecture.md, "Testing tiers";
docs/helm.md, "Tests").

Without a cluster: `helm lint` (also --strict), `helm template` for every supported Kubernetes
minor and both NVML backends, the schema refusing typos, every container's environment checked
against the service's own CLI (each flag set through its variable, each value accepted), the
DeviceClasses and MIG layouts equal to e2e/manifests/, and node-setup (gpuslice-node-setup: fake
NVML config, the static CDI hook, the enforcer's socket link) run for real.

Against the sandbox's real API server: every rendered object applied with a server-side dry run
(strict field validation), the DeviceClasses created for real in every resource.k8s.io version
(their CEL compiled by the API server), and a real `helm install` whose RBAC and admission
policies allow exactly the calls the services make, from their own node only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from e2e.sandbox.binaries import REPO_ROOT
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent.testing import unique, wait_for
from e2e.support.chart import (
    CHART,
    NOT_FLAGS,
    Obj,
    allowed,
    containers,
    daemonset,
    env_of,
    every_name,
    find,
    flag_variables,
    helm,
    one,
    pod_spec,
    render,
    set_json,
    sets,
)
from gpuslice_controller.cli import build_parser as controller_parser
from gpuslice_core import nodesetup
from gpuslice_device_plugin.cli import build_parser as device_plugin_parser
from gpuslice_enforcer.cli import build_parser as enforcer_parser
from gpuslice_kube.client import new_api_client
from gpuslice_kube.errors import KubeError, KubeNotFoundError
from gpuslice_kube.raw import RawApi, resource_path
from gpuslice_kubelet_plugin.cli import build_parser as kubelet_plugin_parser
from gpuslice_mig_manager.cli import build_parser as mig_manager_parser
from gpuslice_nvml.fake import FakeNvml
from gpuslice_testkit.enforcer import go_hook, hook_missing

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)

MANIFESTS = REPO_ROOT / "e2e" / "manifests"
#: gpuslice-node-setup as the chart runs it, from the sources this test imports.
NODE_SETUP = [sys.executable, "-m", nodesetup.__name__]
NODE_SETUP_PATH = str(Path(nodesetup.__file__).parents[2])
DRIVER = "gpu.gpuslice.dev"
RESOURCE = "resource.k8s.io/v1"
KUBE_MINORS = ("1.34", "1.35", "1.36", "1.37")
NODE_EXTRA = "Impersonate-Extra-authentication.kubernetes.io%2fnode-name"


# ---- lint and template ------------------------------------------------------------------------

#: The node services' health servers (gpuslice_core.health): container, port, port name.
HEALTH_PORTS = (
    ("kubelet-plugin", 9410, "plugin-health"),
    ("enforcer", 9412, "enforcer-health"),
    ("mig-manager", 9413, "mig-health"),
)


def assert_http_probes(c: Obj, port: int, port_name: str) -> None:
    """Liveness /healthz, readiness and start-up /readyz, httpGet on the container's health
    port, which GPUSLICE_HEALTH_ADDR names and the container declares; no exec probe."""
    name = c["name"]
    paths = {"startupProbe": "/readyz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in paths.items():
        assert c[probe]["httpGet"] == {"path": path, "port": port}, f"{name} {probe}"
        assert "exec" not in c[probe], f"{name} {probe}"
    assert env_of(c)["GPUSLICE_HEALTH_ADDR"] == f":{port}", name
    assert {"name": port_name, "containerPort": port, "protocol": "TCP"} in c["ports"], name


def test_lint_passes_also_strict(helm_bin: Path) -> None:
    for args in ([], ["--strict"], ["--strict", "--set", "nvml.backend=fake"]):
        out = helm(helm_bin, "lint", str(CHART), *args, check=False)
        assert out.returncode == 0, f"helm lint {args}:\n{out.stdout}\n{out.stderr}"
        assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("backend", ["real", "fake"])
@pytest.mark.parametrize("minor", KUBE_MINORS)
def test_renders_for_each_kubernetes_minor_and_backend(
    helm_bin: Path, minor: str, backend: str
) -> None:
    objs = render(helm_bin, "--kube-version", minor, "--set", f"nvml.backend={backend}")
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == sorted(
        [
            "APIService",  # kubectl get gpus (docs/view-api.md)
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "Deployment",  # the controller
            "DeviceClass",
            "MutatingWebhookConfiguration",
            "Pod",  # helm test's validation pod
            "PodDisruptionBudget",
            "ResourceClaimTemplate",  # ... and its claim
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingWebhookConfiguration",
        ]
    )
    gpu = one(objs, "DeviceClass", "gpu.gpuslice.dev")
    assert gpu["apiVersion"] == RESOURCE
    mapped = int(minor.split(".")[1]) >= 36
    assert ("extendedResourceName" in gpu["spec"]) == mapped, minor

    ds = daemonset(objs)
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    spec = pod_spec(objs)
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["hostPID"] is True
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert [c["name"] for c in spec["initContainers"]] == ["node-setup", "enforcer", "mig-manager"]
    assert [c["name"] for c in spec["containers"]] == ["kubelet-plugin"]
    byname = containers(objs)
    for name in ("enforcer", "mig-manager"):  # native sidecars
        assert byname[name]["restartPolicy"] == "Always"
    plugin = byname["kubelet-plugin"]
    env = env_of(plugin)
    assert env["GPUSLICE_POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["GPUSLICE_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["GPUSLICE_NVML"] == backend
    assert plugin["securityContext"] == {"privileged": True}
    # httpGet on each service's own health server: no probe starts an interpreter
    for name, port, port_name in HEALTH_PORTS:
        c = byname[name]
        assert_http_probes(c, port, port_name)
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert {
        "/var/lib/kubelet/plugins_registry",
        f"/var/lib/kubelet/plugins/{DRIVER}",
        "/var/run/cdi",
        "/var/lib/gpuslice/kubelet-plugin",
        "/var/run/gpuslice",
    } <= host_paths
    fake_maps = find(objs, "ConfigMap", "gpuslice-fake-nvml")
    assert len(fake_maps) == (1 if backend == "fake" else 0)
    if backend == "fake":
        assert "runtimeClassName" not in spec
        assert "/var/lib/gpuslice/fake-nvml" in host_paths
    else:
        assert "NVIDIA_VISIBLE_DEVICES" in env


def test_kubernetes_older_than_1_32_is_refused(helm_bin: Path) -> None:
    out = helm(helm_bin, "template", "x", str(CHART), "--kube-version", "1.31", check=False)
    assert out.returncode != 0
    assert ">=1.32.0-0" in out.stderr, out.stderr


def test_update_strategy_is_seamless_where_the_kubelet_allows_it(helm_bin: Path) -> None:
    def strategy(*args: str) -> Obj:
        found: Obj = daemonset(render(helm_bin, *args))["spec"]["updateStrategy"]
        return found

    surge = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert strategy("--kube-version", "1.33") == surge
    # kubelets before 1.33 keep one plugin per driver: never two pods on a node
    assert strategy("--kube-version", "1.32") == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert strategy(*sets("node.updateStrategy.type=OnDelete")) == {"type": "OnDelete"}


def test_device_class_version_and_mapping_can_be_chosen(helm_bin: Path) -> None:
    for version in ("resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1"):
        objs = render(helm_bin, "--set", f"deviceClasses.apiVersion={version}")
        assert {o["apiVersion"] for o in find(objs, "DeviceClass")} == {version}
    on_old = render(
        helm_bin, "--kube-version", "1.34", "--set", "deviceClasses.extendedResourceMapping=true"
    )
    assert one(on_old, "DeviceClass", "gpu.gpuslice.dev")["spec"]["extendedResourceName"]
    off_new = render(
        helm_bin, "--kube-version", "1.37", "--set", "deviceClasses.extendedResourceMapping=false"
    )
    assert "extendedResourceName" not in one(off_new, "DeviceClass", "gpu.gpuslice.dev")["spec"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "kubeletPlugin.enabeld=false"], "enabeld"),
        (["--set", "nodeSelector.gpu=true"], "nodeSelector"),  # belongs under node:
        (["--set", "nvml.backend=gpu"], "backend"),
        (["--set", "enforcer.memoryAction=freeze"], "memoryAction"),
        (["--set", "deviceClasses.extendedResourceMapping=yes"], "extendedResourceMapping"),
        (["--set", "hostPaths.cdiRoot=var/run/cdi"], "cdiRoot"),
        (["--set", "migManager.metrics.port=70000"], "port"),
        (["--set", "logFormat=console"], "logFormat"),
        (["--set", "kubeletPlugin.logFormat=json"], "logFormat"),  # one value for all now
    ],
)
def test_schema_refuses_typos_and_bad_values(
    helm_bin: Path, args: list[str], expected: str
) -> None:
    out = helm(helm_bin, "template", "x", str(CHART), *args, check=False)
    assert out.returncode != 0, f"{args} was accepted"
    assert "schema" in out.stderr and expected in out.stderr, out.stderr


@pytest.mark.parametrize("log_format", ["json", "text", None])
def test_every_service_logs_in_the_one_log_format(helm_bin: Path, log_format: str | None) -> None:
    objs = render(helm_bin, *(sets(f"logFormat={log_format}") if log_format else []))
    wanted = log_format or "json"  # the default: klog's JSON keys
    services = {
        f"{component}/{name}": env_of(container).get("GPUSLICE_LOG_FORMAT")
        for component in ("node", "device-plugin")
        for name, container in containers(objs, component).items()
        if name != "node-setup"  # a one-shot script, not a service
    }
    assert services.keys() >= {
        "node/enforcer",
        "node/kubelet-plugin",
        "device-plugin/device-plugin",
    }
    assert set(services.values()) == {wanted}, services
    [controller] = [
        c
        for d in find(objs, "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] == "controller"
    ]
    assert env_of(controller)["GPUSLICE_LOG_FORMAT"] == wanted


@pytest.mark.parametrize(
    "make_parser",
    [
        controller_parser,
        kubelet_plugin_parser,
        enforcer_parser,
        mig_manager_parser,
        device_plugin_parser,
    ],
)
def test_every_service_takes_the_charts_log_format(
    make_parser: Callable[[], argparse.ArgumentParser],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The values the schema allows are the ones every service accepts (one shared flag)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    allowed_formats = schema["properties"]["logFormat"]["enum"]
    assert allowed_formats == ["json", "text"]
    assert make_parser().parse_args([]).log_format == "json"
    for value in allowed_formats:
        monkeypatch.setenv("GPUSLICE_LOG_FORMAT", value)
        assert make_parser().parse_args([]).log_format == value
    monkeypatch.delenv("GPUSLICE_LOG_FORMAT")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--log-format=console"])
    assert "invalid choice: 'console'" in capsys.readouterr().err


def test_components_and_options_can_be_switched(helm_bin: Path) -> None:
    off = render(
        helm_bin,
        *sets(
            "enforcer.enabled=false",
            "migManager.enabled=false",
            "kubeletPlugin.metrics.enabled=false",
            "controller.enabled=false",
        ),
    )
    spec = pod_spec(off)
    assert "hostPID" not in spec
    assert [c["name"] for c in spec["initContainers"]] == ["node-setup"]
    plugin = containers(off)["kubelet-plugin"]
    assert plugin["args"] == ["--metrics-addr="]
    assert (
        not {
            "GPUSLICE_ENFORCER_SOCKET",
            "GPUSLICE_MIG_MANAGER_SOCKET",
            "GPUSLICE_METRICS_ADDR",
        }
        & env_of(plugin).keys()
    )
    assert env_of(plugin)["GPUSLICE_DYNAMIC_MIG"] == "false"
    # without the MIG manager only the Events Role (the kubelet plugin's refusal) is left
    assert [r["metadata"]["name"] for r in find(off, "Role")] == ["gpuslice-node-gpuslice-events"]
    assert not find(off, "Service")
    assert [p["metadata"]["name"] for p in find(off, "ValidatingAdmissionPolicy")] == [
        "gpuslice-node-resourceslices",
        "gpuslice-node-device-plugin-nodes",  # the device plugin's own Node only
    ]
    no_dp = render(helm_bin, *sets("devicePlugin.enabled=false", "migManager.enabled=false"))
    assert [p["metadata"]["name"] for p in find(no_dp, "ValidatingAdmissionPolicy")] == [
        "gpuslice-node-resourceslices"
    ]
    assert not find(
        render(helm_bin, *sets("rbac.nodeScopedPolicies=false")), "ValidatingAdmissionPolicy"
    )

    sidecars_only = render(helm_bin, "--set", "kubeletPlugin.enabled=false")
    assert [c["name"] for c in pod_spec(sidecars_only)["containers"]] == ["pause"]
    assert not find(sidecars_only, "ValidatingAdmissionPolicy", "gpuslice-node-resourceslices")

    tuned = render(
        helm_bin,
        *sets(
            "migManager.dynamic=true",
            "enforcer.hook.enabled=false",
            "nvml.driverRoot=/run/nvidia/driver",
            "nvml.runtimeClassName=nvidia",
            "metrics.serviceMonitor.enabled=true",
        ),
    )
    byname = containers(tuned)
    assert env_of(byname["kubelet-plugin"])["GPUSLICE_DYNAMIC_MIG"] == "true"
    assert env_of(byname["mig-manager"])["GPUSLICE_DYNAMIC_MIG"] == "true"
    assert byname["enforcer"]["args"] == ["--hook-path="]
    assert "GPUSLICE_HOOK_INSTALL_DIR" not in env_of(byname["node-setup"])
    assert pod_spec(tuned)["runtimeClassName"] == "nvidia"
    # the driver root is mounted at /driver-root and its host path handed over for CDI specs
    mounts = {m["mountPath"]: m for m in byname["kubelet-plugin"]["volumeMounts"]}
    assert mounts["/driver-root"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod_spec(tuned)["volumes"]}
    assert volumes[mounts["/driver-root"]["name"]]["hostPath"]["path"] == "/run/nvidia/driver"
    env = env_of(byname["kubelet-plugin"])
    assert (env["GPUSLICE_DRIVER_ROOT"], env["GPUSLICE_DRIVER_ROOT_HOST"]) == (
        "/driver-root",
        "/run/nvidia/driver",
    )
    # a driver installed on the host: its "/" too (the libraries' host paths), read-only
    plain = containers(render(helm_bin))["kubelet-plugin"]
    assert {m["mountPath"]: m.get("readOnly") for m in plain["volumeMounts"]}["/driver-root"]
    assert env_of(plain)["GPUSLICE_DRIVER_ROOT_HOST"] == "/"
    fake = containers(render(helm_bin, *sets("nvml.backend=fake")))["kubelet-plugin"]
    assert "/driver-root" not in {m["mountPath"] for m in fake["volumeMounts"]}
    assert "GPUSLICE_DRIVER_ROOT_HOST" not in env_of(fake)
    monitor = one(tuned, "ServiceMonitor", "gpuslice-node")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [
        "plugin",
        "enforcer",
        "mig-manager",
    ]

    anywhere = pod_spec(render(helm_bin, *sets("node.affinity=null", "node.tolerations=null")))
    assert "affinity" not in anywhere and "tolerations" not in anywhere

    named = render(
        helm_bin,
        *sets("nvml.backend=fake"),
        *set_json("nvml.fakeConfig", "name: lab-node\ngpus:\n  - model: L4\n"),
    )
    node_yaml = yaml.safe_load(one(named, "ConfigMap", "gpuslice-fake-nvml")["data"]["node.yaml"])
    assert node_yaml == {"name": "lab-node", "gpus": [{"model": "L4"}], "statePath": "state.json"}
    assert env_of(containers(named)["node-setup"])["GPUSLICE_FAKE_NVML_SET_NAME"] == "false"


CONTROLLER_KINDS = {
    "Deployment",
    "MutatingWebhookConfiguration",
    "PodDisruptionBudget",
    "ValidatingWebhookConfiguration",
}


def test_the_controller_is_on_by_default_with_its_own_certificates(helm_bin: Path) -> None:
    objs = render(helm_bin)
    name = "gpuslice-controller"
    deployment = one(objs, "Deployment", name)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].endswith("/gpuslice-controller:0.1.0"), container["image"]
    env = env_of(container)
    assert env["GPUSLICE_MANAGE_CERTIFICATES"] == "true"  # no cert-manager needed
    assert env["GPUSLICE_CERT_HOSTS"] == f"{name}.gpuslice.svc,{name}.gpuslice.svc.cluster.local"
    for kind, path in (
        ("ValidatingWebhookConfiguration", "/validate"),
        ("MutatingWebhookConfiguration", "/mutate"),
    ):
        [hook] = one(objs, kind, name)["webhooks"]
        service = hook["clientConfig"]["service"]
        assert (service["name"], service["namespace"], service["path"]) == (name, "gpuslice", path)
        assert "caBundle" not in hook["clientConfig"]
        # claims fail open (prepare checks the same config); dialect pods fail closed (created
        # untranslated they would only wait for resources nothing serves)
        policy = "Ignore" if kind.startswith("Validating") else "Fail"
        assert hook["failurePolicy"] == policy, kind
    assert not find(objs, "Certificate") and not find(objs, "Issuer")

    off = render(helm_bin, "--set", "controller.enabled=false")
    assert not {o["kind"] for o in off} & CONTROLLER_KINDS
    assert not [o for o in off if name in o["metadata"]["name"]]


def rule_set(role: Obj) -> set[tuple[str, str, str, str]]:
    """(group, resource, verb, name or "") for every grant of a Role or ClusterRole."""
    return {
        (group, resource, verb, name)
        for rule in role["rules"]
        for group in rule.get("apiGroups", [""])
        for resource in rule.get("resources", [])
        for verb in rule["verbs"]
        for name in rule.get("resourceNames") or [""]
    }


CONTROLLER_CLUSTER_RULES = {
    ("resource.k8s.io", "resourceslices", "list", ""),
    ("resource.k8s.io", "resourceslices", "watch", ""),
    *(("resource.k8s.io", "resourceclaimtemplates", v, "") for v in ("get", "list", "watch")),
    ("resource.k8s.io", "resourceclaimtemplates", "create", ""),
}
CONTROLLER_VIEW_RULES = {
    *(
        (group, resource, verb, "")
        for group, resource in (
            ("resource.k8s.io", "resourceclaims"),
            ("resource.k8s.io", "deviceclasses"),
            ("resource.k8s.io", "devicetaintrules"),
            ("", "pods"),
        )
        for verb in ("list", "watch")
    ),
    ("authentication.k8s.io", "tokenreviews", "create", ""),
    ("authorization.k8s.io", "subjectaccessreviews", "create", ""),
    ("", "events", "create", ""),
    ("", "events", "patch", ""),
}
CONTROLLER_LABEL_RULES = {
    ("resource.k8s.io", "resourceclaims", v, "") for v in ("list", "watch", "patch")
}
#: the aggregated API's APIService, by name: the leader keeps its caBundle (docs/view-api.md)
CONTROLLER_APISERVICE_RULES = {
    ("apiregistration.k8s.io", "apiservices", v, "v1alpha1.view.gpuslice.dev")
    for v in ("get", "list", "watch", "update")
}
CONTROLLER_WEBHOOK_RULES = {
    (
        "admissionregistration.k8s.io",
        f"{kind}webhookconfigurations",
        verb,
        "gpuslice-controller",
    )
    for kind in ("validating", "mutating")
    for verb in ("get", "list", "watch", "update")  # list/watch: by name (field selector)
}


def test_controller_rbac_is_exactly_its_calls(helm_bin: Path) -> None:
    """The controller's ClusterRole grants what its code calls and nothing more (docs/helm.md,
    "RBAC"); the cluster view's grants go with ``controller.clusterView.enabled``."""
    name = "gpuslice-controller"
    role = one(render(helm_bin), "ClusterRole", name)
    assert rule_set(role) == CONTROLLER_CLUSTER_RULES | CONTROLLER_VIEW_RULES | (
        CONTROLLER_WEBHOOK_RULES | CONTROLLER_LABEL_RULES | CONTROLLER_APISERVICE_RULES
    )
    no_view = render(helm_bin, *sets("controller.clusterView.enabled=false"))
    assert rule_set(one(no_view, "ClusterRole", name)) == CONTROLLER_CLUSTER_RULES | (
        CONTROLLER_WEBHOOK_RULES | CONTROLLER_LABEL_RULES
    )
    [container] = one(no_view, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["GPUSLICE_CLUSTER_VIEW"] == "false"
    # the claims' node labels (what each node's claim cache watches) go with their flag, and
    # the kubelet plugin's cache with them
    plain = render(
        helm_bin,
        *sets("controller.clusterView.enabled=false", "controller.claimNodeLabels=false"),
    )
    assert rule_set(one(plain, "ClusterRole", name)) == CONTROLLER_CLUSTER_RULES | (
        CONTROLLER_WEBHOOK_RULES
    )
    [container] = one(plain, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["GPUSLICE_CLAIM_NODE_LABELS"] == "false"
    assert env_of(containers(plain)["kubelet-plugin"])["GPUSLICE_CLAIM_CACHE"] == "false"
    assert env_of(containers(render(helm_bin))["kubelet-plugin"])["GPUSLICE_CLAIM_CACHE"] == "true"
    no_controller = render(helm_bin, *sets("controller.enabled=false"))
    assert env_of(containers(no_controller)["kubelet-plugin"])["GPUSLICE_CLAIM_CACHE"] == "false"
    # Who may read the view: a ClusterRole to bind, for the virtual resource the controller's
    # SubjectAccessReview asks about.
    view = one(render(helm_bin), "ClusterRole", "gpuslice-view")
    assert rule_set(view) == {("gpu.gpuslice.dev", "gpus", "get", "")}
    assert not find(no_view, "ClusterRole", "gpuslice-view")
    # In its namespace: its Secret and its Lease by name; only create (which cannot be named:
    # the name is in the body) is unnamed, and reads no Secret.
    secret, lease = f"{name}-tls", name
    role = one(render(helm_bin), "Role", name)
    assert rule_set(role) == {
        *(("", "secrets", v, secret) for v in ("get", "list", "watch", "update")),
        ("", "secrets", "create", ""),
        ("coordination.k8s.io", "leases", "create", ""),
        *(("coordination.k8s.io", "leases", v, lease) for v in ("get", "update", "patch")),
    }
    cert_manager = render(helm_bin, *sets("controller.certificates.certManager=true"))
    assert {r for r in rule_set(one(cert_manager, "Role", name)) if r[1] == "secrets"} == {
        ("", "secrets", v, secret) for v in ("list", "watch")
    }
    # with cert-manager it only watches them: readiness waits for the injected bundle
    watch_only = {
        r
        for r in CONTROLLER_WEBHOOK_RULES | CONTROLLER_APISERVICE_RULES
        if r[2] in ("list", "watch")
    }
    assert rule_set(one(cert_manager, "ClusterRole", name)) == (
        CONTROLLER_CLUSTER_RULES | CONTROLLER_VIEW_RULES | watch_only | CONTROLLER_LABEL_RULES
    )
    # it keeps (and waits for) only the configurations the chart creates
    env = env_of(one(cert_manager, "Deployment", name)["spec"]["template"]["spec"]["containers"][0])
    assert (env["GPUSLICE_VALIDATING_WEBHOOKS"], env["GPUSLICE_MUTATING_WEBHOOKS"]) == (name, name)
    no_pods = render(helm_bin, *sets("controller.webhook.pods.enabled=false"))
    [container] = one(no_pods, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    assert (
        env_of(container)["GPUSLICE_VALIDATING_WEBHOOKS"],
        env_of(container)["GPUSLICE_MUTATING_WEBHOOKS"],
    ) == (
        name,
        "",
    )


def test_the_aggregated_api_is_on_by_default_complete_and_can_be_left_out(
    helm_bin: Path,
) -> None:
    """controller.aggregatedApi.enabled (docs/view-api.md), on by default: the APIService at the
    controller's Service without a caBundle (the leader publishes it, readiness waits for it:
    the controller's --apiservices), the controller's delegated-auth bindings and its rights on
    that APIService by name, and get/list/watch on gpus aggregated into view, edit and admin.
    Turned off, none of it is rendered."""
    name, apiservice = "gpuslice-controller", "v1alpha1.view.gpuslice.dev"
    off = render(helm_bin, *sets("controller.aggregatedApi.enabled=false"))
    assert not find(off, "APIService")
    assert not [o for o in off if o["metadata"]["name"] == "gpuslice-gpus"]
    [container] = one(off, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["GPUSLICE_AGGREGATED_API"] == "false"
    assert env_of(container)["GPUSLICE_APISERVICES"] == ""

    objs = render(helm_bin)
    spec = one(objs, "APIService", apiservice)["spec"]
    assert spec["service"] == {"namespace": "gpuslice", "name": name, "port": 443}
    assert (spec["group"], spec["version"]) == ("view.gpuslice.dev", "v1alpha1")
    assert spec["insecureSkipTLSVerify"] is False and "caBundle" not in spec
    [container] = one(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    assert (env["GPUSLICE_AGGREGATED_API"], env["GPUSLICE_APISERVICES"]) == ("true", apiservice)
    rules = rule_set(one(objs, "ClusterRole", name))
    by_name = {r for r in rules if r[0] == "apiregistration.k8s.io"}
    assert by_name == {
        ("apiregistration.k8s.io", "apiservices", verb, apiservice)
        for verb in ("get", "list", "watch", "update")
    }
    delegator = one(objs, "ClusterRoleBinding", f"{name}:system:auth-delegator")
    assert delegator["roleRef"]["name"] == "system:auth-delegator"
    reader = one(objs, "RoleBinding", f"{name}:extension-apiserver-authentication-reader")
    assert reader["metadata"]["namespace"] == "kube-system"
    assert reader["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "extension-apiserver-authentication-reader",
    }
    for binding in (delegator, reader):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": name, "namespace": "gpuslice"}
        ]
    gpus = one(objs, "ClusterRole", "gpuslice-gpus")
    assert rule_set(gpus) == {
        ("view.gpuslice.dev", r, v, "")
        for r in ("gpus", "gpuclaims")
        for v in ("get", "list", "watch")
    } | {
        ("view.gpuslice.dev", "gpureasons", "get", ""),
        ("apiregistration.k8s.io", "apiservices", "get", "v1alpha1.view.gpuslice.dev"),
    }
    labels = gpus["metadata"]["labels"]
    for role in ("view", "edit", "admin"):
        assert labels[f"rbac.authorization.k8s.io/aggregate-to-{role}"] == "true"

    # with cert-manager its injector fills the caBundle, and the controller only watches
    managed = render(
        helm_bin,
        *sets("controller.aggregatedApi.enabled=true", "controller.certificates.certManager=true"),
    )
    annotations = one(managed, "APIService", apiservice)["metadata"]["annotations"]
    assert annotations == {"cert-manager.io/inject-ca-from": f"gpuslice/{name}"}
    rules = rule_set(one(managed, "ClusterRole", name))
    assert {r[2] for r in rules if r[0] == "apiregistration.k8s.io"} == {"list", "watch"}

    # it serves the cluster view: without the view, no aggregated API either
    no_view = render(helm_bin, *sets("controller.clusterView.enabled=false"))
    assert not find(no_view, "APIService")
    [container] = one(no_view, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["GPUSLICE_AGGREGATED_API"] == "false"


def test_grafana_dashboard_is_off_by_default_and_queries_the_controllers_metrics(
    helm_bin: Path,
) -> None:
    assert not find(render(helm_bin), "ConfigMap", "gpuslice-grafana-dashboard")
    objs = render(helm_bin, *sets("grafanaDashboard.enabled=true", "grafanaDashboard.labels.x=y"))
    config = one(objs, "ConfigMap", "gpuslice-grafana-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["labels"]["x"] == "y"
    dashboard = json.loads(config["data"]["gpuslice-gpus.json"])
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    # the same file hack/tests/test_metric_names.py checks against what the controller exports
    assert exprs == [
        t["expr"]
        for panel in json.loads((CHART / "files" / "grafana-dashboard.json").read_text())["panels"]
        for t in panel["targets"]
    ]
    # The per-claim panels read series that only /view/metrics serves (authorized); each says
    # so, and the $namespace variable is the claims' own label (the ServiceMonitor honors it).
    claim_panels = [
        p for p in dashboard["panels"] if any("gpuslice_claim_" in t["expr"] for t in p["targets"])
    ]
    assert claim_panels
    assert all("/view/metrics" in p.get("description", "") for p in claim_panels)


def test_controller_metrics_are_scraped_at_both_doors(helm_bin: Path) -> None:
    """The open /metrics (no tenant data) over HTTP; the per-claim series at /view/metrics
    over HTTPS with Prometheus's own token, the controller's CA and the claims' namespace
    label kept (issue 27). Prometheus's ServiceAccount gets the view through
    controller.clusterView.readers."""
    name = "gpuslice-controller"
    readers = [
        {"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"},
        {"kind": "Group", "name": "sre"},
    ]
    objs = render(
        helm_bin,
        *sets("metrics.serviceMonitor.enabled=true"),
        *set_json("controller.clusterView.readers", readers),
    )
    monitor = one(objs, "ServiceMonitor", name)
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "controller"
    )
    plain, claims = monitor["spec"]["endpoints"]
    assert (plain["port"], plain["path"]) == ("metrics", "/metrics") and "scheme" not in plain
    # The per-GPU series name the GPU's node as Hostname; it wins over the controller's own.
    assert plain["honorLabels"] is True
    hostname = [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "Hostname"}]
    assert plain["relabelings"] == hostname
    # the per-claim series are about tenants' claims: the controller pod's own labels never
    # stand in for a claim's (a pending claim has no Hostname; no claim is the controller pod)
    assert claims["relabelings"] == [
        {"action": "labeldrop", "regex": "(pod|container|namespace|service)"}
    ]
    assert (claims["port"], claims["scheme"], claims["path"]) == (
        "webhook",
        "https",
        "/view/metrics",
    )
    assert claims["honorLabels"] is True
    assert claims["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert claims["tlsConfig"] == {
        "serverName": f"{name}.gpuslice.svc",
        "ca": {"secret": {"name": f"{name}-tls", "key": "ca.crt"}},
    }
    service = one(objs, "Service", name)
    assert {p["name"] for p in service["spec"]["ports"]} == {"webhook", "metrics"}
    binding = one(objs, "ClusterRoleBinding", "gpuslice-view")
    assert binding["roleRef"]["name"] == "gpuslice-view"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"},
        {"kind": "Group", "name": "sre", "apiGroup": "rbac.authorization.k8s.io"},
    ]
    assert not find(render(helm_bin), "ClusterRoleBinding", "gpuslice-view")  # none by default
    no_view = render(
        helm_bin,
        *sets("metrics.serviceMonitor.enabled=true", "controller.clusterView.enabled=false"),
    )
    assert [e["path"] for e in one(no_view, "ServiceMonitor", name)["spec"]["endpoints"]] == [
        "/metrics"
    ]
    no_metrics = render(
        helm_bin, *sets("metrics.serviceMonitor.enabled=true", "controller.metrics.enabled=false")
    )
    assert not find(no_metrics, "ServiceMonitor", name)


NVML_CONTAINERS = {
    "node": ("kubelet-plugin", "enforcer", "mig-manager"),
    "device-plugin": ("device-plugin", "enforcer"),
}


@pytest.mark.parametrize("driver_root", ["/", "/run/nvidia/driver"])
def test_with_the_real_backend_every_nvml_container_loads_nvml_from_the_driver_root(
    helm_bin: Path, driver_root: str
) -> None:
    """The node pods need no NVIDIA Container Toolkit: every container that opens NVML has the
    host's driver root read-only at /driver-root and is told to load libnvidia-ml from it, and
    each service accepts the variable as its --driver-root."""
    objs = render(
        helm_bin,
        *sets(
            f"nvml.driverRoot={driver_root}",
            "devicePlugin.enabled=true",
            "devicePlugin.enforcer.enabled=true",
        ),
    )
    parsers = {
        "kubelet-plugin": kubelet_plugin_parser,
        "enforcer": enforcer_parser,
        "mig-manager": mig_manager_parser,
        "device-plugin": device_plugin_parser,
    }
    for component, names in NVML_CONTAINERS.items():
        byname = containers(objs, component)
        volumes = {v["name"]: v for v in pod_spec(objs, component)["volumes"]}
        for name in names:
            mounts = {m["mountPath"]: m for m in byname[name]["volumeMounts"]}
            assert mounts["/driver-root"]["readOnly"] is True, (component, name)
            assert mounts["/driver-root"]["mountPropagation"] == "HostToContainer"
            volume = volumes[mounts["/driver-root"]["name"]]
            assert volume["hostPath"] == {"path": driver_root, "type": "Directory"}
            assert env_of(byname[name])["GPUSLICE_DRIVER_ROOT"] == "/driver-root", (component, name)
            with pytest.MonkeyPatch.context() as m:
                m.setenv("GPUSLICE_DRIVER_ROOT", "/driver-root")
                assert parsers[name]().parse_args([]).driver_root == Path("/driver-root")
    # the fake backend mounts no driver root anywhere
    fake = render(
        helm_bin,
        *sets(
            "nvml.backend=fake", "devicePlugin.enabled=true", "devicePlugin.enforcer.enabled=true"
        ),
    )
    for component in NVML_CONTAINERS:
        assert "driver-root" not in {v["name"] for v in pod_spec(fake, component)["volumes"]}


# ---- sync with the services and with e2e/manifests --------------------------------------------
CLI_PARSERS = {
    "kubelet-plugin": kubelet_plugin_parser,
    "enforcer": enforcer_parser,
    "mig-manager": mig_manager_parser,
}
# Flags the chart leaves to their defaults on purpose (docs/helm.md says why).
UNSET = {
    # in-cluster; empty by default; /proc (a driver root of files' proc/ in tests only)
    "kubelet-plugin": {"KUBECONFIG", "GPUSLICE_NVIDIA_CDI_KIND", "GPUSLICE_PROC_ROOT"},
    "enforcer": {"GPUSLICE_MPS_CONTROL"},  # empty: nvidia-cuda-mps-control or the fake's
    "mig-manager": {"KUBECONFIG", "GPUSLICE_CONFIG_FILE"},  # in-cluster; layouts from --config-map
}


@pytest.mark.parametrize("backend", ["real", "fake"])
def test_every_flag_is_set_through_its_variable_and_accepted_by_the_service(
    helm_bin: Path,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    objs = render(helm_bin, "--set", f"nvml.backend={backend}")
    byname = containers(objs)
    pod_uid = str(uuid.uuid4())
    for name, make_parser in CLI_PARSERS.items():
        container = byname[name]
        env = env_of(container)
        known = flag_variables(make_parser())
        unset = UNSET[name] | ({"GPUSLICE_FAKE_NVML_CONFIG"} if backend == "real" else set())
        if name == "kubelet-plugin" and backend == "fake":  # no driver root is mounted
            unset |= {"GPUSLICE_DRIVER_ROOT_HOST"}
        assert env.keys() - known <= NOT_FLAGS, f"{name}: not flags of the service"
        assert known - env.keys() == unset, f"{name}: flags the chart does not set"
        # The service parses the chart's environment and arguments without complaint.
        with monkeypatch.context() as m:
            for var in every_name(make_parser()) | NOT_FLAGS:
                m.delenv(var, raising=False)
            for var, value in env.items():
                if isinstance(value, dict):
                    path = value["fieldRef"]["fieldPath"]
                    value = pod_uid if path == "metadata.uid" else "node-a"
                m.setenv(var, str(value).replace("$(GPUSLICE_POD_UID)", pod_uid))
            try:
                args = make_parser().parse_args(container.get("args", []))
            except SystemExit:
                pytest.fail(f"{name} refuses the chart's settings: {capsys.readouterr().err}")
        if name == "kubelet-plugin":
            assert str(args.enforcer_socket) == f"/var/run/gpuslice/enforcer-{pod_uid}.sock"
            assert args.pod_uid == pod_uid and args.ignored_xids == {13, 31, 43, 45, 68, 109}
        if name == "enforcer":
            assert args.socket == f"/var/run/gpuslice/enforcer-{pod_uid}.sock"
            assert args.hook_socket == "/var/run/gpuslice/enforcer.sock"
            assert args.hook_path == "/var/lib/gpuslice/hook/bin/gpuslice-enforcer-hook"
        if name == "mig-manager":
            assert args.config_map == "gpuslice/gpuslice-mig-parted-config"
            assert args.socket == f"/var/run/gpuslice/mig-manager-{pod_uid}.sock"


MODE = {"key": "gpuslice.dev/mode", "operator": "In", "values": ["device-plugin"]}
NOT_MODE = {"key": "gpuslice.dev/mode", "operator": "NotIn", "values": ["device-plugin"]}


def node_terms(spec: Obj) -> list[list[Obj]]:
    affinity = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [term["matchExpressions"] for term in affinity["nodeSelectorTerms"]]


def test_the_device_plugin_pods_are_scraped_through_a_pod_monitor(helm_bin: Path) -> None:
    """Its per-container series keep the workload's namespace and pod (honorLabels); its
    enforcer, when it runs one, is scraped from the same pods."""
    assert not find(render(helm_bin), "PodMonitor", "gpuslice-device-plugin")
    on = ("metrics.serviceMonitor.enabled=true",)
    monitor = one(render(helm_bin, *sets(*on)), "PodMonitor", "gpuslice-device-plugin")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["honorLabels"]) == (
        "device-plugin",
        "/metrics",
        True,
    )
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "device-plugin"
    )
    objs = render(helm_bin, *sets(*on, "devicePlugin.enforcer.enabled=true"))
    monitor = one(objs, "PodMonitor", "gpuslice-device-plugin")
    ports = {p["name"] for c in pod_spec(objs, "device-plugin")["containers"] for p in c["ports"]}
    ports |= {
        p["name"]
        for c in pod_spec(objs, "device-plugin").get("initContainers", [])
        for p in c.get("ports", [])
    }
    endpoints = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
    assert endpoints == ["device-plugin", "enforcer"] and set(endpoints) <= ports


@pytest.mark.parametrize("backend", ["real", "fake"])
def test_device_plugin_daemonset_runs_on_device_plugin_nodes_only(
    helm_bin: Path,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The per-node mode: the device plugin's affinity is the node DaemonSet's with the mode
    label required instead of excluded; every variable it sets is a flag of the service."""
    config = "version: v1\nflags:\n  migStrategy: single\n"
    objs = render(
        helm_bin,
        *sets(f"nvml.backend={backend}", "devicePlugin.deviceIDStrategy=index"),
        *set_json("devicePlugin.config", config),
    )
    ds = daemonset(objs, "device-plugin")
    assert ds["metadata"]["name"] == "gpuslice-device-plugin"
    spec = pod_spec(objs, "device-plugin")
    node_spec = pod_spec(objs)
    dp_terms, dra_terms = node_terms(spec), node_terms(node_spec)
    assert dp_terms and all(MODE in term for term in dp_terms)
    assert all(NOT_MODE in term for term in dra_terms)
    assert [[e for e in t if e != MODE] for t in dp_terms] == [
        [e for e in t if e != NOT_MODE] for t in dra_terms
    ]  # the same GPU-presence labels
    assert spec["tolerations"] == node_spec["tolerations"]
    # its own ServiceAccount: the mode check, the config label, sharing labels, Events
    assert spec["serviceAccountName"] == "gpuslice-device-plugin"
    byname = containers(objs, "device-plugin")
    plugin = byname["device-plugin"]
    assert plugin["securityContext"] == {"privileged": True}
    assert_http_probes(plugin, 9414, "dp-health")
    if "enforcer" in byname:  # devicePlugin.enforcer.enabled (MPS replicas)
        assert_http_probes(byname["enforcer"], 9412, "enforcer-health")
    assert {"name": "device-plugin", "containerPort": 9404, "protocol": "TCP"} in plugin["ports"]
    mounts = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert volumes["device-plugins"]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    config_map = one(objs, "ConfigMap", "gpuslice-device-plugin")
    assert config_map["data"]["config.yaml"] == config
    assert volumes["config"]["configMap"]["name"] == "gpuslice-device-plugin"
    if backend == "fake":  # the node DaemonSet's node-setup writes this node's fake GPUs
        setup_env = env_of(byname["node-setup"])
        node_setup_env = env_of(containers(objs)["node-setup"])
        assert {name: node_setup_env[name] for name in setup_env} == setup_env
        assert setup_env["GPUSLICE_FAKE_NVML_SET_NAME"] == "true"
        assert volumes["fake-nvml"]["hostPath"] == pod_volumes(node_spec)["fake-nvml"]["hostPath"]
    else:
        assert "initContainers" not in spec

    env = env_of(plugin)
    known = flag_variables(device_plugin_parser())
    assert env.keys() - known <= NOT_FLAGS, "not flags of the device plugin"
    with monkeypatch.context() as m:
        for var in every_name(device_plugin_parser()) | NOT_FLAGS:
            m.delenv(var, raising=False)
        for var, value in env.items():
            m.setenv(var, str(value))
        try:
            args = device_plugin_parser().parse_args(plugin.get("args", []))
        except SystemExit:
            pytest.fail(
                f"the device plugin refuses the chart's settings: {capsys.readouterr().err}"
            )
    assert args.device_plugins_dir == "/var/lib/kubelet/device-plugins"
    assert args.config_file == "/etc/gpuslice/device-plugin/config.yaml"
    assert args.device_id_strategy == "index" and args.mig_strategy is None
    assert args.nvml == backend
    # per-container metrics: the kubelet's pod resources socket, read-only, and host PIDs
    assert args.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert mounts["pod-resources"] == "/var/lib/kubelet/pod-resources"
    assert volumes["pod-resources"]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert spec["hostPID"] is True

    off = render(
        helm_bin, *sets("devicePlugin.enabled=false", "devicePlugin.metrics.enabled=false")
    )
    assert not [d for d in find(off, "DaemonSet") if "device-plugin" in d["metadata"]["name"]]
    quiet = containers(
        render(helm_bin, *sets("devicePlugin.metrics.enabled=false")), "device-plugin"
    )
    assert env_of(quiet["device-plugin"])["GPUSLICE_METRICS_ADDR"] == ""
    assert env_of(quiet["device-plugin"])["GPUSLICE_POD_RESOURCES_SOCKET"] == ""
    # no metrics port; the health port stays (the probes)
    assert [p["name"] for p in quiet["device-plugin"]["ports"]] == ["dp-health"]
    assert "pod-resources" not in {m["name"] for m in quiet["device-plugin"]["volumeMounts"]}
    no_pods = render(helm_bin, *sets("devicePlugin.containerMetrics.enabled=false"))
    assert "hostPID" not in pod_spec(no_pods, "device-plugin")
    assert (
        env_of(containers(no_pods, "device-plugin")["device-plugin"])[
            "GPUSLICE_POD_RESOURCES_SOCKET"
        ]
        == ""
    )


def pod_volumes(spec: Obj) -> dict[str, Obj]:
    return {v["name"]: v for v in spec["volumes"]}


def test_device_classes_equal_the_e2e_manifest(helm_bin: Path) -> None:
    manifest = [d for d in yaml.safe_load_all((MANIFESTS / "deviceclasses.yaml").read_text()) if d]
    for minor in ("1.35", "1.37"):
        rendered = find(render(helm_bin, "--kube-version", minor), "DeviceClass")
        assert [r["metadata"]["name"] for r in rendered] == [
            m["metadata"]["name"] for m in manifest
        ]
        for got, want in zip(rendered, manifest, strict=True):
            spec = dict(want["spec"])
            if minor == "1.35":  # no extended resource mapping before 1.36 (auto)
                spec.pop("extendedResourceName", None)
            assert (got["apiVersion"], got["kind"], got["spec"]) == (
                want["apiVersion"],
                want["kind"],
                spec,
            )
            assert want["metadata"]["labels"].items() <= got["metadata"]["labels"].items()


def test_mig_layouts_equal_the_e2e_manifest(helm_bin: Path) -> None:
    copy = (CHART / "files" / "mig-configs.yaml").read_bytes()
    assert copy == (MANIFESTS / "mig-configs.yaml").read_bytes(), (
        "charts/gpuslice/files/mig-configs.yaml differs from e2e/manifests/mig-configs.yaml: "
        "copy the manifest over the chart's file"
    )
    manifest = yaml.safe_load(copy)
    rendered = one(render(helm_bin), "ConfigMap", "gpuslice-mig-parted-config")
    assert rendered["data"] == manifest["data"]
    custom = "version: v1\nmig-configs:\n  none:\n    - devices: all\n      mig-enabled: false\n"
    objs = render(helm_bin, *set_json("migManager.layouts.config", custom))
    assert one(objs, "ConfigMap", "gpuslice-mig-parted-config")["data"]["config.yaml"] == custom


# ---- node-setup, run for real -----------------------------------------------------------------
def run_setup(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*NODE_SETUP, *args],
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": NODE_SETUP_PATH, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_fake_node_config_is_what_the_fake_nvml_accepts(helm_bin: Path, tmp_path: Path) -> None:
    objs = render(helm_bin, "--set", "nvml.backend=fake")
    src = tmp_path / "configmap" / "node.yaml"
    src.parent.mkdir()
    src.write_text(one(objs, "ConfigMap", "gpuslice-fake-nvml")["data"]["node.yaml"])
    setup = env_of(containers(objs)["node-setup"])
    uuids = []
    for node in ("gpu-node-a", "gpu-node-b"):
        dst = tmp_path / node / "node.yaml"
        out = run_setup(
            {
                "GPUSLICE_NODE_NAME": node,
                "GPUSLICE_FAKE_NVML_CONFIG_SRC": str(src),
                "GPUSLICE_FAKE_NVML_CONFIG": str(dst),
                "GPUSLICE_FAKE_NVML_SET_NAME": setup["GPUSLICE_FAKE_NVML_SET_NAME"],
            }
        )
        assert out.returncode == 0, out.stderr
        nvml = FakeNvml.from_config_file(dst)
        try:
            gpus = nvml.gpus()
            assert [g.name for g in gpus] == ["NVIDIA A100-SXM4-40GB"] * 2
            uuids.append({g.uuid for g in gpus})
        finally:
            nvml.close()
    assert not uuids[0] & uuids[1], "two nodes got the same GPU UUIDs"


@pytest.fixture(scope="module")
def static_hook() -> Path:
    """The static hook the enforcer image holds (hack/hook-binary.sh builds the same bytes)."""
    reason = hook_missing("go")
    if reason:
        pytest.skip(reason)
    return go_hook()


def _installed_runs(wrapper: Path) -> None:
    """The installed hook runs from an empty environment: a bad OCI state is refused (exit 2),
    which needs the whole program and no enforcer."""
    ran = subprocess.run(
        [str(wrapper), "attach", "--socket", "/nonexistent.sock", "--claim-uid", "c1"],
        input='{"ociVersion": "1.0.2", "pid": 4242}',
        env={},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (ran.returncode, ran.stderr) == (
        2,
        "gpuslice-enforcer-hook: the OCI state has no container id\n",
    )


def test_node_setup_installs_the_static_hook(static_hook: Path, tmp_path: Path) -> None:
    """One file, atomically replaced; nothing of the image's Python reaches the host. A hook that
    runs while it is replaced finishes with the file it started from."""
    install = tmp_path / "host" / "var-lib-gpuslice-hook"
    env = {"GPUSLICE_HOOK_BINARY": str(static_hook), "GPUSLICE_HOOK_INSTALL_DIR": str(install)}
    env["GPUSLICE_HOOK_HOST_DIR"] = "/var/lib/gpuslice/hook"
    out = run_setup(env)
    assert out.returncode == 0, out.stderr
    installed = install / "bin" / "gpuslice-enforcer-hook"
    assert "/var/lib/gpuslice/hook/bin/gpuslice-enforcer-hook is now the static hook" in out.stderr
    assert installed.read_bytes() == static_hook.read_bytes()
    assert installed.stat().st_mode & 0o777 == 0o755
    assert sorted(p.relative_to(install).as_posix() for p in install.rglob("*")) == [
        "bin",
        "bin/gpuslice-enforcer-hook",
    ]
    _installed_runs(installed)
    first = installed.stat().st_ino
    assert "is the static hook" in run_setup(env).stderr  # already there: left alone
    assert installed.stat().st_ino == first

    # a new release while a hook runs (it waits for an enforcer that is not there)
    running = subprocess.Popen(
        [str(installed), "detach", "--socket", str(tmp_path / "e.sock"), "--claim-uid", "c"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    newer = tmp_path / "newer"
    newer.write_bytes(static_hook.read_bytes() + b"\0release two")  # still the same program
    before = installed.stat().st_ino
    out = run_setup({**env, "GPUSLICE_HOOK_BINARY": str(newer)})
    assert out.returncode == 0, out.stderr
    assert installed.stat().st_ino != before and installed.read_bytes() == newer.read_bytes()
    _, stderr = running.communicate('{"id": "c"}', timeout=30)
    assert running.returncode == 1 and "UNAVAILABLE: no enforcer listened on" in stderr
    assert [p.name for p in (install / "bin").iterdir()] == ["gpuslice-enforcer-hook"]


def test_node_setup_replaces_the_python_hook_of_an_earlier_chart(
    static_hook: Path, tmp_path: Path
) -> None:
    """Earlier charts installed a wrapper and copies of the image's Python (releases/): the
    wrapper becomes the static hook (CDI specs written before name its path), the release it ran
    stays for a grace period, the others go at once, that one at the first install after it."""
    install = tmp_path / "opt-gpuslice"
    (install / "bin").mkdir(parents=True)
    for release in ("aaaa1111", "bbbb2222"):
        (install / "releases" / release / "python" / "bin").mkdir(parents=True)
    wrapper = install / "bin" / "gpuslice-enforcer-hook"
    wrapper.write_text("#!/bin/sh\nR='/opt/gpuslice/releases/bbbb2222'\nexec \"$R/python\"\n")
    env = {
        "GPUSLICE_HOOK_BINARY": str(static_hook),
        "GPUSLICE_HOOK_INSTALL_DIR": str(install),
        "GPUSLICE_HOOK_HOST_DIR": "/opt/gpuslice",
    }
    out = run_setup(env)
    assert out.returncode == 0, out.stderr
    assert wrapper.read_bytes() == static_hook.read_bytes()
    assert [p.name for p in (install / "releases").iterdir()] == ["bbbb2222"]
    assert "removed the Python hook release aaaa1111" in out.stderr
    previous = install / "bin" / ".previous-release"
    assert previous.read_text() == "bbbb2222\n"
    assert run_setup(env).returncode == 0  # within the grace: kept
    assert [p.name for p in (install / "releases").iterdir()] == ["bbbb2222"]
    os.utime(previous, (0, 0))  # the grace is over
    out = run_setup(env)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in install.iterdir()) == ["bin"]
    assert [p.name for p in (install / "bin").iterdir()] == ["gpuslice-enforcer-hook"]


def test_node_setup_refuses_what_is_not_the_static_hook(tmp_path: Path) -> None:
    script = tmp_path / "gpuslice-enforcer-hook"
    script.write_text("#!/usr/bin/env python3\n")
    env = {"GPUSLICE_HOOK_BINARY": str(script), "GPUSLICE_HOOK_INSTALL_DIR": str(tmp_path / "h")}
    out = run_setup({**env, "GPUSLICE_HOOK_HOST_DIR": "/var/lib/gpuslice/hook"})
    assert out.returncode == 1
    assert "is not the static hook binary" in out.stderr
    assert not (tmp_path / "h").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a noexec file system needs root")
def test_node_setup_says_so_where_the_hook_cannot_be_executed(
    static_hook: Path, tmp_path: Path
) -> None:
    """A hostDir on a noexec file system (Container-Optimized OS's /var) would fail every
    container with a share; node-setup stops instead, naming the cause."""
    install = tmp_path / "noexec"
    install.mkdir()
    script = f"mount -t tmpfs -o noexec,size=16m tmpfs {install} && exec {' '.join(NODE_SETUP)}"
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env={
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": NODE_SETUP_PATH,
            "GPUSLICE_HOOK_BINARY": str(static_hook),
            "GPUSLICE_HOOK_INSTALL_DIR": str(install),
            "GPUSLICE_HOOK_HOST_DIR": "/var/lib/gpuslice/hook",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    assert (
        "/var/lib/gpuslice/hook/bin/gpuslice-enforcer-hook cannot be run (Permission denied)"
        in (out.stderr)
    )
    assert "mounted noexec" in out.stderr


@contextlib.contextmanager
def listener(path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(4)
    try:
        yield sock
    finally:
        sock.close()


def test_node_setup_sweeps_dead_sockets_and_links_the_live_enforcer() -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="gs-run-", dir="/tmp"))  # short: socket path limit
    try:
        a, b, dead = (run_dir / f"enforcer-{uuid.uuid4()}.sock" for _ in range(3))
        link = run_dir / "enforcer.sock"
        dead_attach = dead.with_name(dead.name + ".attach")  # the enforcer's hook socket
        with listener(dead), listener(dead_attach):
            pass  # closed without unlink: a pod killed with SIGKILL
        with listener(a), listener(b) as sock_b:
            assert run_setup({"GPUSLICE_SOCKET_DIR": str(run_dir)}).returncode == 0
            assert not dead.exists() and not dead_attach.exists()
            assert a.exists() and b.exists()

            def hook_socket(own: Path, action: str) -> None:
                env = {"GPUSLICE_SOCKET": str(own), "GPUSLICE_HOOK_SOCKET": str(link)}
                out = run_setup(env, "hook-socket", action)
                assert out.returncode == 0, out.stderr

            hook_socket(a, "claim")  # the old pod's enforcer
            hook_socket(b, "claim")  # the new pod's enforcer takes over
            assert link.readlink().name == b.name
            hook_socket(a, "release")  # the old pod stops: not its link any more
            assert link.readlink().name == b.name
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(str(link))  # the hook reaches the new enforcer through the link
                sock_b.accept()[0].close()
            hook_socket(b, "release")  # b goes while a still serves: a takes the link back
            assert link.readlink().name == a.name
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# ---- the real API server ----------------------------------------------------------------------
def kubectl(
    sandbox: ControlPlane, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(sandbox.binaries.path("kubectl")), f"--kubeconfig={sandbox.kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


VARIANTS = {
    "real": [],
    "fake": ["--set", "nvml.backend=fake"],
    "tuned": [
        *sets(
            "migManager.dynamic=true",
            "enforcer.hook.enabled=false",
            "nvml.driverRoot=/run/nvidia/driver",
            "kubeletPlugin.metrics.enabled=false",
            "migManager.layouts.create=false",
            "migManager.layouts.existingConfigMap=my-layouts",
            "node.updateStrategy.type=OnDelete",
        ),
    ],
    "sidecars-only": ["--set", "kubeletPlugin.enabled=false", "--set", "nvml.backend=fake"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rendered_object_is_accepted_by_the_api_server(
    helm_bin: Path, sandbox: ControlPlane, namespace: str, variant: str
) -> None:
    version = sandbox.binaries.kube_version
    objs = render(
        helm_bin, "--kube-version", version, *VARIANTS[variant], release="g", namespace=namespace
    )
    stream = yaml.safe_dump_all(objs)
    out = kubectl(
        sandbox,
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=gpuslice-chart-test",
        "--dry-run=server",
        "--validate=strict",
        "-f",
        "-",
        stdin=stream,
    )
    assert out.returncode == 0, f"the API server refused the {variant} chart:\n{out.stderr}"
    accepted = [line for line in out.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(objs), out.stdout
    assert not out.stderr.strip(), out.stderr  # no warnings either


def test_device_classes_are_created_for_real_and_their_cel_compiles(
    helm_bin: Path, kube: RawApi
) -> None:
    suffix = unique("chart")
    for version in ("v1", "v1beta2", "v1beta1"):
        objs = render(helm_bin, "--set", f"deviceClasses.apiVersion=resource.k8s.io/{version}")
        for dc in find(objs, "DeviceClass"):
            dc["metadata"]["name"] = f"{dc['metadata']['name']}.{suffix}"
            path = resource_path(f"resource.k8s.io/{version}", "deviceclasses")
            created = kube.create(path, dc)
            try:
                assert created["spec"]["selectors"] == dc["spec"]["selectors"]
                assert created["spec"].get("extendedResourceName") == dc["spec"].get(
                    "extendedResourceName"
                )
            finally:
                kube.delete(
                    resource_path(
                        f"resource.k8s.io/{version}", "deviceclasses", name=dc["metadata"]["name"]
                    )
                )
    # the API server compiles the selectors: a broken one is refused, naming the problem
    broken = find(render(helm_bin), "DeviceClass")[0]
    broken["metadata"]["name"] = f"broken.{suffix}"
    broken["spec"]["selectors"][0]["cel"]["expression"] = "device.attributes['x'].type == 'gpu' &&"
    with pytest.raises(KubeError, match=r"compil|Syntax error"):
        kube.create(resource_path(RESOURCE, "deviceclasses"), broken)


def impersonating(sandbox: ControlPlane, user: str, node: str | None) -> RawApi:
    api = new_api_client(sandbox.kubeconfig, user_agent="gpuslice-chart-test")
    api.set_default_header("Impersonate-User", user)
    if node:
        api.set_default_header(NODE_EXTRA, node)
    return RawApi(api, deadline=10)


def a_slice(node: str, driver: str = DRIVER) -> Obj:
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": {"generateName": f"{node}-{driver}-"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def refused(call: Callable[[], Obj], undo: Callable[[Obj], object]) -> str | None:
    """The message of a refused call; None (after undoing it) while the policy is not active."""
    try:
        obj = call()
    except KubeError as exc:
        return str(exc)
    undo(obj)
    return None


@pytest.fixture
def installed(
    helm_bin: Path, sandbox: ControlPlane, kube: RawApi, namespace: str
) -> Iterator[tuple[str, str]]:
    """A real `helm install` of the chart (DeviceClasses left out: other suites own those
    names); yields (release, ServiceAccount user) and uninstalls it afterwards."""
    release = unique("chart")
    helm(
        helm_bin,
        "install",
        release,
        str(CHART),
        "-n",
        namespace,
        f"--kubeconfig={sandbox.kubeconfig}",
        # No controller: nothing runs its pods here, and its webhooks (every namespace) would be
        # called for the GPU claims and pods of the suites that share this sandbox.
        *sets("deviceClasses.enabled=false", "controller.enabled=false"),
    )
    try:
        yield release, f"system:serviceaccount:{namespace}:{release}-gpuslice-node"
    finally:
        helm(helm_bin, "uninstall", release, "-n", namespace, f"--kubeconfig={sandbox.kubeconfig}")
    for kind in ("clusterroles", "clusterrolebindings"):
        with pytest.raises(KubeNotFoundError):
            kube.get(
                resource_path("rbac.authorization.k8s.io/v1", kind, name=f"{release}-gpuslice-node")
            )


def test_installed_rbac_allows_exactly_the_calls_of_the_services(
    sandbox: ControlPlane, kube: RawApi, namespace: str, installed: tuple[str, str]
) -> None:
    release, user = installed
    layouts = f"{release}-gpuslice-mig-parted-config"
    res, core = "resource.k8s.io", ""
    grant = [
        *(
            {"group": res, "resource": "resourceslices", "verb": v}
            for v in ("list", "watch", "create", "update", "delete")
        ),
        *(
            {"group": res, "resource": "resourceclaims", "verb": v, "namespace": "team-a"}
            for v in ("get", "list", "watch")
        ),
        *(
            {"group": core, "resource": "nodes", "verb": v}
            for v in ("get", "list", "watch", "patch")
        ),
        *(
            {
                "group": core,
                "resource": "configmaps",
                "verb": v,
                "namespace": namespace,
                "name": layouts,
            }
            for v in ("get", "list", "watch")
        ),
        {"group": core, "resource": "events", "verb": "create", "namespace": "default"},
        # the enforcer's actions as Events on the tenant's pod, counted up on repeat
        *(
            {"group": core, "resource": "events", "verb": v, "namespace": "team-a"}
            for v in ("create", "patch")
        ),
    ]
    deny = [
        {"group": res, "resource": "resourceslices", "verb": "deletecollection"},
        {"group": res, "resource": "resourceclaims", "verb": "update", "namespace": "team-a"},
        {"group": res, "resource": "resourceclaims", "verb": "delete", "namespace": "team-a"},
        {"group": res, "resource": "deviceclasses", "verb": "create"},
        {"group": core, "resource": "nodes", "verb": "delete"},
        {"group": core, "resource": "nodes", "verb": "update"},
        {
            "group": core,
            "resource": "configmaps",
            "verb": "get",
            "namespace": namespace,
            "name": "other",
        },
        {"group": core, "resource": "secrets", "verb": "get", "namespace": namespace},
        {"group": core, "resource": "events", "verb": "delete", "namespace": "team-a"},
        {"group": core, "resource": "events", "verb": "list", "namespace": "team-a"},
        {"group": core, "resource": "pods", "verb": "list"},
    ]
    assert [a for a in grant if not allowed(kube, user, a)] == []
    assert [a for a in deny if allowed(kube, user, a)] == []

    # The real calls, with the service's own selectors (resourceNames work with a name
    # field selector; without it the list is refused).
    as_node = impersonating(sandbox, user, "chart-node-a")
    as_node.list(
        resource_path(RESOURCE, "resourceslices"),
        field_selector=f"spec.nodeName=chart-node-a,spec.driver={DRIVER}",
    )
    # the coexistence check at start: every driver's slices of its node
    as_node.list(
        resource_path(RESOURCE, "resourceslices"), field_selector="spec.nodeName=chart-node-a"
    )
    as_node.list(resource_path("v1", "nodes"), field_selector="metadata.name=chart-node-a")
    as_node.list(
        resource_path("v1", "configmaps", namespace=namespace),
        field_selector=f"metadata.name={layouts}",
    )
    with pytest.raises(KubeError, match="forbidden"):
        as_node.list(resource_path("v1", "configmaps", namespace=namespace))


# What no node identity may change on its own Node, and the policies' message for each.
NODE_METADATA_CHANGES: list[tuple[Obj, str]] = [
    ({"finalizers": ["example.com/keep"]}, "may not change the finalizers of its Node"),
    (
        {
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": "ghost", "uid": str(uuid.uuid4())}
            ]
        },
        "may not change the owner references of its Node",
    ),
]


def test_installed_policies_confine_the_node_pods_to_their_own_node(
    sandbox: ControlPlane, kube: RawApi, installed: tuple[str, str]
) -> None:
    _, user = installed
    node_a, node_b = unique("chart-node"), unique("chart-node")
    for node in (node_a, node_b):
        kube.create(
            resource_path("v1", "nodes"),
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}},
        )
    slices = resource_path(RESOURCE, "resourceslices")
    as_a = impersonating(sandbox, user, node_a)
    try:
        # Policies take effect once the API server has loaded them: wait for the first refusal.
        message = wait_for(
            lambda: refused(
                lambda: as_a.create(slices, a_slice(node_b)),
                lambda made: kube.delete(
                    resource_path(RESOURCE, "resourceslices", name=made["metadata"]["name"])
                ),
            ),
            15,
            "the ResourceSlice policy to refuse another node's slice",
        )
        assert f"node '{node_a}' may not write ResourceSlices of node '{node_b}'" in message
        with pytest.raises(KubeError, match=re.escape(f"only ResourceSlices of driver {DRIVER}")):
            as_a.create(slices, a_slice(node_a, driver="other.example.com"))
        with pytest.raises(KubeError, match="no node name in the credentials"):
            impersonating(sandbox, user, None).create(slices, a_slice(node_a))
        # Owned by its own Node, as the kubelet plugin writes them; no other owner, no
        # finalizer (it would keep a gone node's GPUs published).
        uid_a, uid_b = (
            kube.get(resource_path("v1", "nodes", name=n))["metadata"]["uid"]
            for n in (node_a, node_b)
        )
        owner = {
            "apiVersion": "v1",
            "kind": "Node",
            "name": node_a,
            "uid": uid_a,
            "controller": True,
        }
        owned = a_slice(node_a)
        owned["metadata"]["ownerReferences"] = [owner]
        own = as_a.create(slices, owned)
        own["spec"]["pool"]["generation"] = 2
        path = resource_path(RESOURCE, "resourceslices", name=own["metadata"]["name"])
        own = as_a.replace(path, own)
        for owners in (
            [{**owner, "name": node_b, "uid": uid_b}],
            [owner, {"apiVersion": "v1", "kind": "Pod", "name": "ghost", "uid": str(uuid.uuid4())}],
            [{**owner, "blockOwnerDeletion": True}],
        ):
            bad = a_slice(node_a)
            bad["metadata"]["ownerReferences"] = owners
            with pytest.raises(
                KubeError, match=re.escape(f"node '{node_a}' may name only its own Node")
            ):
                as_a.create(slices, bad)
            with pytest.raises(
                KubeError, match=re.escape(f"node '{node_a}' may name only its own Node")
            ):
                as_a.replace(
                    path, {**own, "metadata": {**own["metadata"], "ownerReferences": owners}}
                )
        finalized = a_slice(node_a)
        finalized["metadata"]["finalizers"] = ["example.com/keep"]
        with pytest.raises(KubeError, match="may not add finalizers to ResourceSlices"):
            as_a.create(slices, finalized)
        with pytest.raises(KubeError, match="may not add finalizers to ResourceSlices"):
            as_a.replace(path, {**own, "metadata": {**own["metadata"], "finalizers": ["a/b"]}})
        as_a.delete(path)

        state = "gpuslice.dev/mig.config.state"
        node_path = resource_path("v1", "nodes", name=node_a)
        message = wait_for(
            lambda: refused(
                lambda: as_a.patch(node_path, {"metadata": {"labels": {"team": "x"}}}),
                lambda _: kube.patch(node_path, {"metadata": {"labels": {"team": None}}}),
            ),
            15,
            "the Node policy to refuse a label other than the MIG state",
        )
        assert f"may change only the label {state}" in message
        as_a.patch(node_path, {"metadata": {"labels": {state: "success"}}})
        assert kube.get(node_path)["metadata"]["labels"][state] == "success"
        as_a.patch(node_path, {"metadata": {"labels": {state: None}}})
        with pytest.raises(KubeError, match=re.escape(f"may not change Node '{node_b}'")):
            as_a.patch(
                resource_path("v1", "nodes", name=node_b),
                {"metadata": {"labels": {state: "success"}}},
            )
        with pytest.raises(KubeError, match="may not change the spec of its Node"):
            as_a.patch(node_path, {"spec": {"unschedulable": True}})
        # Nothing else in metadata either, not even along with the allowed label: a finalizer
        # keeps the Node from being deleted, an owner that does not exist gets it collected.
        changes = [
            *NODE_METADATA_CHANGES,
            ({"annotations": {"team": "x"}}, "may not change the annotations of its Node"),
        ]
        for change, message in changes:
            with pytest.raises(KubeError, match=re.escape(f"the gpuslice node pod {message}")):
                as_a.patch(node_path, {"metadata": {"labels": {state: "success"}, **change}})
        with pytest.raises(KubeError, match=f"may change only the label {state}"):
            as_a.patch(node_path, {"metadata": {"labels": {"gpuslice.dev/mig.config": "all"}}})
        node = kube.get(node_path)["metadata"]
        assert state not in node.get("labels", {}) and not node.get("finalizers")
        assert not node.get("ownerReferences") and not node.get("annotations")
    finally:
        for node in (node_a, node_b):
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(resource_path("v1", "nodes", name=node))
        for s in kube.list(slices, field_selector=f"spec.nodeName={node_a}")["items"]:
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(resource_path(RESOURCE, "resourceslices", name=s["metadata"]["name"]))


def test_installed_policy_confines_the_device_plugin_to_its_own_node(
    sandbox: ControlPlane, kube: RawApi, namespace: str, installed: tuple[str, str]
) -> None:
    """The device plugin's ServiceAccount (RBAC: patch any Node) may change only its own
    Node's sharing labels and annotation. The node name comes as the extra
    authentication.kubernetes.io/node-name, impersonated here as the other policy tests do
    (a bound token of a pod on that node carries the same extra)."""
    release, _ = installed
    user = f"system:serviceaccount:{namespace}:{release}-gpuslice-device-plugin"
    node_a, node_b = unique("dp-node"), unique("dp-node")
    for node in (node_a, node_b):
        kube.create(
            resource_path("v1", "nodes"),
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}},
        )
    as_a = impersonating(sandbox, user, node_a)
    own = {
        "metadata": {
            "labels": {"sharing.gpuslice.dev/gpu": "time-slicing"},
            "annotations": {"gpuslice.dev/device-plugin-sharing": "{}"},
        }
    }
    path_a, path_b = (resource_path("v1", "nodes", name=n) for n in (node_a, node_b))
    try:
        message = wait_for(
            lambda: refused(lambda: as_a.patch(path_b, own), lambda _: None),
            15,
            "the device plugin's Node policy to refuse another node",
        )
        assert f"device plugin on node '{node_a}' may not change Node '{node_b}'" in message
        as_a.patch(path_a, own)  # what the plugin writes on its own Node
        labels = kube.get(path_a)["metadata"]["labels"]
        assert labels["sharing.gpuslice.dev/gpu"] == "time-slicing"
        as_a.patch(path_a, {"metadata": {"labels": {"sharing.gpuslice.dev/gpu": None}}})
        with pytest.raises(KubeError, match=re.escape("only the labels sharing.gpuslice.dev/*")):
            as_a.patch(path_a, {"metadata": {"labels": {"gpuslice.dev/mode": "dra"}}})
        with pytest.raises(
            KubeError, match=re.escape("only the annotation gpuslice.dev/device-plugin")
        ):
            as_a.patch(path_a, {"metadata": {"annotations": {"team": "x"}}})
        with pytest.raises(KubeError, match="may not change the spec"):
            as_a.patch(path_a, {"spec": {"unschedulable": True}})
        for change, message in NODE_METADATA_CHANGES:
            with pytest.raises(KubeError, match=re.escape(f"the gpuslice device plugin {message}")):
                as_a.patch(path_a, {"metadata": {**own["metadata"], **change}})
        node = kube.get(path_a)["metadata"]
        assert not node.get("finalizers") and not node.get("ownerReferences")
        with pytest.raises(KubeError, match=re.escape(f"may not change Node '{node_a}'")):
            impersonating(sandbox, user, None).patch(path_a, own)  # no node in the token
    finally:
        for node in (node_a, node_b):
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(resource_path("v1", "nodes", name=node))


@pytest.mark.parametrize(
    ("cores", "memory", "passes"),
    [("10", str(1024**3), True), ("20", str(1024**3), False), ("10", str(2 * 1024**3), False)],
)
def test_helm_test_pod_checks_the_share_it_got(
    helm_bin: Path, cores: str, memory: str, passes: bool
) -> None:
    """`helm test`'s validation pod asks for 10 cores and 1Gi (the defaults) through its own
    ResourceClaimTemplate and passes only when its environment states exactly that share."""
    objs = render(helm_bin, "--kube-version", "1.37")
    pod = one(objs, "Pod")
    template = one(objs, "ResourceClaimTemplate")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["resourceClaims"] == [
        {"name": "gpu", "resourceClaimTemplateName": template["metadata"]["name"]}
    ]
    [request] = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["capacity"]["requests"] == {"cores": "10", "memory": "1Gi"}
    [container] = pod["spec"]["containers"]
    assert (
        container["image"] == daemonset(objs)["spec"]["template"]["spec"]["containers"][0]["image"]
    )  # the kubelet plugin's image: it has the Python the check runs with
    key = "GPUSLICE_GPU_0_0A1B"  # a share's device key
    env = {
        **env_of(container),
        "PATH": os.environ["PATH"],
        f"{key}_UUID": "GPU-x",
        f"{key}_DEVICE": "gpu-0",
        f"{key}_CORES": cores,
        f"{key}_MEMORY": memory,
    }
    assert container["command"] == ["python", "-c"]
    done = subprocess.run(
        [sys.executable, "-c", *container["args"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (done.returncode == 0) == passes, done.stdout + done.stderr
    assert ("PASS" in done.stdout) == passes, done.stdout
