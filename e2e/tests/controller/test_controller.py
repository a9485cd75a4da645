"""The controller's admission webhooks, called by the real kube-apiserver over TLS.

The controller runs as a local process (as in the chart's Deployment, with leader election and
certificates it makes and rotates itself); the webhook configurations are the chart's own,
rendered with ``controller.webhook.url`` pointing at it and a namespace selector that confines
them to this module's namespaces. Translated pods are scheduled by the real scheduler onto a
sandbox GPU node (real kubelet plugin and enforcer, node agent as kubelet), and their containers
state the limits they got. The certificates are made short-lived (a 60 s CA, 15 s serving
certificates), so every test here also runs while they rotate.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from e2e.sandbox import procs
from e2e.sandbox.binaries import KubeBinaries
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import RESOURCE, gpu_pod, pod_devices
from e2e.sandbox.nodeagent.testing import get_pod, unique, wait_for, wait_pod_phase
from e2e.sandbox.nodeservices import NodePod, serve_node_pod, start_node_pod
from e2e.support.chart import render
from e2e.support.controller import ready
from gpuslice_kube.errors import KubeError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(180)


BIN = Path(sys.executable).parent
GIB = 1024**3
NODE = [{"model": "L4", "count": 2}]
NVML = {"driverVersion": "615.20"}
CLASSES_V1 = "resource.k8s.io/v1"
ADMISSION = "admissionregistration.k8s.io/v1"


@dataclass
class Controller:
    name: str
    namespace: str
    port: int
    selector: dict[str, str]
    proc: procs.Proc
    argv: list[str]
    env: dict[str, str]
    log: Path

    def secret(self, kube: RawApi) -> dict[str, bytes]:
        obj = kube.get(
            resource_path("v1", "secrets", namespace=self.namespace, name=f"{self.name}-tls")
        )
        return {k: base64.b64decode(v) for k, v in obj["data"].items()}

    def stop(self) -> None:
        procs.stop([self.proc], grace=10)

    def start(self) -> None:
        self.proc = procs.start(
            "controller", self.argv, self.log, self.env, cwd=Path.cwd(), die_with_parent=True
        )


@contextlib.contextmanager
def run_controller(
    sandbox: ControlPlane,
    kube: RawApi,
    helm_bin: Path,
    root: Path,
    flags: Sequence[str] = (),
    chart_values: Sequence[str] = (),
) -> Iterator[Controller]:
    """A controller process with ``flags`` and the chart's webhook configurations rendered with
    ``chart_values``, confined to namespaces labelled with its ``selector``."""
    name = unique("e2e-ctl")
    namespace = name
    selector = {"gpuslice-e2e-webhooks": name}
    kube.create(
        resource_path("v1", "namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
    )
    port = procs.free_port()
    argv = [
        str(BIN / "gpuslice-controller"),
        "--kubeconfig",
        str(sandbox.kubeconfig),
        "--namespace",
        namespace,
        "--identity",
        "e2e-0",
        "--webhook-addr",
        f"127.0.0.1:{port}",
        "--metrics-addr",
        "",
        "--tls-secret",
        f"{name}-tls",
        "--cert-hosts",
        "127.0.0.1",
        "--cert-dir",
        str(root / "certs"),
        "--ca-validity",
        "45s",
        "--cert-validity",
        "15s",
        "--cert-check-interval",
        "1",
        "--validating-webhooks",
        name,
        "--mutating-webhooks",
        name,
        "--lease-name",
        name,
        *flags,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = procs.start(
        "controller", argv, root / "controller.log", env, cwd=Path.cwd(), die_with_parent=True
    )
    ctl = Controller(name, namespace, port, selector, proc, argv, env, root / "controller.log")
    configs = render(
        helm_bin,
        "--set",
        "controller.enabled=true",
        "--set",
        f"controller.webhook.url=https://127.0.0.1:{port}",
        "--set",
        f"controller.webhook.namespaceSelector.matchLabels.gpuslice-e2e-webhooks={name}",
        *chart_values,
        "--show-only",
        "templates/controller-webhooks.yaml",
        release="e2e",
        namespace=namespace,
    )
    paths = []
    for config in configs:
        config["metadata"]["name"] = name
        plural = config["kind"].lower() + "s"
        base = f"/apis/admissionregistration.k8s.io/v1/{plural}"
        kube.create(base, config)
        paths.append(f"{base}/{name}")
    try:
        wait_for(lambda: ready(port) or None, 60, "the controller to be ready")
        yield ctl
    finally:
        for path in paths:
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(path)
        ctl.stop()
        print(ctl.log.read_text()[-6000:])
        with contextlib.suppress(KubeNotFoundError):
            kube.delete(resource_path("v1", "namespaces", name=namespace))


@pytest.fixture(scope="module")
def controller(
    sandbox: ControlPlane, kube: RawApi, helm_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Controller]:
    with run_controller(sandbox, kube, helm_bin, tmp_path_factory.mktemp("controller")) as ctl:
        yield ctl


@contextlib.contextmanager
def webhook_namespace(kube: RawApi, controller: Controller) -> Iterator[str]:
    """A namespace ``controller``'s webhooks apply to, removed (pods and claims gone) after."""
    name = unique("e2e-adm")
    kube.create(
        resource_path("v1", "namespaces"),
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": controller.selector},
        },
    )
    yield name
    # Namespace deletion is asynchronous: until its pods and claims are gone their shares stay
    # allocated on the module's node, and the next test (six 30 % shares on two L4s fill it
    # exactly) would find it full. The namespace controller takes 5-8 s to get to them, so
    # they are deleted first, and the namespace after.
    kube.delete_collection(resource_path("v1", "pods", namespace=name))
    kube.delete_collection(resource_path(RESOURCE, "resourceclaims", namespace=name))
    with contextlib.suppress(KubeNotFoundError):
        kube.delete(resource_path("v1", "namespaces", name=name))
    wait_for(
        lambda: (
            not kube.list(resource_path("v1", "pods", namespace=name))["items"]
            and not kube.list(resource_path(RESOURCE, "resourceclaims", namespace=name))["items"]
        ),
        90,
        f"namespace {name}'s pods and claims to be gone",
    )


@pytest.fixture
def ns(kube: RawApi, controller: Controller) -> Iterator[str]:
    """A namespace the module's webhooks apply to."""
    with webhook_namespace(kube, controller) as name:
        yield name


@pytest.fixture(scope="module")
def gpu_node(
    sandbox: ControlPlane, kube: RawApi, device_classes: list[str], request: pytest.FixtureRequest
) -> Iterator[NodePod]:
    pod = start_node_pod(sandbox, NODE, enforcer=True, enforcer_args=("--mps=off",), nvml=NVML)
    yield from serve_node_pod(pod, kube, lambda: request.session.testsfailed)


def claim(namespace: str, name: str, exactly: Obj, config: list[Obj] | None = None) -> Obj:
    return {
        "apiVersion": CLASSES_V1,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": exactly}], "config": config or []}
        },
    }


def create_claim(kube: RawApi, obj: Obj) -> Obj:
    ns = obj["metadata"]["namespace"]
    return kube.create(resource_path(RESOURCE, "resourceclaims", namespace=ns), obj)


def denial(kube: RawApi, obj: Obj) -> str:
    with pytest.raises(KubeError) as info:
        create_claim(kube, obj)
    return str(info.value)


BAD_CONFIG = [
    {
        "opaque": {
            "driver": "gpu.gpuslice.dev",
            "parameters": {
                "apiVersion": "gpu.gpuslice.dev/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "Sometimes"},
                "limits": {"cores": 500},
            },
        }
    }
]


def test_a_bad_gpuconfig_is_denied_naming_every_field(kube: RawApi, ns: str) -> None:
    message = denial(kube, claim(ns, "bad", {"deviceClassName": "gpu.gpuslice.dev"}, BAD_CONFIG))
    assert 'admission webhook "claims.gpu.gpuslice.dev" denied the request' in message
    assert "spec.devices.config[0].opaque.parameters" in message
    assert "sharing.strategy: 'Sometimes'" in message and "limits.cores: 500" in message


def test_out_of_range_capacity_is_denied_and_a_good_share_admitted(kube: RawApi, ns: str) -> None:
    message = denial(
        kube,
        claim(
            ns,
            "big",
            {"deviceClassName": "gpu.gpuslice.dev", "capacity": {"requests": {"cores": "101"}}},
        ),
    )
    assert "exactly.capacity.requests.cores: '101' is not allowed" in message
    ok = create_claim(
        kube,
        claim(
            ns,
            "ok",
            {
                "deviceClassName": "gpu.gpuslice.dev",
                "capacity": {"requests": {"cores": "30", "memory": "4Gi"}},
            },
        ),
    )
    assert ok["metadata"]["name"] == "ok"


def test_a_one_sided_share_gets_a_warning_kubectl_shows(
    sandbox: ControlPlane, kube_binaries: KubeBinaries, ns: str
) -> None:
    manifest = yaml.safe_dump(
        claim(
            ns,
            "one-sided",
            {"deviceClassName": "gpu.gpuslice.dev", "capacity": {"requests": {"cores": "20"}}},
        )
    )
    out = subprocess.run(
        [
            str(kube_binaries.path("kubectl")),
            "--kubeconfig",
            str(sandbox.kubeconfig),
            "create",
            "-f",
            "-",
        ],
        input=manifest,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Warning: spec.devices.requests[0].exactly: asks for cores but not memory" in out.stderr


def test_with_the_controller_down_our_claims_pass_unchecked_unless_fail_is_chosen(
    kube: RawApi, ns: str, controller: Controller
) -> None:
    """The chart's default (claims failurePolicy Ignore, issue 29): a down controller locks
    nobody out, and prepare checks the same config (test_claim_checks_agree.py). With
    failurePolicy Fail our claims wait for it, other drivers' claims and plain pods never do."""
    validating = resource_path(ADMISSION, "validatingwebhookconfigurations", name=controller.name)

    def policy(value: str) -> None:
        live = kube.get(validating)
        for hook in live["webhooks"]:
            hook["failurePolicy"] = value
        kube.replace(validating, live)

    assert {h["failurePolicy"] for h in kube.get(validating)["webhooks"]} == {"Ignore"}
    controller.stop()
    try:
        other = claim(ns, "other", {"deviceClassName": "nic.example.com"})
        assert create_claim(kube, other)["metadata"]["name"] == "other"
        unchecked = claim(ns, "unchecked", {"deviceClassName": "gpu.gpuslice.dev"}, BAD_CONFIG)
        assert create_claim(kube, unchecked)["metadata"]["name"] == "unchecked"
        policy("Fail")
        tries = iter(range(1000))
        # one try per call: the client's own retries would take a refusal (a 500) for a
        # transient error and try again for a minute
        once = RawApi(kube.api_client, deadline=0.0)

        def refused() -> str | None:  # the API server's informer sees the change in a moment
            attempt = claim(ns, f"ours-{next(tries)}", {"deviceClassName": "gpu.gpuslice.dev"})
            try:
                create_claim(once, attempt)
            except KubeError as exc:
                return str(exc)
            return None

        message = wait_for(refused, 10, "failurePolicy Fail to take effect")
        assert 'failed calling webhook "claims.gpu.gpuslice.dev"' in message
        # Pods that use no dialect are not sent at all.
        plain = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "plain", "namespace": ns},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        }
        kube.create(resource_path("v1", "pods", namespace=ns), plain)
    finally:
        policy("Ignore")
        controller.start()
        wait_for(lambda: ready(controller.port) or None, 60, "the controller to be ready")
    create_claim(kube, claim(ns, "ours", {"deviceClassName": "gpu.gpuslice.dev"}))


# The same share (30 % of the SMs, 4 GiB) in every dialect.
DIALECT_PODS: dict[str, dict[str, str]] = {
    "hami": {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30", "nvidia.com/gpumem": "4096"},
    "aliyun": {"aliyun.com/gpu-mem": "4", "aliyun.com/gpu-core.percentage": "30"},
    "vcuda": {"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "16"},
    "docker-vcuda": {"docker.com/vcuda-core": "30", "docker.com/vcuda-memory": "16"},
    "qgpu": {"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "4"},
    "volcano": {
        "volcano.sh/vgpu-number": "1",
        "volcano.sh/vgpu-cores": "30",
        "volcano.sh/vgpu-memory": "4096",
    },
}


def dialect_pod(
    namespace: str,
    name: str,
    node: str,
    limits: dict[str, str],
    labels: dict[str, str] | None = None,
) -> Obj:
    """A pod that prints its gpuslice environment, asking in a dialect's ``limits``."""
    return gpu_pod(namespace, name, node, limits=limits, labels=labels)


def test_every_dialect_runs_with_the_limits_it_meant(
    kube: RawApi, ns: str, gpu_node: NodePod
) -> None:
    node = gpu_node.node
    for dialect, limits in DIALECT_PODS.items():
        created = kube.create(
            resource_path("v1", "pods", namespace=ns), dialect_pod(ns, dialect, node.name, limits)
        )
        spec = created["spec"]
        assert spec["resourceClaims"], f"{dialect}: no claims added"
        assert "limits" not in spec["containers"][0]["resources"], dialect
        original = json.loads(
            created["metadata"]["annotations"]["gpu.gpuslice.dev/translated-from"]
        )
        assert original["dialect"] == dialect
    for dialect in DIALECT_PODS:
        pod = wait_pod_phase(kube, ns, dialect, "Running", timeout=60)
        [device] = pod_devices(node, pod)
        assert (device["CORES"], device["MEMORY"]) == ("30", str(4 * GIB)), dialect
    templates = kube.list(resource_path(RESOURCE, "resourceclaimtemplates", namespace=ns))
    labels = {t["metadata"]["labels"]["gpu.gpuslice.dev/dialect"] for t in templates["items"]}
    assert labels == set(DIALECT_PODS)


def test_a_deployments_pods_are_translated_and_share_one_template(
    kube: RawApi, ns: str, gpu_node: NodePod
) -> None:
    template = dialect_pod(
        ns,
        "x",
        gpu_node.node.name,
        {"tencent.com/vcuda-core": "20", "tencent.com/vcuda-memory": "8"},
        labels={"app": "vc"},
    )
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vc", "namespace": ns},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "vc"}},
            "template": {"metadata": {"labels": {"app": "vc"}}, "spec": template["spec"]},
        },
    }
    kube.create(f"/apis/apps/v1/namespaces/{ns}/deployments", deployment)

    def running() -> list[Obj] | None:
        pods = kube.list(resource_path("v1", "pods", namespace=ns), label_selector="app=vc")
        items = [p for p in pods["items"] if p["status"].get("phase") == "Running"]
        return items if len(items) == 2 else None

    pods = wait_for(running, 90, "both replicas to run")
    for pod in pods:
        [device] = pod_devices(gpu_node.node, pod)
        assert (device["CORES"], device["MEMORY"]) == ("20", str(2 * GIB))
    names = {p["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] for p in pods}
    assert len(names) == 1


def test_opt_out_and_untranslatable_pods(kube: RawApi, ns: str, gpu_node: NodePod) -> None:
    node = gpu_node.node.name
    opted = dialect_pod(
        ns, "opted-out", node, DIALECT_PODS["vcuda"], labels={"gpu.gpuslice.dev/translate": "false"}
    )
    created = kube.create(resource_path("v1", "pods", namespace=ns), opted)
    assert "resourceClaims" not in created["spec"]
    assert created["spec"]["containers"][0]["resources"]["limits"] == DIALECT_PODS["vcuda"]
    mixed = dialect_pod(ns, "mixed", node, {**DIALECT_PODS["vcuda"], **DIALECT_PODS["qgpu"]})
    with pytest.raises(KubeError, match="denied the request"):
        kube.create(resource_path("v1", "pods", namespace=ns), mixed)
    huge = dialect_pod(
        ns, "huge", node, {"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "1000"}
    )
    with pytest.raises(KubeError, match="denied the request") as info:
        kube.create(resource_path("v1", "pods", namespace=ns), huge)
    assert "250Gi" in str(info.value) or "GPU" in str(info.value)
    assert get_pod(kube, ns, "huge") is None


# A HAMi install that renamed its resources and set defaults (its chart values), the same in the
# controller's flags and the chart's values (e2e/tests/chart/test_chart_hami.py checks that the
# chart turns the values into both).
HAMI_RENAMED = {
    "resource-name": "hami.io/vgpu",
    "resource-mem": "hami.io/vgpu-memory",
    "resource-mem-percentage": "hami.io/vgpu-memory-percentage",
    "resource-cores": "hami.io/vgpu-cores",
    "resource-priority": "hami.io/vgpu-priority",
    "default-mem": "2048",
    "default-cores": "25",
}


def _camel(flag: str) -> str:
    head, *rest = flag.split("-")
    return head + "".join(w.capitalize() for w in rest)


def test_a_renamed_hami_install_is_translated_with_its_defaults(
    sandbox: ControlPlane,
    kube: RawApi,
    helm_bin: Path,
    gpu_node: NodePod,
    tmp_path: Path,
) -> None:
    """Pods asking for the renamed resources reach the webhook (the matchConditions carry the
    names) and run with the limits they meant; a count alone gets defaultMem and defaultCores;
    HAMi's default names mean nothing to this install and are left alone."""
    flags = [f"--hami-{k}={v}" for k, v in HAMI_RENAMED.items()]
    values = [
        a
        for k, v in HAMI_RENAMED.items()
        for a in ("--set", f"controller.webhook.pods.hami.{_camel(k)}={v}")
    ]
    node = gpu_node.node
    with (
        run_controller(sandbox, kube, helm_bin, tmp_path, flags, values) as renamed,
        webhook_namespace(kube, renamed) as namespace,
    ):
        pods = resource_path("v1", "pods", namespace=namespace)
        asked = {"hami.io/vgpu": "1", "hami.io/vgpu-cores": "30", "hami.io/vgpu-memory": "4096"}
        for name, limits in (("asked", asked), ("defaults", {"hami.io/vgpu": "1"})):
            created = kube.create(pods, dialect_pod(namespace, name, node.name, limits))
            assert created["spec"]["resourceClaims"], f"{name}: not translated"
            assert "limits" not in created["spec"]["containers"][0]["resources"], name
        untouched = dialect_pod(namespace, "hami-names", node.name, DIALECT_PODS["hami"])
        created = kube.create(pods, untouched)
        assert "resourceClaims" not in created["spec"]
        assert created["spec"]["containers"][0]["resources"]["limits"] == DIALECT_PODS["hami"]
        kube.delete(resource_path("v1", "pods", namespace=namespace, name="hami-names"))
        for name, want in (("asked", ("30", str(4 * GIB))), ("defaults", ("25", str(2 * GIB)))):
            pod = wait_pod_phase(kube, namespace, name, "Running", timeout=60)
            [device] = pod_devices(node, pod)
            assert (device["CORES"], device["MEMORY"]) == want, name


def test_admission_keeps_working_while_the_ca_rotates(
    kube: RawApi, ns: str, controller: Controller
) -> None:
    first = x509.load_pem_x509_certificates(controller.secret(kube)["ca.crt"])[-1]
    deadline = time.monotonic() + 120
    answered = 0
    rotated = False
    while time.monotonic() < deadline and not rotated:
        message = denial(
            kube, claim(ns, unique("bad"), {"deviceClassName": "gpu.gpuslice.dev"}, BAD_CONFIG)
        )
        assert "sharing.strategy: 'Sometimes'" in message, message  # our webhook answered
        answered += 1
        data = controller.secret(kube)
        serving = x509.load_pem_x509_certificate(data["tls.crt"])
        newest = x509.load_pem_x509_certificates(data["ca.crt"])[-1]
        rotated = newest.serial_number != first.serial_number and (
            serving.issuer == newest.subject
            and serving.not_valid_before_utc >= newest.not_valid_before_utc
        )
        time.sleep(1)  # one review a second while the leader rotates
    assert rotated, f"the CA did not rotate within 120 s ({answered} reviews answered)"
    message = denial(kube, claim(ns, "after", {"deviceClassName": "gpu.gpuslice.dev"}, BAD_CONFIG))
    assert "sharing.strategy" in message
