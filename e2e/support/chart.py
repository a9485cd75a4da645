"""The chart charts/gpuslice rendered offline with `helm template`, and what the tests read from
the rendered objects (e2e/scenarios/chart.py installs it into a cluster instead).

``helm_bin`` (the helm binary from hack/install-helm.sh) is a fixture in e2e/tests/conftest.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.sandbox.binaries import REPO_ROOT
from gpuslice_core.cli import EnvArgumentParser
from gpuslice_kube.raw import RawApi

Obj = dict[str, Any]

CHART = REPO_ROOT / "charts" / "gpuslice"
SA_GROUPS = ["system:serviceaccounts", "system:authenticated"]


def helm(
    helm_bin: Path, *args: str, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [str(helm_bin), *args], capture_output=True, text=True, input=stdin, timeout=120
    )
    if check and out.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed (rc {out.returncode}):\n{out.stderr}")
    return out


def render(
    helm_bin: Path, *args: str, release: str = "gpuslice", namespace: str = "gpuslice"
) -> list[Obj]:
    out = helm(helm_bin, "template", release, str(CHART), "-n", namespace, *args)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def container_images(obj: Any) -> set[str]:
    """Every container image in rendered objects (containers, initContainers, anywhere)."""
    found: set[str] = set()
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("containers", "initContainers", "ephemeralContainers"):
                found |= {c["image"] for c in value}
            else:
                found |= container_images(value)
    elif isinstance(obj, list):
        for item in obj:
            found |= container_images(item)
    return found


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} rendered"
    return found[0]


def daemonset(objs: list[Obj], component: str = "node") -> Obj:
    """The DaemonSet of one component: node (DRA) or device-plugin."""
    found = [
        o
        for o in find(objs, "DaemonSet")
        if o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, f"DaemonSet {component}: {len(found)} rendered"
    return found[0]


def pod_spec(objs: list[Obj], component: str = "node") -> Obj:
    spec: Obj = daemonset(objs, component)["spec"]["template"]["spec"]
    return spec


def containers(objs: list[Obj], component: str = "node") -> dict[str, Obj]:
    spec = pod_spec(objs, component)
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def env_of(container: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def sets(*assignments: str) -> list[str]:
    """``--set`` arguments: sets("a=1", "b=2") -> --set a=1 --set b=2."""
    return [arg for assignment in assignments for arg in ("--set", assignment)]


def set_json(key: str, value: object) -> list[str]:
    return ["--set-json", f"{key}={json.dumps(value)}"]


# Variables that are not flags of every service: the pod UID for the socket names (a flag of the
# kubelet plugin only), the NVIDIA Container Toolkit's.
NOT_FLAGS = {"GPUSLICE_POD_UID", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}


def flag_variables(parser: EnvArgumentParser) -> set[str]:
    """The variables the service's flags read (``GPUSLICE_<FLAG>``, ``KUBECONFIG``)."""
    return set(parser.variables)


def every_name(parser: EnvArgumentParser) -> set[str]:
    """Every variable the service reads, aliases and deprecated names too (a test clears them
    all, so the machine's own NODE_NAME or LOG_LEVEL never leaks into what it checks)."""
    names = set(parser.variables)
    for others in parser.other_names.values():
        names.update(others)
    return names


def allowed(kube: RawApi, user: str, attributes: Obj) -> bool:
    review = kube.create(
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": SA_GROUPS, "resourceAttributes": attributes},
        },
    )
    return bool(review["status"].get("allowed"))
