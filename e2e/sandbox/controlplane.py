"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler of the pinned release (hack/kube-binaries.sh), as local processes.

    with ControlPlane(run_dir) as cp:      # starts, waits until every component is healthy
        subprocess.run(["kubectl", "--kubeconfig", cp.kubeconfig, "get", "ns"])
    # stopped: every process gone, every port free

CLI (state in .sandbox/ or $GPUSLICE_SANDBOX_DIR):
    python -m e2e.sandbox.controlplane up|down|status
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import json
import os
import shutil
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from e2e.sandbox import flags, procs
from e2e.sandbox.binaries import REPO_ROOT, BinariesMissingError, KubeBinaries, find_binaries
from gpuslice_testkit.certs import APISERVER_DNS, APISERVER_IPS, TinyCA, service_account_key

HOST = procs.LOOPBACK
STATE_FILE = "state.json"
SERVICE_CIDR = "10.0.0.0/24"
DEFAULT_RUN_DIR = REPO_ROOT / ".sandbox"
START_ATTEMPTS = 3  # a port taken between choosing it and binding it: retry with new ports
# Grace periods before SIGKILL, in stop order.
GRACE = {
    "kube-scheduler": 10.0,
    "kube-controller-manager": 10.0,
    "kube-apiserver": 15.0,
    "etcd": 10.0,
}
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
_ENV_KEEP = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "TZ")


class StartError(RuntimeError):
    """A component did not become healthy; the message carries its log tail."""


@dataclass
class Ports:
    etcd: int
    etcd_peer: int
    apiserver: int
    kcm: int
    scheduler: int

    @classmethod
    def choose(cls) -> Ports:
        chosen: list[int] = []
        while len(chosen) < 5:
            p = procs.free_port()
            if p not in chosen:
                chosen.append(p)
        return cls(*chosen)

    def all(self) -> list[int]:
        return [self.etcd, self.etcd_peer, self.apiserver, self.kcm, self.scheduler]


@dataclass
class Timings:
    seconds: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items())


def _child_env() -> dict[str, str]:
    """A clean environment: no ETCD_* (etcd reads them as flags), no KUBECONFIG."""
    env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
    env.setdefault("PATH", "/usr/bin:/bin")
    return env


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> Path:
    """A kubeconfig with the CA and the client credentials embedded (JSON is valid YAML)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "gpuslice-sandbox",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)},
            }
        ],
        "contexts": [
            {"name": "gpuslice-sandbox", "context": {"cluster": "gpuslice-sandbox", "user": user}}
        ],
        "current-context": "gpuslice-sandbox",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler under `run_dir`.

    owned=True (tests): children die with this process (PR_SET_PDEATHSIG) and are stopped at
    interpreter exit. The kernel ties them to the *thread* that started them, so call start()
    from a thread that lives as long as the control plane (the main thread, as fixtures do).
    owned=False (`up`): children outlive it; `down` stops them from state.json.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        binaries: KubeBinaries | None = None,
        owned: bool = True,
        start_timeout: float = 120.0,
        verbosity: int = 1,
    ) -> None:
        self.run_dir = run_dir.resolve()
        self._binaries = binaries
        self.owned = owned
        self.start_timeout = start_timeout
        self.verbosity = verbosity
        self.ports: Ports | None = None
        self.processes: list[procs.Proc] = []
        self.timings = Timings()
        self._lock = threading.Lock()

    # ---- paths -------------------------------------------------------------------------------
    @property
    def binaries(self) -> KubeBinaries:
        if self._binaries is None:
            self._binaries = find_binaries()
        return self._binaries

    @property
    def pki(self) -> Path:
        return self.run_dir / "pki"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (user sandbox-admin, group system:masters)."""
        return self.run_dir / "kubeconfig"

    @property
    def server(self) -> str:
        if self.ports is None:
            raise RuntimeError("the control plane is not started")
        return f"https://{HOST}:{self.ports.apiserver}"

    @property
    def kube_version(self) -> str:
        return self.binaries.kube_version

    # ---- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start everything and wait until healthy; on failure nothing is left running."""
        binaries = self.binaries  # raises BinariesMissingError before anything starts
        if self.owned:
            _OWNED.add(self)
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_once(binaries)
                return
            except StartError as exc:
                self.stop()
                port_race = "address already in use" in str(exc)
                if not port_race or attempt == START_ATTEMPTS:
                    raise
                print(f"sandbox: a port was taken meanwhile, retrying ({exc.args[0][:80]})")
            except BaseException:
                self.stop()
                raise

    def _start_once(self, binaries: KubeBinaries) -> None:
        t_all = time.monotonic()
        self.timings = Timings()
        self.ports = ports = Ports.choose()
        if self.run_dir.exists():
            for sub in ("pki", "etcd-data", "apiserver-certs"):
                shutil.rmtree(self.run_dir / sub, ignore_errors=True)
        for sub in ("pki", "logs", "apiserver-certs"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        ca = TinyCA(self.pki)
        serving = ca.serving("apiserver", extra_dns=APISERVER_DNS, extra_ips=APISERVER_IPS)
        kcm_serving = ca.serving("kube-controller-manager-serving")
        sched_serving = ca.serving("kube-scheduler-serving")
        admin = ca.client("admin", "sandbox-admin", ("system:masters",))
        kcm_client = ca.client("kube-controller-manager", "system:kube-controller-manager")
        sched_client = ca.client("kube-scheduler", "system:kube-scheduler")
        # what the API server presents to kubelets (logs, exec): real nodes verify it
        kubelet_client = ca.client(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",)
        )
        sa = service_account_key(self.pki)
        # the front-proxy (request-header) CA and client, as kubeadm sets them up: completes the
        # extension-apiserver-authentication ConfigMap that kcm and the scheduler read, and lets
        # aggregated API servers trust the apiserver's proxied requests
        front_ca = TinyCA(self.pki / "front-proxy", "gpuslice-sandbox-front-proxy-ca")
        front_client = front_ca.client("front-proxy-client", "front-proxy-client")
        server = self.server
        write_kubeconfig(
            self.kubeconfig, server, ca.pair.cert, admin.cert, admin.key, "sandbox-admin"
        )
        kcm_kc = write_kubeconfig(
            self.run_dir / "kube-controller-manager.kubeconfig",
            server,
            ca.pair.cert,
            kcm_client.cert,
            kcm_client.key,
            "system:kube-controller-manager",
        )
        sched_kc = write_kubeconfig(
            self.run_dir / "kube-scheduler.kubeconfig",
            server,
            ca.pair.cert,
            sched_client.cert,
            sched_client.key,
            "system:kube-scheduler",
        )
        sched_config = self.run_dir / "kube-scheduler-config.yaml"
        sched_config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(sched_kc), "qps": 100, "burst": 200},
                    "leaderElection": {"leaderElect": False},
                },
                indent=2,
            )
            + "\n"
        )
        self.timings.seconds["certs"] = time.monotonic() - t
        tls = self.tls_context()
        v = f"--v={self.verbosity}"
        bind = f"--bind-address={HOST}"

        # etcd ---------------------------------------------------------------------------------
        etcd_url = f"http://{HOST}:{ports.etcd}"
        self._launch(
            "etcd",
            [
                str(binaries.path("etcd")),
                "--name=sandbox",
                f"--data-dir={self.run_dir / 'etcd-data'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://{HOST}:{ports.etcd_peer}",
                f"--initial-advertise-peer-urls=http://{HOST}:{ports.etcd_peer}",
                f"--initial-cluster=sandbox=http://{HOST}:{ports.etcd_peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            lambda: _etcd_healthy(etcd_url),
        )

        # kube-apiserver ---------------------------------------------------------------------
        apiserver = binaries.path("kube-apiserver")
        self._launch(
            "kube-apiserver",
            [
                str(apiserver),
                f"--etcd-servers={etcd_url}",
                bind,
                f"--secure-port={ports.apiserver}",
                f"--advertise-address={HOST}",
                "--endpoint-reconciler-type=none",
                # No kube-proxy: webhooks (and aggregated APIs) behind a Service are called at
                # an endpoint's pod IP, which the host reaches on the real nodes' bridges.
                "--enable-aggregator-routing=true",
                f"--cert-dir={self.run_dir / 'apiserver-certs'}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={ca.pair.cert}",
                f"--requestheader-client-ca-file={front_ca.pair.cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={front_client.cert}",
                f"--proxy-client-key-file={front_client.key}",
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                "--profiling=false",
                f"--runtime-config={flags.runtime_config(binaries.minor)}",
                *flags.gate_flag(flags.dra_gates(apiserver)),
                v,
            ],
            lambda: (
                _https_ok(f"{server}/readyz", tls)
                and _https_ok(f"{server}/api/v1/namespaces/default", tls)
                and _https_ok(f"{server}/api/v1/namespaces/kube-system", tls)
            ),
        )

        # kube-controller-manager and kube-scheduler (started together, waited together) --------
        kcm = binaries.path("kube-controller-manager")
        kcm_argv = [
            str(kcm),
            f"--kubeconfig={kcm_kc}",
            f"--authentication-kubeconfig={kcm_kc}",
            f"--authorization-kubeconfig={kcm_kc}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            bind,
            f"--secure-port={ports.kcm}",
            f"--tls-cert-file={kcm_serving.cert}",
            f"--tls-private-key-file={kcm_serving.key}",
            "--leader-elect=false",
            f"--controllers={flags.kcm_controllers(kcm)}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={sa.key}",
            f"--root-ca-file={ca.pair.cert}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--profiling=false",
            *flags.gate_flag(flags.dra_gates(kcm)),
            v,
        ]
        sched = binaries.path("kube-scheduler")
        sched_argv = [
            str(sched),
            f"--config={sched_config}",
            f"--authentication-kubeconfig={sched_kc}",
            f"--authorization-kubeconfig={sched_kc}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            bind,
            f"--secure-port={ports.scheduler}",
            f"--tls-cert-file={sched_serving.cert}",
            f"--tls-private-key-file={sched_serving.key}",
            "--profiling=false",
            *flags.gate_flag(flags.dra_gates(sched)),
            v,
        ]
        t = time.monotonic()
        kcm_proc = self._spawn("kube-controller-manager", kcm_argv)
        sched_proc = self._spawn("kube-scheduler", sched_argv)
        self._wait(kcm_proc, lambda: _https_ok(f"https://{HOST}:{ports.kcm}/healthz", tls), t)
        self._wait(
            sched_proc, lambda: _https_ok(f"https://{HOST}:{ports.scheduler}/healthz", tls), t
        )
        for p in self.processes:
            p.ports = sorted(procs.listening_ports(p.pid))
        self.timings.seconds["total"] = time.monotonic() - t_all
        self._write_state()

    def _spawn(self, name: str, argv: list[str]) -> procs.Proc:
        proc = procs.start(
            name,
            argv,
            self.logs / f"{name}.log",
            _child_env(),
            cwd=self.run_dir,
            die_with_parent=self.owned,
        )
        with self._lock:
            self.processes.append(proc)
        return proc

    def _launch(self, name: str, argv: list[str], healthy: Callable[[], bool]) -> None:
        t = time.monotonic()
        self._wait(self._spawn(name, argv), healthy, t)

    def _wait(self, proc: procs.Proc, healthy: Callable[[], bool], t0: float) -> None:
        deadline = t0 + self.start_timeout
        delay = 0.05
        while True:
            if not proc.alive():
                time.sleep(0.2)  # let the last log lines land
                raise StartError(
                    f"{proc.name} exited with code {proc.returncode()} during start-up; "
                    f"log {proc.log}:\n{proc.log_tail()}"
                )
            if healthy():
                self.timings.seconds[proc.name] = time.monotonic() - t0
                return
            if time.monotonic() > deadline:
                raise StartError(
                    f"{proc.name} not healthy after {self.start_timeout:.0f}s; "
                    f"log {proc.log}:\n{proc.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def stop(self) -> list[str]:
        """Stop every component (scheduler and controller-manager, then the apiserver, then
        etcd; SIGTERM, then SIGKILL after a bounded grace). Idempotent. Returns leftovers."""
        with self._lock:
            running = list(self.processes)
        by_name = {p.name: p for p in running}
        stuck: list[str] = []
        for group in (
            ("kube-scheduler", "kube-controller-manager"),
            ("kube-apiserver",),
            ("etcd",),
        ):
            members = [by_name[n] for n in group if n in by_name]
            if members:
                stuck += procs.stop(members, max(GRACE[n] for n in group if n in by_name))
        _OWNED.discard(self)
        left = self.leftovers()
        deadline = time.monotonic() + 5.0  # sockets close as a process' last thread exits
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.leftovers()
        if not stuck and not left:
            state = self.run_dir / STATE_FILE
            state.unlink(missing_ok=True)
        return stuck + left

    def leftovers(self) -> list[str]:
        """Sandbox processes still alive and sandbox ports still bound (empty when clean)."""
        out = [f"process {p.name} (pid {p.pid})" for p in self.processes if p.alive()]
        ports = set(self.ports.all() if self.ports else [])
        for p in self.processes:
            ports.update(p.ports)
        out += [f"port {port}" for port in sorted(ports) if not procs.port_is_free(port)]
        return out

    # ---- clients -----------------------------------------------------------------------------
    def tls_context(self) -> ssl.SSLContext:
        """Trusts the sandbox CA and presents the admin client certificate."""
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def health(self) -> dict[str, bool]:
        """Each component: alive and answering its health endpoint."""
        ports = self.ports
        if ports is None:
            return {}
        tls = self.tls_context()
        checks: dict[str, Callable[[], bool]] = {
            "etcd": lambda: _etcd_healthy(f"http://{HOST}:{ports.etcd}"),
            "kube-apiserver": lambda: _https_ok(f"https://{HOST}:{ports.apiserver}/readyz", tls),
            "kube-controller-manager": lambda: _https_ok(
                f"https://{HOST}:{ports.kcm}/healthz", tls
            ),
            "kube-scheduler": lambda: _https_ok(f"https://{HOST}:{ports.scheduler}/healthz", tls),
        }
        by_name = {p.name: p for p in self.processes}
        return {
            name: name in by_name and by_name[name].alive() and checks[name]() for name in ORDER
        }

    # ---- state for the CLI -------------------------------------------------------------------
    def _write_state(self) -> None:
        assert self.ports is not None
        state: dict[str, Any] = {
            "kube_version": self.binaries.kube_version,
            "bin_dir": str(self.binaries.bin_dir),
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ports": self.ports.__dict__,
            "processes": [p.to_json() for p in self.processes],
            "timings": self.timings.seconds,
            "owner_pid": os.getpid() if self.owned else None,
        }
        (self.run_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: Path) -> ControlPlane | None:
        """The control plane recorded in run_dir/state.json (for down/status), or None."""
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        bin_dir = Path(state["bin_dir"])
        binaries = KubeBinaries(
            bin_dir, state["kube_version"], int(state["kube_version"].split(".")[1])
        )
        cp = cls(run_dir, binaries=binaries, owned=False)
        cp.ports = Ports(**state["ports"])
        cp.processes = [procs.Proc.from_json(p) for p in state["processes"]]
        cp.timings.seconds = dict(state.get("timings", {}))
        return cp


# ---- helpers ---------------------------------------------------------------------------------
def _etcd_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def _https_ok(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3, context=ctx) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError, ssl.SSLError):
        return False


_OWNED: set[ControlPlane] = set()


@atexit.register
def _stop_owned() -> None:
    for cp in list(_OWNED):
        cp.stop()


def install_signal_handlers() -> None:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt in the main thread, so `finally` blocks
    and pytest fixture finalizers run and stop the sandbox (only where no handler is set)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, interrupt)


# ---- CLI -------------------------------------------------------------------------------------
def _run_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("GPUSLICE_SANDBOX_DIR") or DEFAULT_RUN_DIR).resolve()


def cmd_up(run_dir: Path, timeout: float) -> int:
    existing = ControlPlane.load(run_dir)
    if existing is not None:
        if all(existing.health().values()):
            print(
                f"sandbox already running ({existing.binaries.kube_version}) at {existing.server}"
            )
            print(f"export KUBECONFIG={existing.kubeconfig}")
            return 0
        print("sandbox: stopping the remains of an earlier run")
        existing.stop()
    install_signal_handlers()
    cp = ControlPlane(run_dir, owned=False, start_timeout=timeout)
    try:
        print(f"sandbox: starting Kubernetes {cp.binaries.kube_version} from {cp.binaries.bin_dir}")
        cp.start()
    except BinariesMissingError as exc:
        print(exc, file=sys.stderr)
        return 2
    except StartError as exc:
        print(f"sandbox: start failed: {exc}", file=sys.stderr)
        return 1
    print(f"sandbox: up in {cp.timings.seconds['total']:.1f}s ({cp.timings}); logs in {cp.logs}")
    print(f"sandbox: API server {cp.server}")
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0


def cmd_down(run_dir: Path) -> int:
    cp = ControlPlane.load(run_dir)
    if cp is None:
        print(f"sandbox: nothing recorded in {run_dir / STATE_FILE}; nothing to stop")
        return 0
    left = cp.stop()
    if left:
        print(f"sandbox: still present after stopping: {', '.join(left)}", file=sys.stderr)
        return 1
    shutil.rmtree(run_dir / "etcd-data", ignore_errors=True)
    print(f"sandbox: stopped; no process left, ports free (logs kept in {cp.logs})")
    return 0


def cmd_status(run_dir: Path) -> int:
    cp = ControlPlane.load(run_dir)
    if cp is None:
        print("sandbox: not running")
        return 3
    health = cp.health()
    by_name = {p.name: p for p in cp.processes}
    print(f"sandbox: Kubernetes {cp.binaries.kube_version} at {cp.server}")
    for name in ORDER:
        p = by_name.get(name)
        where = f"pid {p.pid}, ports {','.join(map(str, p.ports))}" if p else "not started"
        print(f"  {name:<24} {'healthy' if health.get(name) else 'DOWN':<8} {where}")
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0 if all(health.values()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.sandbox.controlplane", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--run-dir", help=f"state, certs, logs (default {DEFAULT_RUN_DIR})")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-component start budget")
    args = parser.parse_args(argv)
    run_dir = _run_dir(args.run_dir)
    with contextlib.suppress(KeyboardInterrupt):
        if args.command == "up":
            return cmd_up(run_dir, args.timeout)
        if args.command == "down":
            return cmd_down(run_dir)
        return cmd_status(run_dir)
    return 130


if __name__ == "__main__":
    sys.exit(main())
