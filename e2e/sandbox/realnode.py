"""Real sandbox nodes: per node one containerd and one real kubelet of the pinned release,
joined to the sandbox's control plane (tier 4 of docs/architecture.md, "Testing tiers";
docs/real-node.md).

    with ControlPlane(run_dir) as cp, RealNodes.started(cp, ["real-0", "real-1"]) as nodes:
        nodes["real-0"].ctr("images", "ls")

Several nodes share one machine without colliding because each runs in a mount namespace of its
own, where the node's directories lie over /var/lib, /var/log, /run and /opt: the kubelet,
containerd, runc and hostPath volumes see the standard paths (/var/lib/kubelet, /run/containerd,
/var/run/cdi, /var/log/pods, /var/lib/gpuslice with the enforcer's hook, ...), so the chart's
defaults work on every node.
The machine-wide resources a node takes (cgroups, bridge, pod subnet) come from a slot
(nodehost.py). The kubelet runs with ``--cloud-provider=external``: it leaves the Node's addresses
to us, and we set the single address InternalIP 127.0.0.1 (a kubelet refuses a loopback
``--node-ip``), so the API server reaches the kubelet on loopback for ``kubectl logs``/``exec``.

CLI (state in .sandbox/ or $GPUSLICE_SANDBOX_DIR; `make cluster-up NODES=real`):
    python -m e2e.sandbox.realnode up [--nodes N] | down | status
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.sandbox import flags, nodehost, procs
from e2e.sandbox.binaries import REPO_ROOT, BinariesMissingError, KubeBinaries
from e2e.sandbox.controlplane import ControlPlane, write_kubeconfig
from e2e.sandbox.nodeconfig import CONTAINERD_SOCKET, NodeConfig
from gpuslice_kube.client import new_api_client
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.certs import TinyCA

NODE_BINARIES = ("containerd", "ctr", "containerd-shim-runc-v2", "runc")
STATE_FILE = "realnodes.json"
REAL_LABEL = "gpuslice.dev/sandbox-node"  # value "real" (the node agent's nodes: no such label)
LABELS = {"nvidia.com/gpu.present": "true", REAL_LABEL: "real"}
INTERNAL_IP = {"type": "InternalIP", "address": "127.0.0.1"}
CLOUD_TAINT = "node.cloudprovider.kubernetes.io/uninitialized"
# The node's directories laid over these paths inside its mount namespace.
# /opt too: hostPaths outside the three, like the enforcer hook's /opt/gpuslice of earlier charts
OVERLAID = ("/var/lib", "/var/log", "/run", "/opt")
_ENV_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class InputsMissingError(RuntimeError):
    """A build input of the real nodes is missing (the message names the script to run)."""


class HostUnsupportedError(RuntimeError):
    """This machine cannot run real nodes at all (not root, no cgroup v1 hierarchies)."""


# ---- inputs ----------------------------------------------------------------------------------
def _script_output(script: str, arg: str) -> Path:
    path = REPO_ROOT / "hack" / script
    if not path.exists():
        raise InputsMissingError(f"hack/{script} does not exist in this checkout")
    out = subprocess.run(
        ["bash", str(path), arg], capture_output=True, text=True, timeout=120, check=False
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise InputsMissingError(
            (out.stderr.strip() or f"hack/{script} {arg} failed")
            + f"\n(build it with: bash hack/{script})"
        )
    return Path(lines[-1])


def find_node_binaries() -> Path:
    """The dir with containerd, ctr, containerd-shim-runc-v2 and runc (hack/node-binaries.sh)."""
    if os.environ.get("GPUSLICE_NODE_BIN_DIR"):
        bin_dir = Path(os.environ["GPUSLICE_NODE_BIN_DIR"])
    else:
        bin_dir = _script_output("node-binaries.sh", "--print-dir")
    missing = [n for n in NODE_BINARIES if not (bin_dir / n).is_file()]
    if missing:
        raise InputsMissingError(
            f"{bin_dir} lacks {', '.join(missing)}: bash hack/node-binaries.sh"
        )
    return bin_dir


@dataclass(frozen=True)
class Image:
    name: str
    ref: str
    archive: Path


def find_images(manifest: Path | None = None) -> dict[str, Image]:
    """The images of hack/images.sh's manifest ($GPUSLICE_IMAGES_MANIFEST wins); each archive
    must exist and the manifest must name a ``pause`` image (the pinned sandbox image)."""
    if manifest is None:
        env = os.environ.get("GPUSLICE_IMAGES_MANIFEST")
        manifest = Path(env) if env else _script_output("images.sh", "--print-manifest")
    data = json.loads(manifest.read_text())
    images = {
        name: Image(name, str(entry["ref"]), Path(entry["archive"]))
        for name, entry in data["images"].items()
    }
    missing = [str(i.archive) for i in images.values() if not i.archive.is_file()]
    if missing or "pause" not in images:
        raise InputsMissingError(
            f"{manifest}: no pause image or missing archives {missing}: bash hack/images.sh"
        )
    return images


def check_host() -> None:
    """Raises InputsMissingError when the machine cannot run a real node at all."""
    if os.geteuid() != 0:
        raise HostUnsupportedError("real nodes need root (namespaces, mounts, cgroups, bridges)")
    for tool in ("unshare", "nsenter", "mount", "ip"):
        if shutil.which(tool, path=_ENV_PATH) is None:
            raise InputsMissingError(f"{tool} (util-linux/iproute2) is not installed")
    if not Path("/usr/lib/cni/bridge").exists():
        raise InputsMissingError(
            "no CNI plugins in /usr/lib/cni: apt-get install containernetworking-plugins"
        )
    try:
        nodehost.hierarchies()
    except nodehost.HostError as exc:
        raise HostUnsupportedError(str(exc)) from exc


# ---- one node --------------------------------------------------------------------------------
class RealNode:
    """One node: a mount-namespace holder, containerd and the kubelet, in the slot's cgroup.

    Processes are started by the thread that calls ``spawn_*`` (PR_SET_PDEATHSIG ties owned
    children to it: call from a thread that lives as long as the node, as ``RealNodes`` does).
    """

    def __init__(
        self,
        cp: ControlPlane,
        name: str,
        node_dir: Path,
        *,
        kube: KubeBinaries,
        node_bin: Path,
        images: dict[str, Image],
        owned: bool = True,
        verbosity: int = 2,
        labels: Mapping[str, str] | None = None,
        registries: Mapping[str, str] | None = None,
    ) -> None:
        self.cp = cp
        self.registries = dict(registries or {})
        self.labels = {**LABELS, **(labels or {})}
        self.name = name
        self.dir = node_dir.resolve()
        for overlaid in OVERLAID:
            if self.dir.is_relative_to(overlaid):
                raise ValueError(f"a node dir under {overlaid} would hide itself: {self.dir}")
        self.kube = kube
        self.node_bin = node_bin
        self.images = images
        self.owned = owned
        self.verbosity = verbosity
        self.slot: nodehost.Slot | None = None
        self.holder: procs.Proc | None = None
        self.containerd: procs.Proc | None = None
        self.kubelet: procs.Proc | None = None
        self.apiproxy: procs.Proc | None = None
        self.kubelet_port = 0
        self.mnt_ns: str | None = None
        self.timings: dict[str, float] = {}

    # ---- paths -----------------------------------------------------------------------------
    def fs(self, overlaid: str) -> Path:
        """The node's directory that lies over ``overlaid`` (/var/lib, /var/log, /run, /opt)."""
        return self.dir / "fs" / overlaid.strip("/").replace("/", "-")

    def host_path(self, node_path: str) -> Path:
        """Where a path of the node's namespace (e.g. /var/lib/kubelet) is on the host."""
        for overlaid in OVERLAID:
            if node_path == overlaid or node_path.startswith(overlaid + "/"):
                return self.fs(overlaid) / node_path[len(overlaid) :].lstrip("/")
        if node_path.startswith("/var/run/"):
            return self.host_path("/run/" + node_path[len("/var/run/") :])
        return Path(node_path)

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    @property
    def socket(self) -> Path:
        """containerd's socket, as the host sees it (connect through ``ctr``: the path may be
        longer than a unix socket address allows)."""
        return self.host_path(CONTAINERD_SOCKET)

    # ---- start -----------------------------------------------------------------------------
    def prepare(self, slot: nodehost.Slot) -> None:
        """Directories, certificates, kubeconfig and configuration files (no process yet)."""
        self.slot = slot
        if self.dir.exists():
            shutil.rmtree(self.dir)  # a node starts empty, like a freshly installed machine
        for overlaid in OVERLAID:
            self.fs(overlaid).mkdir(parents=True)
        for sub in ("var-lib/kubelet", "var-lib/containerd", "var-lib/cni", "var-log/pods"):
            (self.dir / "fs" / sub).mkdir(parents=True, exist_ok=True)
        pki = self.dir / "pki"
        ca = TinyCA.load(self.cp.pki)
        ca.issue(
            "kubelet-serving",
            self.name,
            dns_names=(self.name, "localhost"),
            ip_addresses=("127.0.0.1",),
            server=True,
            out_dir=pki,
        )
        client = ca.client("kubelet", f"system:node:{self.name}", ("system:nodes",), out_dir=pki)
        shutil.copy(self.cp.pki / "ca.crt", pki / "ca.crt")
        write_kubeconfig(
            self.dir / "kubelet.kubeconfig",
            self.cp.server,
            self.cp.pki / "ca.crt",
            client.cert,
            client.key,
            f"system:node:{self.name}",
        )
        self.kubelet_port = procs.free_port()
        kubelet_bin = self.kube.path("kubelet")
        self.config = NodeConfig(
            name=self.name,
            kubelet_port=self.kubelet_port,
            cgroup_root=slot.cgroup_root,
            bridge=slot.bridge,
            subnet=slot.subnet,
            pause_ref=self.images["pause"].ref,
            runc=self.node_bin / "runc",
            cni_conf_dir=self.dir / "cni" / "net.d",
            pki_dir=pki,
            volume_plugin_dir=self.dir / "volume-plugins",
            feature_gates=flags.dra_gates(kubelet_bin),
            service_ip=nodehost.SERVICE_IP,
            registries=self.registries,
            registry_config_dir=self.dir / "config" / "certs.d",
        )
        self.containerd_config, self.kubelet_config = self.config.write(self.dir / "config")

    def _env(self) -> dict[str, str]:
        # containerd finds containerd-shim-runc-v2 on PATH
        return {"PATH": f"{self.node_bin}:{_ENV_PATH}", "HOME": str(self.dir), "LANG": "C.UTF-8"}

    def _joined(self, argv: Sequence[str], enter_ns: bool) -> list[str]:
        """argv run in the slot's daemons cgroups and, if ``enter_ns``, the node's namespace
        (exec all the way down: the pid procs.start records is the daemon's own)."""
        assert self.slot is not None
        joins = "; ".join(
            f"echo $$ > {shlex.quote(str(f))}" for f in self.slot.daemon_procs_files()
        )
        prefix: list[str] = []
        if enter_ns:
            assert self.holder is not None
            prefix = ["nsenter", f"--target={self.holder.pid}", "--mount", "--"]
        return ["/bin/sh", "-c", f'{joins}; exec "$@"', "sh", *prefix, *argv]

    def _spawn(self, name: str, argv: list[str]) -> procs.Proc:
        return procs.start(
            name, argv, self.logs / f"{name}.log", self._env(), cwd=self.dir,
            die_with_parent=self.owned,
        )  # fmt: skip

    def spawn_holder(self) -> None:
        """The process that owns the node's mount namespace: private propagation from the host,
        the node's directories over /var/lib, /var/log, /run and /opt, then / made rshared (as on a
        systemd host: the kubelet's Bidirectional mounts and runc's rslave mounts need it)."""
        ready = self.dir / "holder.ready"
        ready.unlink(missing_ok=True)
        script = "set -e; " + "".join(
            f"mount --bind {shlex.quote(str(self.fs(o)))} {o}; " for o in OVERLAID
        )
        script += f"mount --make-rshared /; echo ok > {shlex.quote(str(ready))}; "
        script += "exec sleep infinity"
        argv = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script]
        self.holder = self._spawn("holder", self._joined(argv, enter_ns=False))

    def wait_holder(self, timeout: float = 10.0) -> None:
        assert self.holder is not None
        ready = self.dir / "holder.ready"
        _wait(lambda: ready.exists(), self.holder, timeout, "the mount namespace")
        self.mnt_ns = str(Path(f"/proc/{self.holder.pid}/ns/mnt").readlink())

    def spawn_apiproxy(self) -> None:
        """The `kubernetes` Service for this node's pods (e2e/sandbox/apiproxy.py)."""
        upstream = self.cp.server.removeprefix("https://")
        argv = [
            sys.executable,
            str(Path(__file__).with_name("apiproxy.py")),
            f"--listen={nodehost.SERVICE_IP}:443",
            f"--upstream={upstream}",
            f"--registry={nodehost.REGISTRY}",
        ]
        self.apiproxy = self._spawn("apiproxy", self._joined(argv, enter_ns=False))

    def spawn_containerd(self) -> None:
        argv = [str(self.node_bin / "containerd"), "--config", str(self.containerd_config)]
        self.containerd = self._spawn("containerd", self._joined(argv, enter_ns=True))

    def wait_containerd(self, timeout: float = 30.0) -> None:
        assert self.containerd is not None

        def serving() -> bool:
            return self.socket.exists() and self.ctr("version", check=False).returncode == 0

        _wait(serving, self.containerd, timeout, "containerd")

    def import_images(self, names: Sequence[str] | None = None) -> None:
        """``ctr images import`` of each image archive (all by default) into namespace k8s.io."""
        for image in self.images.values():
            if names is None or image.name in names:
                self.ctr("images", "import", "--no-unpack", str(image.archive), timeout=300)

    def kubelet_argv(self) -> list[str]:
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        return [
            str(self.kube.path("kubelet")),
            f"--config={self.kubelet_config}",
            f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}",
            f"--hostname-override={self.name}",
            "--cloud-provider=external",
            f"--node-labels={labels}",
            f"--v={self.verbosity}",
        ]

    def spawn_kubelet(self) -> None:
        self.kubelet = self._spawn("kubelet", self._joined(self.kubelet_argv(), enter_ns=True))

    def register(self, raw: RawApi, timeout: float = 30.0) -> None:
        """Once the kubelet created the Node: set its addresses and drop the cloud taint
        (what a cloud-controller-manager does for ``--cloud-provider=external``)."""
        assert self.kubelet is not None
        path = resource_path("v1", "nodes", name=self.name)
        found: list[Obj] = []

        def registered() -> bool:
            with contextlib.suppress(KubeNotFoundError):
                found.append(raw.get(path))
                return True
            return False

        _wait(registered, self.kubelet, timeout, f"Node {self.name}")
        # InternalIP only: with a Hostname address the API server would look the node's name
        # up in DNS (the default --kubelet-preferred-address-types put Hostname first)
        raw.patch(path + "/status", {"status": {"addresses": [INTERNAL_IP]}})
        for _ in range(10):
            node = raw.get(path)
            taints = (node.get("spec") or {}).get("taints") or []
            kept = [t for t in taints if t.get("key") != CLOUD_TAINT]
            if len(kept) == len(taints):
                break
            with contextlib.suppress(Exception):
                rv = node["metadata"]["resourceVersion"]
                raw.patch(path, {"metadata": {"resourceVersion": rv}, "spec": {"taints": kept}})
                break

    def wait_ready(self, raw: RawApi, timeout: float = 60.0) -> None:
        assert self.kubelet is not None
        path = resource_path("v1", "nodes", name=self.name)

        def ready() -> bool:
            node = raw.get(path)
            conds = (node.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        _wait(ready, self.kubelet, timeout, f"Node {self.name} Ready")

    # ---- operations ------------------------------------------------------------------------
    def ctr(
        self, *args: str, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``ctr -n k8s.io ARGS`` against this node's containerd, inside the node's mount
        namespace (the host path of the socket may exceed the 108-byte limit of unix sockets;
        file arguments outside /var/lib, /var/log, /run and /opt are the same paths there)."""
        assert self.holder is not None
        argv = [
            "nsenter", f"--target={self.holder.pid}", "--mount", "--",
            str(self.node_bin / "ctr"), "--address", CONTAINERD_SOCKET, "-n", "k8s.io", *args,
        ]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and out.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} on {self.name}: {out.stderr.strip()}")
        return out

    def kill_container(self, container_id: str) -> None:
        """SIGKILL a container's task (``containerd://<id>`` as pod status has it, or the id)."""
        self.ctr("tasks", "kill", "--signal", "SIGKILL", container_id.split("://")[-1])

    def restart_kubelet(self, grace: float = 10.0) -> None:
        """Stop the kubelet (SIGTERM) and start it again with the same root dir and config;
        pods keep running, as on a real node."""
        if self.kubelet is not None:
            procs.stop([self.kubelet], grace)
        self.spawn_kubelet()

    def kubelet_log(self) -> str:
        return (self.logs / "kubelet.log").read_text(errors="replace")

    def containerd_log(self) -> str:
        return (self.logs / "containerd.log").read_text(errors="replace")

    def processes(self) -> list[procs.Proc]:
        procs_ = (self.kubelet, self.containerd, self.apiproxy, self.holder)
        return [p for p in procs_ if p is not None]

    def stop(self, raw: RawApi | None = None) -> list[str]:
        """Stop the kubelet, then kill everything of the slot (containerd, shims, containers,
        the holder: the namespace and its mounts go with them), remove cgroups and bridge,
        delete the Node (when ``raw`` is given). Idempotent; returns leftovers."""
        if self.kubelet is not None:
            procs.stop([self.kubelet], 5.0)
        left: list[str] = []
        if self.slot is not None:
            left = nodehost.release(self.slot)
            if self.mnt_ns:
                nodehost.kill_namespace(self.mnt_ns, str(self.dir))
            left += self.leftovers()
        for p in self.processes():
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=1)
        if raw is not None:
            with contextlib.suppress(Exception):
                raw.delete(resource_path("v1", "nodes", name=self.name))
        return left

    def leftovers(self) -> list[str]:
        if self.slot is None:
            return []
        left = nodehost.leftovers(self.slot, self.mnt_ns, str(self.dir))
        left += [f"process {p.name} (pid {p.pid})" for p in self.processes() if p.alive()]
        return left

    def to_json(self) -> dict[str, Any]:
        assert self.slot is not None
        return {
            "name": self.name,
            "dir": str(self.dir),
            "slot": self.slot.n,
            "kubelet_port": self.kubelet_port,
            "mnt_ns": self.mnt_ns,
            "processes": [p.to_json() for p in self.processes()],
            "timings": self.timings,
        }


def _wait(check: Callable[[], bool], proc: procs.Proc, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        if not proc.alive():
            time.sleep(0.2)
            raise StartError(
                f"{proc.name} exited (code {proc.returncode()}) before {what} was up; "
                f"log {proc.log}:\n{proc.log_tail()}"
            )
        try:
            if check():
                return
        except Exception:  # an API error while polling is a "not yet"
            pass
        if time.monotonic() > deadline:
            raise StartError(
                f"{what} not up after {timeout:.0f}s; log {proc.log}:\n{proc.log_tail()}"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


class StartError(RuntimeError):
    """A real node did not come up; the message carries the failing component's log tail."""


# ---- a set of nodes --------------------------------------------------------------------------
class RealNodes:
    """Real nodes of one control plane; also the ``NodeOps`` of e2e/scenarios/cluster.py."""

    def __init__(self, cp: ControlPlane, nodes: list[RealNode]) -> None:
        self.cp = cp
        self.nodes = nodes
        self.raw = RawApi(new_api_client(cp.kubeconfig, user_agent="gpuslice-realnode"))
        self.timings: dict[str, float] = {}

    def __getitem__(self, name: str) -> RealNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def __iter__(self) -> Iterator[RealNode]:
        return iter(self.nodes)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    # NodeOps
    def kill_container(self, node: str, container_id: str) -> None:
        self[node].kill_container(container_id)

    def restart_kubelet(self, node: str) -> None:
        self[node].restart_kubelet()

    @classmethod
    @contextlib.contextmanager
    def started(cls, cp: ControlPlane, names: Sequence[str], **kwargs: Any) -> Iterator[RealNodes]:
        nodes = start_real_nodes(cp, names, **kwargs)
        try:
            yield nodes
        finally:
            left = nodes.stop()
            if left:
                raise RuntimeError(f"real nodes left behind: {', '.join(left)}")

    def start(self, import_names: Sequence[str] | None = None) -> None:
        """Start every node (in parallel where it pays) and wait until all are Ready.
        Processes are spawned from the calling thread."""
        t0 = time.monotonic()
        for node in self.nodes:
            node.spawn_holder()
        for node in self.nodes:
            node.wait_holder()
            node.spawn_apiproxy()
            node.spawn_containerd()
        for node in self.nodes:
            node.wait_containerd()
            node.timings["containerd"] = time.monotonic() - t0
            node.spawn_kubelet()
        with ThreadPoolExecutor(max_workers=2 * len(self.nodes)) as pool:
            t_img = time.monotonic()
            imports = [pool.submit(n.import_images, import_names) for n in self.nodes]
            regs = [pool.submit(n.register, self.raw) for n in self.nodes]
            for node, fut in zip(self.nodes, regs, strict=True):
                fut.result()
                node.timings["registered"] = time.monotonic() - t0
            for node, fut in zip(self.nodes, imports, strict=True):
                fut.result()
                node.timings["images"] = time.monotonic() - t_img
        for node in self.nodes:
            node.wait_ready(self.raw)
            node.timings["ready"] = time.monotonic() - t0
        self.timings["total"] = time.monotonic() - t0

    def stop(self) -> list[str]:
        left: list[str] = []
        for node in self.nodes:
            left += node.stop(self.raw)
        return left

    def write_state(self, run_dir: Path) -> None:
        state = {"server": self.cp.server, "nodes": [n.to_json() for n in self.nodes]}
        (run_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def start_real_nodes(
    cp: ControlPlane,
    names: Sequence[str],
    *,
    run_dir: Path | None = None,
    images_manifest: Path | None = None,
    import_names: Sequence[str] | None = None,
    owned: bool = True,
    labels: Mapping[str, Mapping[str, str]] | None = None,
    registries: Mapping[str, str] | None = None,
) -> RealNodes:
    """Start real nodes ``names`` on ``cp`` under ``run_dir/nodes/<name>`` (default: the control
    plane's run dir) and wait until every one is Ready. ``labels``: node name → node labels on
    top of LABELS; ``registries``: registry host → the endpoint every node's containerd pulls
    it from (hosts.toml). On failure nothing is left behind."""
    check_host()
    node_bin = find_node_binaries()
    images = find_images(images_manifest)
    run_dir = (run_dir or cp.run_dir).resolve()
    base = run_dir / "nodes"
    nodes = [
        RealNode(
            cp,
            name,
            base / name,
            kube=cp.binaries,
            node_bin=node_bin,
            images=images,
            owned=owned,
            labels=(labels or {}).get(name),
            registries=registries,
        )
        for name in names
    ]
    real = RealNodes(cp, nodes)
    try:
        for node in nodes:
            upstream = cp.server.removeprefix("https://")
            node.prepare(nodehost.claim(node.name, run_dir, os.getpid(), upstream))
        real.start(import_names)
    except BaseException:
        real.stop()
        raise
    return real


# ---- CLI -------------------------------------------------------------------------------------
def cmd_up(run_dir: Path, count: int, timeout: float) -> int:
    from e2e.sandbox import controlplane

    rc = controlplane.cmd_up(run_dir, timeout)
    if rc != 0:
        return rc
    cp = ControlPlane.load(run_dir)
    assert cp is not None
    names = [f"real-{i}" for i in range(count)]
    running = {str(r["node"]) for _, r in nodehost.slots_of_run(run_dir) if nodehost.owner_alive(r)}
    if running == set(names):
        print(f"sandbox: real nodes {', '.join(names)} already running")
        return 0
    _stop_recorded(run_dir, cp)
    controlplane.install_signal_handlers()
    try:
        nodes = start_real_nodes(cp, names, owned=False)
    except (InputsMissingError, HostUnsupportedError, BinariesMissingError) as exc:
        print(f"sandbox: cannot start real nodes: {exc}", file=sys.stderr)
        return 2
    except StartError as exc:
        print(f"sandbox: real nodes did not start: {exc}", file=sys.stderr)
        return 1
    for node in nodes:  # from now on the holder owns the slot (this process exits)
        assert node.slot is not None and node.holder is not None
        nodehost.write_record(node.slot, node.name, run_dir, node.holder.pid)
    nodes.write_state(run_dir)
    for node in nodes:
        print(
            f"sandbox: node {node.name} Ready in {node.timings['ready']:.1f}s "
            f"(slot {node.slot.n if node.slot else '?'}, dir {node.dir}, logs {node.logs})"
        )
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0


def _stop_recorded(run_dir: Path, cp: ControlPlane | None) -> list[str]:
    """Give back the slots of this run dir's nodes and delete their Nodes."""
    left: list[str] = []
    names: list[str] = []
    for slot, record in nodehost.slots_of_run(run_dir):
        names.append(str(record["node"]))
        left += nodehost.release(slot)
    if cp is not None and names and all(cp.health().values()):
        raw = RawApi(new_api_client(cp.kubeconfig, user_agent="gpuslice-realnode"), deadline=10)
        for name in names:
            with contextlib.suppress(Exception):
                raw.delete(resource_path("v1", "nodes", name=name))
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    return left


def cmd_down(run_dir: Path) -> int:
    from e2e.sandbox import controlplane

    cp = ControlPlane.load(run_dir)
    left = _stop_recorded(run_dir, cp)
    swept = nodehost.sweep_stale()
    if swept:
        print(f"sandbox: cleaned up after earlier runs: {', '.join(swept)}")
    if left:
        print(f"sandbox: real nodes left behind: {', '.join(left)}", file=sys.stderr)
    rc = controlplane.cmd_down(run_dir)
    return 1 if left else rc


def cmd_status(run_dir: Path) -> int:
    from e2e.sandbox import controlplane

    rc = controlplane.cmd_status(run_dir)
    for slot, record in nodehost.slots_of_run(run_dir):
        alive = nodehost.owner_alive(record)
        print(
            f"  real node {record['node']:<13} {'running' if alive else 'DEAD':<8} slot {slot.n}, "
            f"cgroup /{slot.cgroup}, bridge {slot.bridge}, pods {slot.subnet}"
        )
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    from e2e.sandbox.controlplane import DEFAULT_RUN_DIR, _run_dir

    parser = argparse.ArgumentParser(
        prog="python -m e2e.sandbox.realnode", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--run-dir", help=f"state, certs, logs (default {DEFAULT_RUN_DIR})")
    parser.add_argument("--nodes", type=int, default=2, help="how many real nodes `up` starts")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-component start budget")
    args = parser.parse_args(argv)
    run_dir = _run_dir(args.run_dir)
    with contextlib.suppress(KeyboardInterrupt):
        if args.command == "up":
            return cmd_up(run_dir, args.nodes, args.timeout)
        if args.command == "down":
            return cmd_down(run_dir)
        return cmd_status(run_dir)
    return 130


if __name__ == "__main__":
    sys.exit(main())
