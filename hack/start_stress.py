"""Start every gpuslice service many times under load and count the starts that abort (issue 27).

    .venv/bin/python hack/start_stress.py [--starts 200] [--services device-plugin,controller]
                                          [--load 1] [--no-grpc-traffic] [--keep]
    make start-stress STARTS=200

Each service is started ``--starts`` times, one start at a time, the way the e2e suite starts it:
``e2e.sandbox.procs.start(..., die_with_parent=True)`` from a process that itself runs gRPC. That
launcher serves a stand-in kubelet (the device plugin registers with it), asks every service's
health over gRPC, and — unless ``--no-grpc-traffic`` — keeps a thread calling its own stand-in
kubelet, as a test process's node agents answer calls all the time. ``--load`` busy-loop
processes (default 1) run beside it for the whole run. Each start waits until the service is
ready (its socket answers SERVING; the controller's /readyz answers 200), then stops it with
SIGTERM and waits for it to exit.

A start counts as an *abort* when the process ended by SIGABRT or its log holds gRPC's
"epoll_wait error"; ``before exec`` says how many of those never ran the service at all (no line
of the service's own in the log: the launcher's forked child died before exec). Anything else
that did not become ready or did not exit 0 on SIGTERM is a *failure*. The controller, the
kubelet plugin and the MIG manager need an API server: the sandbox's control plane is started
for them (the Kubernetes binaries of ``make kube-binaries``). Exit status 1 when any start
aborted or failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpuslice_core.grpcserver import check_health
from gpuslice_core.logging import configure
from gpuslice_draplugin.server import Sockets, probe
from gpuslice_testkit.device_plugin import Kubelet, write_node
from gpuslice_testkit.enforcer import stop_mps_daemons

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the e2e sandbox package
    sys.path.insert(0, str(ROOT))

from e2e.sandbox import procs  # noqa: E402
from e2e.sandbox.controlplane import ControlPlane  # noqa: E402

BIN = Path(sys.executable).parent
SERVICES = ("device-plugin", "controller", "enforcer", "kubelet-plugin", "mig-manager")
NEEDS_KUBE = frozenset({"controller", "kubelet-plugin", "mig-manager"})
DRIVER = "gpu.gpuslice.dev"
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
ABORT_MARK = b"epoll_wait error"


@dataclass
class Service:
    """How to start one service and how to tell that it is ready."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    after: Callable[[], None] = lambda: None


@dataclass
class Tally:
    """What the starts of one service came to."""

    service: str
    starts: int = 0
    ok: int = 0
    aborts: int = 0
    before_exec: int = 0
    failures: list[str] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _console(script: str) -> list[str]:
    path = BIN / script
    return [str(path)] if path.exists() else [sys.executable, "-m", script.replace("-", "_")]


def _https_ready(port: int) -> Callable[[], bool]:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # readiness only

    def ready() -> bool:
        try:
            with urllib.request.urlopen(
                f"https://127.0.0.1:{port}/readyz", context=context, timeout=2
            ) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    return ready


def services(root: Path, kubeconfig: Path | None) -> dict[str, Service]:
    """The start command and readiness check of each service, on a fake node under ``root``."""
    nvml = write_node(root, {"gpus": [{"model": "H100", "count": 2}]}, "stress-node")
    fake = [
        "--nvml=fake",
        f"--fake-nvml-config={nvml}",
        "--metrics-addr=",
        "--health-addr=",
        "--log-level=info",
    ]
    dp_dir, run = root / "device-plugins", root / "run"
    dp_dir.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    found: dict[str, Service] = {
        "device-plugin": Service(
            "device-plugin",
            [
                *_console("gpuslice-device-plugin"),
                *fake,
                "--mode-check=false",
                f"--device-plugins-dir={dp_dir}",
                f"--cdi-root={root / 'cdi-dp'}",
            ],
            lambda: check_health(dp_dir / "gpuslice-gpu.sock", timeout=1),
        ),
        "enforcer": Service(
            "enforcer",
            [
                *_console("gpuslice-enforcer"),
                *fake,
                "--node-name=stress-node",
                f"--socket={run / 'enforcer.sock'}",
                f"--state-dir={root / 'enforcer'}",
                f"--mps-root={root / 'mps'}",
                f"--hook-path={BIN / 'gpuslice-enforcer-hook'}",
            ],
            lambda: check_health(run / "enforcer.sock", timeout=1),
            after=lambda: stop_mps_daemons(root / "mps"),
        ),
    }
    if kubeconfig is not None:
        port = procs.free_port()
        found["controller"] = Service(
            "controller",
            [
                *_console("gpuslice-controller"),
                f"--kubeconfig={kubeconfig}",
                "--namespace=default",
                "--identity=stress-0",
                f"--webhook-addr=127.0.0.1:{port}",
                "--metrics-addr=",
                "--tls-secret=stress-tls",
                "--cert-hosts=127.0.0.1",
                f"--cert-dir={root / 'certs'}",
                "--lease-name=stress",
                # no webhook configurations here: readiness would wait for their CA bundle
                "--validating-webhooks=",
                "--mutating-webhooks=",
                "--log-level=info",
            ],
            _https_ready(port),
        )
        found["mig-manager"] = Service(
            "mig-manager",
            [
                *_console("gpuslice-mig-manager"),
                *fake,
                "--node-name=stress-node",
                f"--kubeconfig={kubeconfig}",
                f"--socket={run / 'mig-manager.sock'}",
                f"--state-dir={root / 'mig-manager'}",
            ],
            lambda: check_health(run / "mig-manager.sock", timeout=1),
        )
        sockets = Sockets.for_driver(
            DRIVER, registrar_dir=root / "registry", plugins_dir=root / "plugins"
        )
        found["kubelet-plugin"] = Service(
            "kubelet-plugin",
            [
                *_console("gpuslice-kubelet-plugin"),
                *fake,
                "--node-name=stress-node",
                f"--kubeconfig={kubeconfig}",
                f"--cdi-root={root / 'cdi-kp'}",
                f"--registrar-dir={root / 'registry'}",
                f"--plugins-dir={root / 'plugins'}",
                f"--state-dir={root / 'kubelet-plugin'}",
            ],
            lambda: not probe(sockets, timeout=1),
        )
    return found


def _wait_ready(proc: procs.Proc, ready: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    delay = 0.02
    while proc.alive():
        if ready():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)
    return False


def _exit_status(proc: procs.Proc) -> int:
    """SIGTERM the service's group and wait; SIGKILL after STOP_TIMEOUT. Its exit status."""
    assert proc.popen is not None
    proc.signal_group(signal.SIGTERM)
    try:
        return proc.popen.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.signal_group(signal.SIGKILL)
        return proc.popen.wait(10)


def start_once(service: Service, log: Path, env: dict[str, str], tally: Tally) -> None:
    """One start, readiness, SIGTERM and exit, recorded in ``tally``."""
    offset = log.stat().st_size if log.exists() else 0
    t0 = time.monotonic()
    proc = procs.start(service.name, service.argv, log, env, cwd=ROOT, die_with_parent=True)
    ready = _wait_ready(proc, service.ready, READY_TIMEOUT)
    ready_after = time.monotonic() - t0
    status = _exit_status(proc)
    service.after()
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read()
    tally.starts += 1
    if status == -signal.SIGABRT or ABORT_MARK in text:
        tally.aborts += 1
        own_lines = [line for line in text.splitlines()[1:] if line.startswith(b"{")]
        tally.before_exec += not own_lines
        print(f"  {service.name} start {tally.starts}: ABORT (status {status})", flush=True)
        print("    " + text.decode(errors="replace")[-600:].replace("\n", "\n    "), flush=True)
    elif not ready or status != 0:
        why = "not ready" if not ready else f"exit status {status} on SIGTERM"
        tally.failures.append(f"start {tally.starts}: {why}")
        print(f"  {service.name} start {tally.starts}: FAILED ({why})", flush=True)
        print("    " + text.decode(errors="replace")[-600:].replace("\n", "\n    "), flush=True)
    else:
        tally.ok += 1
        tally.ready_s.append(ready_after)


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """``processes`` busy loops beside the starts."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)
    ]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


@contextlib.contextmanager
def grpc_traffic(kubelet_socket: Path, enabled: bool) -> Iterator[None]:
    """A thread that keeps calling the stand-in kubelet's health service, as a test process's
    node agents serve calls all the time."""
    stop = threading.Event()

    def call() -> None:
        with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                with contextlib.suppress(grpc.RpcError):
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                stop.wait(0.002)

    thread = threading.Thread(target=call, name="grpc-traffic", daemon=True)
    if enabled:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if enabled:
            thread.join(5)


def _interrupted(signum: int, _frame: object) -> None:
    """Stop the run through the ``finally`` blocks: the load, the sandbox and the service end."""
    raise SystemExit(128 + signum)


def _initial_env(name: str) -> str:
    """``name`` as this process was started with it (importing gpuslice_core may set a default
    in ``os.environ`` later, after grpc has read it)."""
    for entry in Path("/proc/self/environ").read_bytes().split(b"\0"):
        key, _, value = entry.partition(b"=")
        if key.decode(errors="replace") == name:
            return value.decode(errors="replace")
    return "(unset)"


def report(tallies: list[Tally], args: argparse.Namespace) -> None:
    print(
        f"\n{args.starts} starts per service; load: {args.load} busy loop(s) on "
        f"{os.cpu_count()} CPUs; gRPC traffic in the launcher: "
        f"{'off' if args.no_grpc_traffic else 'on'}; "
        f"GRPC_ENABLE_FORK_SUPPORT at start: {_initial_env('GRPC_ENABLE_FORK_SUPPORT')}"
    )
    print(
        f"{'service':<16}{'starts':>7}{'ok':>6}{'aborts':>8}{'(before exec)':>15}"
        f"{'failed':>8}{'ready p50':>11}{'ready max':>11}{'wall':>9}"
    )
    for t in tallies:
        p50 = statistics.median(t.ready_s) if t.ready_s else float("nan")
        top = max(t.ready_s) if t.ready_s else float("nan")
        print(
            f"{t.service:<16}{t.starts:>7}{t.ok:>6}{t.aborts:>8}{t.before_exec:>15}"
            f"{len(t.failures):>8}{p50:>10.2f}s{top:>10.2f}s{t.seconds:>8.0f}s"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--starts", type=int, default=200, help="Starts of each service.")
    parser.add_argument(
        "--services",
        default=",".join(SERVICES),
        help=f"Comma-separated services to start (default: all of {', '.join(SERVICES)}).",
    )
    parser.add_argument("--load", type=int, default=1, help="Busy-loop processes beside it.")
    parser.add_argument(
        "--no-grpc-traffic",
        action="store_true",
        help="Do not keep the launcher's own gRPC calls going between and during starts.",
    )
    parser.add_argument("--keep", action="store_true", help="Keep the logs' directory.")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.services.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SERVICES))
    if unknown:
        parser.error(f"unknown services {unknown}; known: {', '.join(SERVICES)}")
    configure(component="start-stress", level="warning")
    for stop in (signal.SIGTERM, signal.SIGINT):  # also when started in the background
        signal.signal(stop, _interrupted)
    root = Path(tempfile.mkdtemp(prefix="gss-"))  # short: unix socket paths <= 107 bytes
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KUBECONFIG", "NODE_NAME", "GPUSLICE_NODE_NAME")
    }
    env["PYTHONUNBUFFERED"] = "1"
    sandbox = ControlPlane(root / "cp") if NEEDS_KUBE & set(chosen) else None
    kubelet = Kubelet(root / "device-plugins")
    tallies: list[Tally] = []
    try:
        if sandbox is not None:
            sandbox.start()
        found = services(root, sandbox.kubeconfig if sandbox is not None else None)
        kubelet.start()
        with (
            cpu_load(args.load),
            grpc_traffic(kubelet.dir / "kubelet.sock", not args.no_grpc_traffic),
        ):
            for name in chosen:
                tally = Tally(name)
                tallies.append(tally)
                t0 = time.monotonic()
                for _ in range(args.starts):
                    start_once(found[name], root / "logs" / f"{name}.log", env, tally)
                tally.seconds = time.monotonic() - t0
                print(f"{name}: {tally.ok}/{tally.starts} ok, {tally.aborts} aborts", flush=True)
    finally:
        kubelet.stop()
        if sandbox is not None:
            sandbox.stop()
        if args.keep:
            print(f"logs kept in {root / 'logs'}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    report(tallies, args)
    return 1 if any(t.aborts or t.failures for t in tallies) else 0


if __name__ == "__main__":
    sys.exit(main())
