"""`kubectl-gpuslice top gpus` against the real API server with the controller running: rows
from the controller's /view/ (with a reader's token the real API server reviews), and rows from
the API listing, with the one-line note, once the controller is stopped.

The sandbox's controller listens on loopback, and the API server's service proxy refuses
loopback endpoints, so the plugin is pointed straight at it (`--controller https://...`, the
design's direct path); the proxied path is covered by
tools/kubectl-gpuslice/tests/test_remote.py."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import GpuNode
from e2e.sandbox.nodeagent.testing import unique
from e2e.support.controller import Controller, running_controller, token
from gpuslice_kube.raw import RawApi, resource_path
from gpuslice_view.resource import API_VERSION, row_of

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(180)


PLUGIN = Path(sys.executable).parent / "kubectl-gpuslice"


@pytest.fixture
def controller(sandbox: ControlPlane, ns: str, tmp_path: Path) -> Iterator[Controller]:
    with running_controller(sandbox, ns, tmp_path) as ctl:
        yield ctl


@pytest.fixture
def user_token(kube: RawApi, ns: str) -> Iterator[str]:
    """A token of a ServiceAccount bound to cluster-admin: the view's permission and the
    reads the API listing needs (the view's own RBAC is test_controller_view's)."""
    account, rbac = unique("admin"), "rbac.authorization.k8s.io/v1"
    binding = {
        "apiVersion": rbac,
        "kind": "ClusterRoleBinding",
        "metadata": {"name": account},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "cluster-admin",
        },
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}],
    }
    kube.create(resource_path(rbac, "clusterrolebindings"), binding)
    try:
        yield token(kube, ns, account)
    finally:
        kube.delete(resource_path(rbac, "clusterrolebindings", name=account))


def user_kubeconfig(sandbox: ControlPlane, token: str, path: Path) -> Path:
    """The sandbox's cluster with a bearer token (a user's kubeconfig)."""
    admin = json.loads(sandbox.kubeconfig.read_text())
    cluster = admin["clusters"][0]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": "user", "user": {"token": token}}],
        "contexts": [{"name": "u", "context": {"cluster": cluster["name"], "user": "user"}}],
        "current-context": "u",
    }
    path.write_text(json.dumps(config))
    return path


def plugin(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PLUGIN), "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_top_gpus_reads_the_controller_then_falls_back_to_the_api(
    sandbox: ControlPlane,
    kube: RawApi,
    node: GpuNode,
    ns: str,
    controller: Controller,
    user_token: str,
    tmp_path: Path,
) -> None:
    secret = kube.get(resource_path("v1", "secrets", namespace=ns, name="view-tls"))
    ca = tmp_path / "ca.crt"
    ca.write_bytes(base64.b64decode(secret["data"]["ca.crt"]))
    kubeconfig = user_kubeconfig(sandbox, user_token, tmp_path / "config")
    where = ("--controller", f"https://127.0.0.1:{controller.port}", "--controller-ca", str(ca))

    done = plugin(kubeconfig, *where, "--source", "controller", "top", "gpus", "-o", "json")
    assert done.returncode == 0, done.stderr
    # other test modules' GPU nodes may still be going away: only this node's rows count
    listed = json.loads(done.stdout)
    assert (listed["apiVersion"], listed["kind"]) == (API_VERSION, "GPUList")
    rows: list[Any] = [row_of(o) for o in listed["items"] if o["spec"]["node"] == node.name]
    assert len(rows) == 1
    assert rows[0]["live"]["state"] in ("ok", "unknown", "stale", "unreachable")
    assert done.stderr == ""
    table = plugin(kubeconfig, *where, "top", "gpus")
    assert table.returncode == 0 and table.stderr == "", table.stderr
    assert table.stdout.splitlines()[0].split()[:3] == ["NODE", "DEVICE", "MODEL"]
    assert node.name in table.stdout

    controller.stop()
    done = plugin(kubeconfig, *where, "top", "gpus", "-o", "json")
    assert done.returncode == 0, done.stderr
    assert [o["spec"]["node"] for o in json.loads(done.stdout)["items"]].count(node.name) == 1
    [note] = done.stderr.splitlines()
    assert note.startswith("kubectl-gpuslice: reading from the API server (used columns show -):")
    assert "did not answer" in note
    strict = plugin(kubeconfig, *where, "--source", "controller", "top", "gpus")
    assert strict.returncode == 1 and "did not answer" in strict.stderr
