"""The controller as its own ServiceAccount, holding exactly the chart's RBAC, on the real API
server (issue 27).

The chart's controller RBAC (ServiceAccount, ClusterRole, Role and bindings) is rendered and
created; the controller runs as a process with the chart Deployment's own environment (the
webhook on loopback) and a token of that ServiceAccount, so every call it makes is authorized
by the chart's rules and nothing else. Then:

- its identity reads and watches its TLS Secret, and cannot list the namespace's Secrets or
  read another one;
- it is not ready while the chart's webhook configurations do not exist; created after it
  started (the chart's hourly check interval), they get the CA bundle within seconds, and the
  controller is ready once both carry it; so does one re-applied without it and one
  deleted and created again; the real API server then calls the webhook with that bundle;
- nothing it did in the whole module was forbidden (its log).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.sandbox import procs
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import RESOURCE
from e2e.sandbox.nodeagent.testing import unique, wait_for
from e2e.support.chart import allowed, render
from e2e.support.controller import ready, readyz
from gpuslice_kube.client import new_api_client
from gpuslice_kube.errors import KubeError, KubeForbiddenError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(180)


BIN = Path(sys.executable).parent
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
ADMISSION = "admissionregistration.k8s.io/v1"
PUBLISHED_WITHIN = 10.0  # seconds; the chart's own check interval is an hour


@dataclass
class Controller:
    name: str
    namespace: str
    user: str
    selector: dict[str, str]
    webhooks: list[Obj]
    api: RawApi
    """The controller's own identity (its ServiceAccount token)."""
    log: Path
    port: int

    @property
    def secret(self) -> str:
        return f"{self.name}-tls"

    def ca_bundle(self, kube: RawApi) -> str:
        path = resource_path("v1", "secrets", namespace=self.namespace, name=self.secret)
        return str(kube.get(path)["data"]["ca.crt"])  # base64, as caBundle holds it


def plural(kind: str) -> str:
    return f"{kind.lower()}s"


def token_kubeconfig(sandbox: ControlPlane, token: str, path: Path) -> Path:
    """The sandbox's kubeconfig with the admin's client certificate swapped for ``token``."""
    config = json.loads(sandbox.kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token}
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


def chart_env(deployment: Obj, namespace: str) -> dict[str, str]:
    """The controller container's environment as the chart renders it (fieldRefs resolved)."""
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    fields = {"metadata.namespace": namespace, "metadata.name": "rbac-0"}
    return {
        e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in container["env"]
    }


BUNDLE_WAIT = "waiting for the CA bundle in the webhook configurations"


@pytest.fixture(scope="module")
def controller(
    sandbox: ControlPlane, kube: RawApi, helm_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Controller]:
    release = unique("rbac")
    namespace, name = release, f"{release}-gpuslice-controller"
    selector = {"gpuslice-e2e-webhooks": release}
    port = procs.free_port()
    objs = render(
        helm_bin,
        *("--set", f"controller.webhook.url=https://127.0.0.1:{port}"),
        *(
            "--set",
            f"controller.webhook.namespaceSelector.matchLabels.gpuslice-e2e-webhooks={release}",
        ),
        # No aggregated API: its APIService, registered in the shared sandbox while nothing
        # serves it, would break discovery for every other suite; the real-node tier runs the
        # controller with its RBAC (e2e/tests/realnode).
        *("--set", "controller.aggregatedApi.enabled=false"),
        *("--show-only", "templates/controller.yaml"),
        *("--show-only", "templates/controller-webhooks.yaml"),
        release=release,
        namespace=namespace,
    )
    kube.create(
        resource_path("v1", "namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
    )
    made: list[str] = []
    root = tmp_path_factory.mktemp("controller-rbac")
    log = root / "controller.log"
    proc: procs.Proc | None = None
    try:
        for obj in (o for o in objs if o["kind"] in RBAC_KINDS):
            ns = obj["metadata"].get("namespace")
            collection = resource_path(obj["apiVersion"], plural(obj["kind"]), namespace=ns)
            kube.create(collection, obj)
            made.append(f"{collection}/{obj['metadata']['name']}")
        account = resource_path("v1", "serviceaccounts", namespace=namespace, name=name)
        token = kube.create(
            f"{account}/token", {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest"}
        )["status"]["token"]
        kubeconfig = token_kubeconfig(sandbox, token, root / "kubeconfig")
        [deployment] = [o for o in objs if o["kind"] == "Deployment"]
        env = {
            **os.environ,
            **chart_env(deployment, namespace),
            "KUBECONFIG": str(kubeconfig),
            "GPUSLICE_WEBHOOK_ADDR": f"127.0.0.1:{port}",
            "GPUSLICE_METRICS_ADDR": "",
            "GPUSLICE_CERT_HOSTS": "127.0.0.1",  # what controller.webhook.url names
            "GPUSLICE_CERT_DIR": str(root / "certs"),
            "PYTHONUNBUFFERED": "1",
        }
        assert (
            env["GPUSLICE_CERT_CHECK_INTERVAL"] == "3600"
        )  # only the watch can publish within seconds
        argv = [str(BIN / "gpuslice-controller")]
        proc = procs.start("controller", argv, log, env, cwd=Path.cwd(), die_with_parent=True)
        # Up, its certificate loaded and its caches synced, but not ready: the chart's webhook
        # configurations do not exist yet, so the API server could not call it.
        wait_for(
            lambda: readyz(port) == f"{BUNDLE_WAIT}\n" or None,
            60,
            "the controller to wait for nothing but the CA bundle",
        )
        yield Controller(
            name,
            namespace,
            f"system:serviceaccount:{namespace}:{name}",
            selector,
            [o for o in objs if o["kind"].endswith("WebhookConfiguration")],
            RawApi(new_api_client(kubeconfig, user_agent="gpuslice-rbac-test"), deadline=10),
            log,
            port,
        )
    finally:
        for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(resource_path(ADMISSION, kind, name=name))
        if proc is not None:
            procs.stop([proc], grace=10)
            print(log.read_text()[-6000:])
        for path in reversed(made):
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(path)
        with contextlib.suppress(KubeNotFoundError):
            kube.delete(resource_path("v1", "namespaces", name=namespace))


def test_its_identity_reads_its_secret_and_no_other(kube: RawApi, controller: Controller) -> None:
    ns, own = controller.namespace, controller.secret
    secrets = resource_path("v1", "secrets", namespace=ns)
    other = f"{controller.name}-other"
    kube.create(
        secrets,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": other}, "data": {"k": "dg=="}},
    )
    as_controller = controller.api
    assert as_controller.get(f"{secrets}/{own}")["data"]["tls.crt"]
    listed = as_controller.list(secrets, field_selector=f"metadata.name={own}")["items"]
    assert [s["metadata"]["name"] for s in listed] == [own]
    with pytest.raises(KubeForbiddenError, match="forbidden"):
        as_controller.list(secrets)  # the namespace's Secrets: not without the name
    with pytest.raises(KubeForbiddenError, match="forbidden"):
        as_controller.list(secrets, field_selector=f"metadata.name={other}")
    with pytest.raises(KubeForbiddenError, match="forbidden"):
        as_controller.get(f"{secrets}/{other}")
    # What the API server's authorizer says, verb by verb.
    secret = {"resource": "secrets", "namespace": ns}
    for verb in ("get", "list", "watch", "update"):
        assert allowed(kube, controller.user, {**secret, "verb": verb, "name": own}), verb
        assert not allowed(kube, controller.user, {**secret, "verb": verb, "name": other}), verb
    assert not allowed(kube, controller.user, {**secret, "verb": "list"})
    assert not allowed(kube, controller.user, {**secret, "verb": "delete", "name": own})
    assert allowed(kube, controller.user, {**secret, "verb": "create"})  # a missing Secret
    hooks = {"group": "admissionregistration.k8s.io", "resource": "validatingwebhookconfigurations"}
    assert allowed(kube, controller.user, {**hooks, "verb": "watch", "name": controller.name})
    assert not allowed(kube, controller.user, {**hooks, "verb": "list"})
    assert not allowed(kube, controller.user, {**hooks, "verb": "update", "name": "other"})


def bundles(kube: RawApi, controller: Controller) -> dict[str, set[str | None]]:
    found = {}
    for config in controller.webhooks:
        path = resource_path(ADMISSION, plural(config["kind"]), name=controller.name)
        try:
            live = kube.get(path)
        except KubeNotFoundError:
            continue
        found[config["kind"]] = {
            h["clientConfig"].get("caBundle") for h in live.get("webhooks") or []
        }
    return found


def published(kube: RawApi, controller: Controller, what: str) -> float:
    """Seconds until every webhook of both configurations holds the Secret's CA bundle."""
    start = time.monotonic()
    want = {controller.ca_bundle(kube)}

    def done() -> bool:
        found = bundles(kube, controller)
        return len(found) == len(controller.webhooks) and all(b == want for b in found.values())

    wait_for(done, PUBLISHED_WITHIN, what)
    return time.monotonic() - start


def test_a_webhook_configuration_gets_the_bundle_within_seconds(
    kube: RawApi, controller: Controller
) -> None:
    # Created after the controller started, as the chart may (an upgrade that turns a webhook
    # on) or as a user does: the leader's watch publishes, not its hourly check.
    assert not ready(controller.port)  # no configuration yet: nobody can call it
    start = time.monotonic()
    for config in controller.webhooks:
        kube.create(resource_path(ADMISSION, plural(config["kind"])), config)
    took = published(kube, controller, "the CA bundle in both new webhook configurations")
    print(f"bundle published {took:.2f} s after the configurations were created")
    wait_for(lambda: ready(controller.port) or None, PUBLISHED_WITHIN, "readiness")
    print(f"ready {time.monotonic() - start:.2f} s after the configurations were created")

    # The real API server trusts it: the claim webhook answers (denies a bad config by name).
    ns = unique("rbac-adm")
    kube.create(
        resource_path("v1", "namespaces"),
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": ns, "labels": controller.selector},
        },
    )
    try:
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "bad"},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuslice.dev"}}
                    ],
                    "config": [
                        {
                            "opaque": {
                                "driver": "gpu.gpuslice.dev",
                                "parameters": {
                                    "apiVersion": "gpu.gpuslice.dev/v1alpha1",
                                    "kind": "GpuConfig",
                                    "sharing": {"strategy": "Sometimes"},
                                },
                            }
                        }
                    ],
                }
            },
        }
        with pytest.raises(KubeError, match=r"denied the request.*'Sometimes' is not allowed"):
            kube.create(resource_path(RESOURCE, "resourceclaims", namespace=ns), claim)
    finally:
        with contextlib.suppress(KubeNotFoundError):
            kube.delete(resource_path("v1", "namespaces", name=ns))

    # Re-applied by a tool that drops caBundle (a plain replace of the chart's manifest).
    [validating] = [c for c in controller.webhooks if c["kind"].startswith("Validating")]
    path = resource_path(ADMISSION, plural(validating["kind"]), name=controller.name)
    live = kube.get(path)
    kube.replace(path, {**validating, "metadata": live["metadata"]})
    assert bundles(kube, controller)[validating["kind"]] == {None}
    took = published(kube, controller, "the CA bundle back after a re-apply without it")
    print(f"bundle restored {took:.2f} s after a re-apply dropped it")
    wait_for(lambda: ready(controller.port) or None, PUBLISHED_WITHIN, "readiness again")

    # Deleted and created again.
    kube.delete(path)
    kube.create(resource_path(ADMISSION, plural(validating["kind"])), validating)
    took = published(kube, controller, "the CA bundle in the re-created configuration")
    print(f"bundle published {took:.2f} s after the configuration was created again")


def test_nothing_it_did_was_forbidden(controller: Controller) -> None:
    """Last in the module: every call the controller made so far (certificates, Lease, caches,
    the cluster view, the watch of its webhook configurations) passed the chart's RBAC."""
    refused = [
        line
        for line in controller.log.read_text().splitlines()
        if "forbidden" in line.lower() or '"status": 403' in line
    ]
    assert refused == [], "\n".join(refused[:5])
