"""The real control plane of the sandbox: version, DRA API surface, validation by the real
kube-apiserver, and a clean stop (no process left, no port bound) even when killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox import procs
from e2e.sandbox.binaries import REPO_ROOT, KubeBinaries, pinned_versions
from e2e.sandbox.controlplane import ControlPlane

# the fixture's start-up (tens of seconds on 2 busy cores) counts against the first test
pytestmark = pytest.mark.timeout(300)

DRIVER = "gpu.gpuslice.dev"


def kubectl(
    cp: ControlPlane, *args: str, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [str(cp.binaries.path("kubectl")), f"--kubeconfig={cp.kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if check and out.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stderr}")
    return out


def gpu_device(index: int, memory: str = "80Gi") -> dict[str, Any]:
    """A whole GPU as the kubelet plugin publishes it, consumable cores and memory
    (docs/kubelet-plugin.md, "Device model")."""
    return {
        "name": f"gpu-{index}",
        "allowMultipleAllocations": True,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-00000000-0000-0000-0000-{index:012d}"},
            "index": {"int": index},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "cudaComputeCapability": {"version": "9.0.0"},
        },
        "capacity": {
            "cores": {
                "value": "100",
                "requestPolicy": {
                    "default": "100",
                    "validRange": {"min": "1", "max": "100", "step": "1"},
                },
            },
            "memory": {
                "value": memory,
                "requestPolicy": {"default": memory, "validRange": {"min": "1Mi", "step": "1Mi"}},
            },
        },
    }


def resource_slice(name: str, node: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def test_kubectl_version_shows_the_pinned_release(
    sandbox: ControlPlane, kube_binaries: KubeBinaries
) -> None:
    out = json.loads(kubectl(sandbox, "version", "--output=json").stdout)
    expected = kube_binaries.kube_version
    if not (os.environ.get("GPUSLICE_KUBE_BIN_DIR") or os.environ.get("KUBEBUILDER_ASSETS")):
        pinned = pinned_versions()["KUBE_VERSION"]
        # KUBE_VERSION=1.34 (a minor only) selects that minor's newest cached patch
        assert expected == pinned or expected.startswith(pinned + ".")
    assert out["serverVersion"]["gitVersion"] == expected
    assert out["clientVersion"]["gitVersion"] == expected
    assert out["serverVersion"]["minor"] == str(kube_binaries.minor)


def test_every_component_is_healthy(sandbox: ControlPlane) -> None:
    assert sandbox.health() == {
        "etcd": True,
        "kube-apiserver": True,
        "kube-controller-manager": True,
        "kube-scheduler": True,
    }


def test_dra_api_versions_and_kinds_are_served(sandbox: ControlPlane) -> None:
    versions = set(kubectl(sandbox, "api-versions").stdout.split())
    assert {"resource.k8s.io/v1", "resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1"} <= versions
    kinds = kubectl(sandbox, "api-resources", "--api-group=resource.k8s.io", "-o", "name").stdout
    for kind in ("resourceslices", "resourceclaims", "resourceclaimtemplates", "deviceclasses"):
        assert f"{kind}.resource.k8s.io" in kinds.split()
    # DeviceTaintRule: v1alpha3 on 1.34-1.35, v1beta2 on 1.36, v1 on 1.37; served on each
    assert "devicetaintrules.resource.k8s.io" in kinds.split()


def test_slice_with_129_devices_is_refused_by_the_api_server(sandbox: ControlPlane) -> None:
    body = resource_slice("too-many", "node-too-many", [gpu_device(i) for i in range(129)])
    # straight to the API: the Status object the API server itself returns
    req = urllib.request.Request(
        f"{sandbox.server}/apis/resource.k8s.io/v1/resourceslices",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30, context=sandbox.tls_context())
    status = json.loads(err.value.read())
    assert err.value.code == 422
    assert status["reason"] == "Invalid"
    assert status["message"] == (
        'ResourceSlice.resource.k8s.io "too-many" is invalid: '
        "spec.devices: Too many: 129: must have at most 128 items"
    )
    assert status["details"]["causes"][0]["field"] == "spec.devices"
    # and what a user sees through kubectl
    out = kubectl(sandbox, "create", "-f", "-", stdin=json.dumps(body), check=False)
    assert out.returncode != 0
    assert out.stderr.strip() == (
        'The ResourceSlice "too-many" is invalid: '
        "spec.devices: Too many: 129: must have at most 128 items"
    )
    missing = kubectl(sandbox, "get", "resourceslice", "too-many", check=False)
    assert "NotFound" in missing.stderr


def test_consumable_capacity_slice_is_accepted_and_kept(sandbox: ControlPlane) -> None:
    body = resource_slice("node-a-gpus", "node-a", [gpu_device(0), gpu_device(1, "40Gi")])
    kubectl(sandbox, "create", "-f", "-", stdin=json.dumps(body))
    try:
        got = json.loads(
            kubectl(sandbox, "get", "resourceslice", "node-a-gpus", "-o", "json").stdout
        )
        dev = got["spec"]["devices"][1]
        # a gate that is off in the API server would silently drop these fields on write
        assert dev["allowMultipleAllocations"] is True
        assert dev["capacity"]["cores"]["requestPolicy"]["validRange"] == {
            "min": "1",
            "max": "100",
            "step": "1",
        }
        assert dev["capacity"]["memory"]["requestPolicy"]["default"] == "40Gi"
    finally:
        kubectl(sandbox, "delete", "resourceslice", "node-a-gpus", "--wait=false")


def test_invalid_request_policy_is_refused(sandbox: ControlPlane) -> None:
    device = gpu_device(0)
    device["capacity"]["cores"]["requestPolicy"]["default"] = "150"  # outside 1..100
    body = resource_slice("bad-policy", "node-b", [device])
    out = kubectl(sandbox, "create", "-f", "-", stdin=json.dumps(body), check=False)
    assert out.returncode != 0
    assert "requestPolicy" in out.stderr, out.stderr


def _wait_gone(pids: list[tuple[int, int | None]], timeout: float) -> list[str]:
    """Waits until none of the (pid, start time) processes exists; describes the survivors."""
    deadline = time.monotonic() + timeout
    alive = [pid for pid, st in pids if st is not None and procs.proc_start_time(pid) == st]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid, st in pids if procs.proc_start_time(pid) == st]
    out = []
    for pid in alive:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            out.append(f"{pid} {cmd} stat={stat[:100]}")
        except OSError as exc:
            out.append(f"{pid} ({exc})")
    return out


def _busy_ports(ports: set[int], timeout: float = 5.0) -> list[int]:
    """Ports still bound after up to `timeout` s (the kernel closes them as the last thread of
    a process exits; a leak stays bound)."""
    deadline = time.monotonic() + timeout
    busy = [p for p in sorted(ports) if not procs.port_is_free(p)]
    while busy and time.monotonic() < deadline:
        time.sleep(0.1)
        busy = [p for p in busy if not procs.port_is_free(p)]
    return busy


def test_stop_leaves_no_process_and_no_bound_port(
    kube_binaries: KubeBinaries, tmp_path: Path
) -> None:
    cp = ControlPlane(tmp_path / "own", binaries=kube_binaries)
    with cp:
        assert cp.ports is not None
        started = [(p.pid, p.start_time) for p in cp.processes]
        ports = {port for p in cp.processes for port in p.ports}
        assert len(started) == 4
        assert set(cp.ports.all()) <= ports  # what each process really listens on
        assert not any(procs.port_is_free(port) for port in ports)
    assert _wait_gone(started, 0) == []
    assert _busy_ports(ports) == []
    assert cp.leftovers() == []
    assert not (cp.run_dir / "state.json").exists()


@pytest.mark.usefixtures("kube_binaries")  # fails with how to build them when missing
def test_killed_owner_takes_the_control_plane_with_it(tmp_path: Path) -> None:
    """SIGKILL of the test process (no cleanup code runs) still leaves nothing behind."""
    run_dir = tmp_path / "killed"
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from pathlib import Path
        from e2e.sandbox.controlplane import ControlPlane
        cp = ControlPlane(Path({str(run_dir)!r}))
        cp.start()
        print("STARTED", flush=True)
        time.sleep(600)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.strip() == "STARTED", owner.stderr.read() if owner.stderr else line
        state = json.loads((run_dir / "state.json").read_text())
        started = [(p["pid"], p["start_time"]) for p in state["processes"]]
        ports = {port for p in state["processes"] for port in p["ports"]}
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        assert _wait_gone(started, 15) == []
        assert _busy_ports(ports) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


@pytest.mark.usefixtures("kube_binaries")
def test_cli_up_status_down(tmp_path: Path) -> None:
    run_dir = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "e2e.sandbox.controlplane", *args, f"--run-dir={run_dir}"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )

    up = cli("up")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"export KUBECONFIG={run_dir / 'kubeconfig'}" in up.stdout
        status = cli("status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count("healthy") == 4, status.stdout
        state = json.loads((run_dir / "state.json").read_text())
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    started = [(p["pid"], p["start_time"]) for p in state["processes"]]
    assert _wait_gone(started, 0) == []
    ports = {port for p in state["processes"] for port in p["ports"]}
    assert _busy_ports(ports) == []
    assert cli("status").returncode == 3
