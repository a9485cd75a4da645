"""The cluster view as the aggregated API ``view.gpuslice.dev``, through the sandbox's real
kube-apiserver with the real kubectl: discovery, ``get gpus`` (table, ``-o wide``, ``-l``, ``-o
json``), ``describe``, ``-w``; ``gpuclaims`` and ``gpureasons`` in a namespace; RBAC on the
real resources, cluster-wide and per namespace; and the controller refusing front-proxy headers
on a connection without the front-proxy client certificate.

The API server reaches an APIService through its Service's endpoint (the sandbox runs it with
``--enable-aggregator-routing``: there is no kube-proxy), and endpoint addresses may not be
loopback, so the controller listens on this host's address on its default route and the test
points a Service without selector at it. The APIService is deleted before the controller stops:
a registered APIService that does not answer breaks discovery for every client of the sandbox.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import GpuNode
from e2e.sandbox.nodeagent.testing import unique, wait_for
from e2e.support.controller import Controller, running_controller, token
from e2e.support.view import start_pod
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(120)

GROUP, VERSION = "view.gpuslice.dev", "v1alpha1"
APISERVICES = resource_path("apiregistration.k8s.io/v1", "apiservices")
APISERVICE = f"{VERSION}.{GROUP}"
PLUGIN = Path(sys.executable).parent / "kubectl-gpuslice"
RBAC = "rbac.authorization.k8s.io/v1"


def host_address() -> str:
    """This host's address on its default route (not loopback: the API server refuses
    loopback endpoints). Fails, naming what is missing, on a host without a default route."""
    try:
        routes = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError as exc:
        pytest.fail(f"cannot read /proc/net/route to find this host's address: {exc}")
    gateways = [r.split() for r in routes if r.split()[1:2] == ["00000000"]]
    if not gateways:
        pytest.fail("this host has no default route: no non-loopback address for the endpoint")
    gateway = socket.inet_ntoa(int(gateways[0][2], 16).to_bytes(4, "little"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        # a UDP connect only picks the route and source address; nothing is sent
        s.connect((gateway if gateway != "0.0.0.0" else "198.51.100.1", 9))
        address = str(s.getsockname()[0])
    if address.startswith("127."):
        pytest.fail(f"the default route leaves from {address}, a loopback address")
    return address


@pytest.fixture(scope="module")
def controller(
    sandbox: ControlPlane, ns: str, node: GpuNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Controller]:
    with running_controller(
        sandbox,
        ns,
        tmp_path_factory.mktemp("aggapi"),
        host=host_address(),
        cert_hosts=(f"gpuslice-view.{ns}.svc",),
        args=("--aggregated-api",),
    ) as ctl:
        yield ctl


@pytest.fixture(scope="module")
def apiservice(kube: RawApi, ns: str, controller: Controller) -> Iterator[str]:
    """The Service (no selector; its endpoints name the controller) and the APIService, once
    Available. The APIService goes first on leaving, while the controller still answers."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gpuslice-view"},
        "spec": {"ports": [{"name": "https", "port": 443, "targetPort": controller.port}]},
    }
    kube.create(resource_path("v1", "services", namespace=ns), service)
    port = {"name": "https", "port": controller.port, "protocol": "TCP"}
    kube.create(
        resource_path("discovery.k8s.io/v1", "endpointslices", namespace=ns),
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "gpuslice-view-1",
                "labels": {"kubernetes.io/service-name": "gpuslice-view"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [controller.host], "conditions": {"ready": True}}],
            "ports": [port],
        },
    )
    kube.create(
        resource_path("v1", "endpoints", namespace=ns),
        {
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {"name": "gpuslice-view"},
            "subsets": [{"addresses": [{"ip": controller.host}], "ports": [port]}],
        },
    )
    secret = kube.get(resource_path("v1", "secrets", namespace=ns, name="view-tls"))
    registration = {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": APISERVICE},
        "spec": {
            "group": GROUP,
            "version": VERSION,
            "service": {"namespace": ns, "name": "gpuslice-view", "port": 443},
            "caBundle": secret["data"]["ca.crt"],
            "groupPriorityMinimum": 1000,
            "versionPriority": 15,
        },
    }
    kube.create(APISERVICES, registration)
    try:

        def available() -> Obj | None:
            found = kube.get(
                resource_path("apiregistration.k8s.io/v1", "apiservices", name=APISERVICE)
            )
            conditions = (found.get("status") or {}).get("conditions") or []
            return (
                found
                if {"type": "Available", "status": "True"}
                in [{"type": c["type"], "status": c["status"]} for c in conditions]
                else None
            )

        wait_for(available, 30, f"APIService {APISERVICE} to be Available")
        yield APISERVICE
    finally:
        with contextlib.suppress(KubeNotFoundError):
            kube.delete(f"{APISERVICES}/{APISERVICE}")
        wait_for(lambda: not _exists(kube, APISERVICE) or None, 20, "the APIService gone")


def _exists(kube: RawApi, name: str) -> bool:
    try:
        kube.get(f"{APISERVICES}/{name}")
    except KubeNotFoundError:
        return False
    return True


def kubectl(
    sandbox: ControlPlane, *args: str, config: Path | None = None
) -> subprocess.CompletedProcess[str]:
    binary = sandbox.binaries.path("kubectl")
    return subprocess.run(
        [str(binary), "--kubeconfig", str(config or sandbox.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def user_kubeconfig(sandbox: ControlPlane, bearer: str, path: Path) -> Path:
    admin = json.loads(sandbox.kubeconfig.read_text())
    cluster = admin["clusters"][0]
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": "user", "user": {"token": bearer}}],
                "contexts": [
                    {"name": "u", "context": {"cluster": cluster["name"], "user": "user"}}
                ],
                "current-context": "u",
            }
        )
    )
    return path


def test_kubectl_gets_lists_selects_and_describes_gpus(
    sandbox: ControlPlane, node: GpuNode, apiservice: str
) -> None:
    name = f"{node.name}.gpu-0"
    listed = kubectl(sandbox, "get", "gpus")
    assert listed.returncode == 0, listed.stderr
    head, *rows = listed.stdout.splitlines()
    assert head.split()[:4] == ["NAME", "NODE", "MODEL", "CORES%"]
    assert "UUID" not in head
    [row] = [r for r in rows if r.startswith(name + " ")]
    assert row.split()[1] == node.name and row.split()[-1] == "Ready"

    wide = kubectl(sandbox, "get", "gpus", "-o", "wide")
    assert wide.returncode == 0, wide.stderr
    assert wide.stdout.splitlines()[0].split()[-2:] == ["UUID", "PODS"]
    assert node.gpu_uuid(0) in wide.stdout

    selected = kubectl(sandbox, "get", "gpus", "-l", f"gpuslice.dev/node={node.name}", "-o", "name")
    assert selected.returncode == 0, selected.stderr
    assert selected.stdout.split() == [f"gpu.{GROUP}/{name}"]
    none = kubectl(
        sandbox, "get", "gpus", "-l", f"gpuslice.dev/node={node.name},gpuslice.dev/type=mig"
    )
    assert none.returncode == 0 and none.stdout == "", none.stdout
    bad = kubectl(sandbox, "get", "gpus", "--field-selector", "spec.node=x")
    assert bad.returncode == 1 and "metadata.name" in bad.stderr, bad.stderr

    one = kubectl(sandbox, "get", "gpu", name, "-o", "json")
    assert one.returncode == 0, one.stderr
    obj: dict[str, Any] = json.loads(one.stdout)
    assert (obj["apiVersion"], obj["kind"]) == (f"{GROUP}/{VERSION}", "GPU")
    assert obj["spec"]["uuid"] == node.gpu_uuid(0) and obj["spec"]["cores"] == 100
    assert obj["metadata"]["labels"]["gpuslice.dev/type"] == "gpu"
    assert obj["metadata"]["resourceVersion"].isdigit()
    missing = kubectl(sandbox, "get", "gpu", "no-such-gpu")
    assert missing.returncode == 1
    assert f'gpus.{GROUP} "no-such-gpu" not found' in missing.stderr

    described = kubectl(sandbox, "describe", "gpu", name)
    assert described.returncode == 0, described.stderr
    assert f"Name:         {name}" in described.stdout and node.gpu_uuid(0) in described.stdout


def test_kubectl_watch_sees_a_cordon(sandbox: ControlPlane, node: GpuNode, apiservice: str) -> None:
    name = f"{node.name}.gpu-0"
    watch = subprocess.Popen(
        [
            str(sandbox.binaries.path("kubectl")),
            *("--kubeconfig", str(sandbox.kubeconfig), "get", "gpus", "-w"),
            *("-l", f"gpuslice.dev/node={node.name}", "--no-headers"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watch.stdout is not None
        first = watch.stdout.readline()
        assert first.startswith(name) and first.split()[-1] == "Ready", first
        t0 = time.monotonic()
        cordon = subprocess.run(
            [str(PLUGIN), "--kubeconfig", str(sandbox.kubeconfig), "cordon", f"{node.name}/0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert cordon.returncode == 0, cordon.stderr
        seen = watch.stdout.readline()  # (the test's timeout bounds this read)
        assert seen.startswith(name) and seen.split()[-1] == "Cordoned", seen
        assert time.monotonic() - t0 < 10
    finally:
        watch.kill()
        watch.wait(5)
        subprocess.run(
            [str(PLUGIN), "--kubeconfig", str(sandbox.kubeconfig), "uncordon", f"{node.name}/0"],
            capture_output=True,
            timeout=30,
            check=False,
        )


def test_rbac_on_the_real_resource(
    sandbox: ControlPlane, kube: RawApi, ns: str, apiservice: str, tmp_path: Path
) -> None:
    role = unique("gpu-reader")
    kube.create(
        resource_path(RBAC, "clusterroles"),
        {
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": role},
            "rules": [
                {"apiGroups": [GROUP], "resources": ["gpus"], "verbs": ["get", "list", "watch"]}
            ],
        },
    )
    kube.create(
        resource_path(RBAC, "clusterrolebindings"),
        {
            "apiVersion": RBAC,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": role},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": "gpu-reader", "namespace": ns}],
        },
    )
    try:
        reader = user_kubeconfig(sandbox, token(kube, ns, "gpu-reader"), tmp_path / "reader")
        stranger = user_kubeconfig(sandbox, token(kube, ns, "gpu-stranger"), tmp_path / "stranger")
        allowed = kubectl(sandbox, "get", "gpus", "-o", "name", config=reader)
        assert allowed.returncode == 0 and allowed.stdout.strip(), allowed.stderr
        refused = kubectl(sandbox, "get", "gpus", config=stranger)
        assert refused.returncode == 1
        assert "Error from server (Forbidden)" in refused.stderr, refused.stderr
        assert f"system:serviceaccount:{ns}:gpu-stranger" in refused.stderr
    finally:
        for plural in ("clusterrolebindings", "clusterroles"):
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(resource_path(RBAC, plural, name=role))


def test_forged_front_proxy_headers_without_the_client_certificate_are_refused(
    controller: Controller, apiservice: str
) -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # what is checked here is the client side
    request = urllib.request.Request(
        f"https://{controller.host}:{controller.port}/apis/{GROUP}/{VERSION}/gpus",
        headers={"X-Remote-User": "system:admin", "X-Remote-Group": "system:masters"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, context=ctx, timeout=10)
    assert refused.value.code == 401
    body = json.loads(refused.value.read())
    assert (body["kind"], body["reason"]) == ("Status", "Unauthorized")


def plugin(sandbox: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PLUGIN), "--kubeconfig", str(sandbox.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_kubectl_gpuslice_reads_gpus_from_the_view_api(
    sandbox: ControlPlane, node: GpuNode, apiservice: str
) -> None:
    """With the sandbox's admin kubeconfig (a client certificate, which the /view/ path cannot
    pass on): the rows come from the view API, quietly, and -l, -o name, --no-headers work."""
    mine = f"gpuslice.dev/node={node.name}"
    done = plugin(sandbox, "--source", "view-api", "top", "gpus", "-l", mine, "-o", "json")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    listed = json.loads(done.stdout)
    assert listed["kind"] == "GPUList"
    [obj] = listed["items"]  # as the view API served it: kind, and the store's resourceVersion
    assert (obj["apiVersion"], obj["kind"]) == (f"{GROUP}/{VERSION}", "GPU")
    assert obj["metadata"]["resourceVersion"]
    spec = obj["spec"]
    assert (spec["node"], spec["uuid"], spec["cores"]) == (node.name, node.gpu_uuid(0), 100)
    path = plugin(sandbox, "top", "gpus", "-l", mine, "-o", "jsonpath={.items[*].spec.uuid}")
    assert path.stdout == node.gpu_uuid(0), path.stderr
    auto = plugin(sandbox, "top", "gpus", "-l", mine, "--no-headers")
    assert auto.returncode == 0 and auto.stderr == "", auto.stderr
    [line] = auto.stdout.splitlines()
    assert line.split()[:2] == [node.name, "gpu-0"]
    names = plugin(sandbox, "top", "gpus", "-o", "name", "-l", f"{mine},gpuslice.dev/type=gpu")
    assert names.stdout.split() == [f"gpu.{GROUP}/{node.name}.gpu-0"]
    described = plugin(sandbox, "describe", "gpu", f"{node.name}/0")
    assert described.returncode == 0 and node.gpu_uuid(0) in described.stdout, described.stderr


def test_gpuclaims_and_gpureasons_per_namespace_with_rbac_in_it(
    sandbox: ControlPlane, kube: RawApi, ns: str, node: GpuNode, apiservice: str, tmp_path: Path
) -> None:
    """A claim the real scheduler allocates on the sandbox GPU, listed as gpuclaims; the reason
    of a pod whose claim cannot fit, as a gpureason; and a user with a Role in this namespace
    only, who reads claims here (the controller's review carries the namespace) and is refused
    in another namespace by the API server."""
    start_pod(kube, ns, node, "fits", cores="20", memory="4Gi")
    start_pod(kube, ns, node, "huge", cores="10", memory="100Gi")
    role = "gpuclaims-reader"
    kube.create(
        resource_path(RBAC, "roles", namespace=ns),
        {
            "apiVersion": RBAC,
            "kind": "Role",
            "metadata": {"name": role},
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": ["gpuclaims"],
                    "verbs": ["get", "list", "watch"],
                },
                {"apiGroups": [GROUP], "resources": ["gpureasons"], "verbs": ["get"]},
            ],
        },
    )
    kube.create(
        resource_path(RBAC, "rolebindings", namespace=ns),
        {
            "apiVersion": RBAC,
            "kind": "RoleBinding",
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": role, "namespace": ns}],
        },
    )
    try:

        def allocated() -> Obj | None:
            got = kubectl(sandbox, "get", "gpuclaims", "-n", ns, "-o", "json")
            assert got.returncode == 0, got.stderr
            items = json.loads(got.stdout)["items"]
            fits = [o for o in items if o["metadata"]["name"].startswith("fits-")]
            return fits[0] if fits and fits[0]["status"]["state"] == "Allocated" else None

        claim = wait_for(allocated, 20, "the claim of fits allocated, as a gpuclaim")
        name = claim["metadata"]["name"]
        assert (claim["apiVersion"], claim["kind"]) == (f"{GROUP}/{VERSION}", "GPUClaim")
        [device] = claim["status"]["devices"]
        assert (device["node"], device["uuid"], device["cores"]) == (
            node.name,
            node.gpu_uuid(0),
            20,
        )
        table = kubectl(sandbox, "get", "gpuclaims", "-n", ns)
        head, *rows = table.stdout.splitlines()
        assert head.split()[:4] == ["NAME", "STATE", "DEVICES", "CORES"], table.stderr
        [row] = [r.split() for r in rows if r.startswith(name + " ")]
        assert row[1:5] == ["Allocated", f"{node.name}/0", "20%", "4Gi"]
        wide = kubectl(sandbox, "get", "gpuclaims", "-A", "-o", "wide")
        assert wide.stdout.splitlines()[0].split()[0] == "NAMESPACE", wide.stderr
        assert wide.stdout.splitlines()[0].split()[-2:] == ["NODES", "CLASSES"]

        reason = kubectl(sandbox, "get", "gpureason", "huge", "-n", ns, "-o", "json")
        assert reason.returncode == 0, reason.stderr
        why = json.loads(reason.stdout)
        assert why["kind"] == "GPUReason" and why["status"]["reasons"], why
        # kubectl gpuslice, with the admin's client certificate (which /view/ cannot take)
        claims = plugin(sandbox, "-n", ns, "claims", "--no-headers")
        assert claims.returncode == 0 and claims.stderr == "", claims.stderr
        assert [line.split()[:2] for line in claims.stdout.splitlines() if "fits-" in line] == [
            [name, "Allocated"]
        ]
        said = plugin(sandbox, "-n", ns, "why", "pod/huge", "-o", "json")
        assert said.returncode == 0 and said.stderr == "", said.stderr
        assert json.loads(said.stdout)["metadata"]["name"] == "huge"
        # a get of the claim that cannot fit carries why; why claim/ prints it from there
        [huge] = [
            o["metadata"]["name"]
            for o in json.loads(
                kubectl(sandbox, "get", "gpuclaims", "-n", ns, "-o", "json").stdout
            )["items"]
            if o["metadata"]["name"].startswith("huge-")
        ]
        got = kubectl(sandbox, "get", "gpuclaim", huge, "-n", ns, "-o", "json")
        codes = [r["code"] for r in json.loads(got.stdout)["status"]["reasons"]]
        assert codes and "Allocated" not in codes and "Fits" not in codes, got.stdout
        said = plugin(sandbox, "-n", ns, "why", f"claim/{huge}", "-o", "json")
        assert said.returncode == 0 and said.stderr == "", said.stderr
        claim_obj = json.loads(said.stdout)
        assert claim_obj["kind"] == "GPUClaim"
        assert [r["code"] for r in claim_obj["status"]["reasons"]] == codes

        reader = user_kubeconfig(sandbox, token(kube, ns, role), tmp_path / "reader")
        mine = kubectl(sandbox, "get", "gpuclaims", "-n", ns, "-o", "name", config=reader)
        assert mine.returncode == 0, mine.stderr
        assert f"gpuclaim.{GROUP}/{name}" in mine.stdout.split()
        theirs = kubectl(sandbox, "get", "gpuclaims", "-n", "default", config=reader)
        assert theirs.returncode == 1 and "Error from server (Forbidden)" in theirs.stderr
        assert 'in the namespace "default"' in theirs.stderr, theirs.stderr
    finally:
        for pod in ("fits", "huge"):
            with contextlib.suppress(KubeNotFoundError):
                kube.delete(resource_path("v1", "pods", namespace=ns, name=pod))
