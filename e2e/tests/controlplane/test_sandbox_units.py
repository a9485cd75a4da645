"""Parts of the sandbox that need no Kubernetes binaries: certificates, flag detection,
the missing-binaries message, process and port bookkeeping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from e2e.sandbox import flags, procs
from e2e.sandbox.apiproxy import upstream_for
from e2e.sandbox.binaries import (
    REPO_ROOT,
    SCRIPT,
    BinariesMissingError,
    find_binaries,
    pinned_versions,
)
from gpuslice_testkit.certs import TinyCA, service_account_key


def test_pinned_versions_come_from_versions_env() -> None:
    pins = pinned_versions()
    assert pins["KUBE_VERSION"].startswith("v1.")
    assert pins["ETCD_VERSION"].startswith("v3.")


def test_missing_binaries_fail_with_how_to_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUSLICE_KUBE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    monkeypatch.delenv("GPUSLICE_KUBE_BIN_DIR", raising=False)
    with pytest.raises(BinariesMissingError) as err:
        find_binaries()
    assert "make kube-binaries" in str(err.value)
    assert "hack/kube-binaries.sh" in str(err.value)


def test_incomplete_kubebuilder_assets_are_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in ("etcd", "kube-apiserver", "kubectl"):  # what setup-envtest ships: no kcm
        (assets / name).write_text("#!/bin/sh\n")
        (assets / name).chmod(0o755)
    env = {**os.environ, "KUBEBUILDER_ASSETS": str(assets), "GPUSLICE_KUBE_CACHE": str(tmp_path)}
    out = subprocess.run(
        ["bash", str(SCRIPT), "--print-dir"], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 1
    assert "lacks: kube-controller-manager kube-scheduler" in out.stderr


def test_certificates_have_loopback_sans_and_groups(tmp_path: Path) -> None:
    ca = TinyCA(tmp_path)
    serving = x509.load_pem_x509_certificate(ca.serving("srv").cert.read_bytes())
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    admin = x509.load_pem_x509_certificate(
        ca.client("admin", "sandbox-admin", ("system:masters",)).cert.read_bytes()
    )
    orgs = [a.value for a in admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert orgs == ["system:masters"]
    assert admin.issuer == x509.load_pem_x509_certificate(ca.cert_pem).subject
    sa = service_account_key(tmp_path)
    assert b"PUBLIC KEY" in sa.cert.read_bytes()
    assert oct(sa.key.stat().st_mode & 0o777) == "0o600"


HELP = """
      --feature-gates colonSeparatedMultimapStringString
                Comma-separated list of component:key=value pairs that describe feature gates
                for alpha/experimental features. Options are:
                kube:AllAlpha=true|false (ALPHA - default=false)
                kube:DRAConsumableCapacity=true|false (BETA - default=true)
                kube:DRADeviceBindingConditions=true|false (BETA - default=true)
                kube:DRAPartitionableDevices=true|false (ALPHA - default=false)
                SomeOldGate=true|false (DEPRECATED - default=false)
"""


def test_gate_detection_sets_only_listed_gates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "fake-apiserver"
    binary.write_text(f"#!/bin/sh\ncat <<'EOF'\n{HELP}\nEOF\n")
    binary.chmod(0o755)
    listed = flags.listed_gates(binary)
    assert listed["DRAPartitionableDevices"] == flags.Gate(
        "DRAPartitionableDevices", "ALPHA", False
    )
    assert "SomeOldGate" in listed
    gates = flags.dra_gates(binary)
    # GA gates (hidden from --help) and gates the release lacks are never passed
    assert gates == {"DRAConsumableCapacity": True, "DRAPartitionableDevices": True}
    assert flags.gate_flag(gates) == [
        "--feature-gates=DRAConsumableCapacity=true,DRAPartitionableDevices=true"
    ]


def test_runtime_config_serves_v1_v1beta2_v1beta1() -> None:
    assert flags.runtime_config(37) == (
        "resource.k8s.io/v1=true,resource.k8s.io/v1beta2=true,resource.k8s.io/v1beta1=true"
    )
    assert "resource.k8s.io/v1alpha3=true" in flags.runtime_config(34)


def test_process_group_is_stopped_and_port_freed(tmp_path: Path) -> None:
    port = procs.free_port()
    server = (
        "import socket, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen()\n"
        "time.sleep(600)\n"
    )
    p = procs.start(
        "sleeper",
        [sys.executable, "-c", server],
        tmp_path / "sleeper.log",
        {"PATH": os.environ["PATH"]},
        cwd=tmp_path,
        die_with_parent=True,
    )
    deadline = time.monotonic() + 20
    while procs.port_is_free(port) and time.monotonic() < deadline and p.alive():
        time.sleep(0.05)
    assert p.alive(), p.log_tail()
    assert port in procs.listening_ports(p.pid)
    assert not procs.port_is_free(port)
    assert procs.stop([p], grace=5.0) == []
    assert not p.alive()
    assert procs.port_is_free(port)


def test_service_relay_picks_the_api_server_of_the_pods_node(tmp_path: Path) -> None:
    """Every real node's relay of 10.0.0.1:443 may take any pod's connection: the API server is
    chosen by the pod's subnet (slot n: 10.244.n.0/24) from that slot's registry record."""
    (tmp_path / "slot-3.json").write_text(json.dumps({"apiserver": "127.0.0.1:41234"}))
    (tmp_path / "slot-5.json").write_text("{not json")
    default = ("127.0.0.1", 6443)
    assert upstream_for("10.244.3.7", tmp_path, default) == ("127.0.0.1", 41234)
    assert upstream_for("10.244.4.2", tmp_path, default) == default  # no record
    assert upstream_for("10.244.5.2", tmp_path, default) == default  # unreadable record
    assert upstream_for("127.0.0.1", tmp_path, default) == default  # not a pod
    assert upstream_for("10.244.3.7", None, default) == default


# ---- starting processes without fork() (issue 27) -------------------------------------------
# Runs in a fresh interpreter: a pthread_atfork handler cannot be removed again. It counts the
# fork() calls whose libc fork handlers run (gRPC's are such handlers; vfork() runs none).
FORK_PROBE = """
import ctypes, os, subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from e2e.sandbox import procs
forks = []
prepare = ctypes.CFUNCTYPE(None)(lambda: forks.append(1))
assert ctypes.CDLL(None).__register_atfork(prepare, None, None, None) == 0  # pthread_atfork
subprocess.run(["true"], preexec_fn=lambda: None, check=True)  # the probe sees a fork()
seen = len(forks)
p = procs.start("sleeper", ["sleep", "60"], Path(sys.argv[2]), {"PATH": os.environ["PATH"]},
                cwd=Path(sys.argv[3]), die_with_parent=True)
procs.stop([p], grace=5.0)
print(seen, len(forks) - seen)
"""


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def test_start_runs_no_fork_handlers_in_the_launcher(tmp_path: Path) -> None:
    """A ``preexec_fn`` made subprocess fork() the launcher: in a test process that runs gRPC,
    gRPC's fork handlers then restarted its poller in the child, ``close_fds`` closed the
    poller's epoll descriptor and the child aborted before exec ("epoll_wait error: Bad file
    descriptor"), which the e2e tests saw as the device plugin or the controller aborting at
    start-up. procs.start must start processes without fork(), so no fork handler runs."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_PROBE, str(REPO_ROOT), str(tmp_path / "s.log"), tmp_path],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    probe_saw, start_forked = (int(n) for n in out.stdout.split())
    assert probe_saw == 1, "the probe does not see fork handlers run"
    assert start_forked == 0, "procs.start forked the launcher: fork handlers ran"


def test_the_started_pid_is_the_commands(tmp_path: Path) -> None:
    p = procs.start(
        "sleeper",
        ["sleep", "60"],
        tmp_path / "sleeper.log",
        {"PATH": os.environ["PATH"]},
        cwd=tmp_path,
        die_with_parent=True,
    )
    try:
        deadline = time.monotonic() + 10
        while _cmdline(p.pid) != ["sleep", "60"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _cmdline(p.pid) == ["sleep", "60"]
        assert p.alive()
    finally:
        procs.stop([p], grace=5.0)


def test_a_process_dies_with_the_thread_that_started_it(tmp_path: Path) -> None:
    started: list[procs.Proc] = []

    def launch() -> None:
        started.append(
            procs.start(
                "sleeper",
                ["sleep", "60"],
                tmp_path / "sleeper.log",
                {"PATH": os.environ["PATH"]},
                cwd=tmp_path,
                die_with_parent=True,
            )
        )

    thread = threading.Thread(target=launch)
    thread.start()
    thread.join()
    (p,) = started
    deadline = time.monotonic() + 10
    while p.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not p.alive(), "PR_SET_PDEATHSIG did not kill the process when its thread ended"
    assert p.returncode() == -signal.SIGKILL


def test_a_missing_program_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        procs.start(
            "nothing",
            ["gpuslice-no-such-program"],
            tmp_path / "nothing.log",
            {"PATH": os.environ["PATH"]},
            cwd=tmp_path,
            die_with_parent=True,
        )
