"""What a real sandbox node takes from the machine, and how it is given back.

Each real node owns a *slot* n (0-199): the cgroup ``/gpuslice-rn<n>`` in every cgroup v1
hierarchy (kubelet ``cgroupRoot`` ``/gpuslice-rn<n>/pods``, containerd, kubelet and the mount
namespace holder in ``/gpuslice-rn<n>/daemons``), the Linux bridge ``gsrn<n>`` and the pod subnet
``10.244.<n>.0/24``. Slots are claimed in a small registry under the temp dir
(``gpuslice-realnodes/slot-<n>.json``, guarded by an flock) that names the slot's owner process:
the test process for nodes a test owns, the namespace holder for nodes ``up`` leaves running.

Giving a slot back kills every process in its cgroups (frozen first, so nothing forks meanwhile),
which ends the node's mount namespace and with it every mount, the pods' network namespaces and
their veths; then the cgroups and the bridge are removed. A slot whose owner is dead (a test run
killed with SIGKILL) is *stale*: the next ``start`` or ``down`` gives it back.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.sandbox import procs
from gpuslice_testkit.certs import APISERVER_IPS

# The `kubernetes` Service's ClusterIP: a local /32 on every node bridge, where e2e/sandbox/
# apiproxy.py relays it to the API server (no kube-proxy, no NAT rules on the host).
SERVICE_IP = APISERVER_IPS[0]

CGROUP_FS = Path("/sys/fs/cgroup")
CGROUP_PREFIX = "gpuslice-rn"
BRIDGE_PREFIX = "gsrn"
MAX_SLOTS = 200
REGISTRY = Path(tempfile.gettempdir()) / "gpuslice-realnodes"


class HostError(RuntimeError):
    """The machine cannot host a real node (the message says why)."""


def hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (cpu, memory, pids, ..., name=systemd), plus the
    cgroup2 mount of a hybrid host, which runc may also use."""
    if not (CGROUP_FS / "pids" / "cgroup.procs").exists():
        raise HostError(f"no cgroup v1 pids hierarchy at {CGROUP_FS / 'pids'}")
    return sorted(p for p in CGROUP_FS.iterdir() if (p / "cgroup.procs").exists())


@dataclass(frozen=True)
class Slot:
    n: int

    @property
    def cgroup(self) -> str:
        """The node's cgroup, relative to each hierarchy's root."""
        return f"{CGROUP_PREFIX}{self.n}"

    @property
    def cgroup_root(self) -> str:
        """The kubelet's ``cgroupRoot``."""
        return f"/{self.cgroup}/pods"

    @property
    def bridge(self) -> str:
        return f"{BRIDGE_PREFIX}{self.n}"

    @property
    def subnet(self) -> str:
        return f"10.244.{self.n}.0/24"

    @property
    def gateway(self) -> str:
        return f"10.244.{self.n}.1/24"

    @property
    def bridge_mac(self) -> str:
        """A fixed, locally administered MAC for the bridge (see ``_make_bridge``)."""
        return f"02:67:73:72:6e:{self.n:02x}"

    @property
    def record(self) -> Path:
        return REGISTRY / f"slot-{self.n}.json"

    def daemon_procs_files(self) -> list[Path]:
        """``cgroup.procs`` of the daemons cgroup in every hierarchy that tracks processes."""
        return [h / self.cgroup / "daemons" / "cgroup.procs" for h in hierarchies()]


@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    with (REGISTRY / "lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_record(slot: Slot) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(slot.record.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data


def owner_alive(record: dict[str, Any]) -> bool:
    owner = record.get("owner") or {}
    pid, start = owner.get("pid"), owner.get("start_time")
    return pid is not None and procs.proc_start_time(int(pid)) == start


def _slot_in_use(slot: Slot) -> bool:
    return (
        slot.record.exists()
        or (CGROUP_FS / "pids" / slot.cgroup).exists()
        or Path(f"/sys/class/net/{slot.bridge}").exists()
    )


def claim(node: str, run_dir: Path, owner_pid: int, apiserver: str = "") -> Slot:
    """The lowest free slot, recorded as owned by ``owner_pid``; stale slots are given back
    first. Creates the slot's cgroups (``pods`` and ``daemons`` below it) and its bridge.
    ``apiserver`` (host:port): where the relay of the `kubernetes` Service sends this node's
    pods (e2e/sandbox/apiproxy.py reads it from the record)."""
    with _registry_lock():
        sweep_stale(locked=True)
        for n in range(MAX_SLOTS):
            slot = Slot(n)
            if _slot_in_use(slot):
                continue
            write_record(slot, node, run_dir, owner_pid, apiserver)
            try:
                _make_cgroups(slot)
                _make_bridge(slot)
            except BaseException:
                release(slot, locked=True)
                raise
            return slot
    raise HostError(f"all {MAX_SLOTS} real-node slots are taken (see {REGISTRY})")


def write_record(
    slot: Slot, node: str, run_dir: Path, owner_pid: int, apiserver: str | None = None
) -> None:
    """(Re)record the slot's owner: ``up`` hands its nodes to their namespace holders
    (``apiserver`` None: keep the recorded one)."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    if apiserver is None:
        apiserver = str((_read_record(slot) or {}).get("apiserver", ""))
    record = {
        "apiserver": apiserver,
        "node": node,
        "run_dir": str(run_dir),
        "owner": {"pid": owner_pid, "start_time": procs.proc_start_time(owner_pid)},
        "cgroup": slot.cgroup,
        "bridge": slot.bridge,
    }
    tmp = slot.record.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(slot.record)


def _make_cgroups(slot: Slot) -> None:
    for h in hierarchies():
        for rel in (slot.cgroup, f"{slot.cgroup}/pods", f"{slot.cgroup}/daemons"):
            path = h / rel
            path.mkdir(exist_ok=True)
            if h.name == "cpuset":  # a v1 cpuset cgroup starts empty: inherit the parent's
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (path / f).write_text((path.parent / f).read_text().strip() or "0")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def _make_bridge(slot: Slot) -> None:
    """The pods' bridge with the host's address on it (10.244.n.1), so the kubelet can reach its
    pods (probes). The CNI bridge plugin then runs with isGateway=false: it neither adds a default
    route in the pods nor turns on the host's ip_forward; nothing leaves the subnet.

    The bridge gets a MAC of its own: a Linux bridge without one takes the lowest MAC of its
    ports, so it changed whenever a pod's veth came or went, and a pod that had the old one in
    its ARP cache answered the kubelet's probes into the void until that entry expired (HTTP
    probes of the node pod timed out for tens of seconds, and liveness restarted it)."""
    for args in (
        ("link", "add", slot.bridge, "address", slot.bridge_mac, "type", "bridge"),
        ("addr", "add", slot.gateway, "dev", slot.bridge),
        ("addr", "add", f"{SERVICE_IP}/32", "dev", slot.bridge),
        ("link", "set", slot.bridge, "up"),
    ):
        out = _ip(*args)
        if out.returncode != 0:
            raise HostError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def cgroup_pids(slot: Slot) -> set[int]:
    """Every process in the slot's cgroup tree (pids hierarchy: containers are there too)."""
    pids: set[int] = set()
    root = CGROUP_FS / "pids" / slot.cgroup
    if not root.exists():
        return pids
    for procs_file in root.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in procs_file.read_text().split())
    return pids


def _freeze(slot: Slot, state: str) -> None:
    path = CGROUP_FS / "freezer" / slot.cgroup / "freezer.state"
    with contextlib.suppress(OSError):
        path.write_text(state)
        deadline = time.monotonic() + 5.0
        while path.read_text().strip() != state and time.monotonic() < deadline:
            time.sleep(0.02)


def kill_all(slot: Slot, timeout: float = 15.0) -> list[int]:
    """SIGKILL every process of the slot (frozen first: nothing forks meanwhile) and wait until
    they are gone. Returns pids still present (normally none)."""
    pids = cgroup_pids(slot)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        _freeze(slot, "FROZEN")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _freeze(slot, "THAWED")
        time.sleep(0.05)
        pids = cgroup_pids(slot)
    return sorted(pids)


def _remove_cgroups(slot: Slot) -> list[str]:
    left: list[str] = []
    for h in hierarchies():
        root = h / slot.cgroup
        if not root.exists():
            continue
        dirs = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, root]:
            for _ in range(50):  # a cgroup whose last task is exiting is busy for a moment
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
            if d.exists():
                left.append(f"cgroup {d}")
    return left


def release(slot: Slot, *, locked: bool = False) -> list[str]:
    """Give the slot back: processes, mounts (with the namespace), cgroups, bridge, record.
    Returns what could not be removed (normally nothing)."""
    with contextlib.nullcontext() if locked else _registry_lock():
        left = [f"process {pid}" for pid in kill_all(slot)]
        left += _remove_cgroups(slot)
        if Path(f"/sys/class/net/{slot.bridge}").exists():
            out = _ip("link", "del", slot.bridge)
            if out.returncode != 0:
                left.append(f"bridge {slot.bridge}: {out.stderr.strip()}")
        if not left:
            slot.record.unlink(missing_ok=True)
        return left


def sweep_stale(*, locked: bool = False) -> list[str]:
    """Give back every slot whose owner is dead, and every gpuslice-rn cgroup or gsrn bridge
    that no record names (a run killed between claiming and recording). Returns the
    descriptions of what was swept."""
    swept: list[str] = []
    with contextlib.nullcontext() if locked else _registry_lock():
        candidates: set[int] = set()
        if REGISTRY.exists():
            for rec in REGISTRY.glob("slot-*.json"):
                with contextlib.suppress(ValueError):
                    candidates.add(int(rec.stem.split("-", 1)[1]))
        if (CGROUP_FS / "pids").exists():
            for d in (CGROUP_FS / "pids").glob(f"{CGROUP_PREFIX}*"):
                with contextlib.suppress(ValueError):
                    candidates.add(int(d.name[len(CGROUP_PREFIX) :]))
        for dev in Path("/sys/class/net").glob(f"{BRIDGE_PREFIX}*"):
            with contextlib.suppress(ValueError):
                candidates.add(int(dev.name[len(BRIDGE_PREFIX) :]))
        for n in sorted(candidates):
            slot = Slot(n)
            record = _read_record(slot)
            if record is not None and owner_alive(record):
                continue
            name = record["node"] if record else "unrecorded"
            left = release(slot, locked=True)
            swept.append(f"slot {n} ({name})" + (f", left: {', '.join(left)}" if left else ""))
    return swept


def slots_of_run(run_dir: Path) -> list[tuple[Slot, dict[str, Any]]]:
    """The slots recorded for nodes of the sandbox in ``run_dir``."""
    out: list[tuple[Slot, dict[str, Any]]] = []
    if not REGISTRY.exists():
        return out
    for rec in sorted(REGISTRY.glob("slot-*.json")):
        with contextlib.suppress(ValueError):
            slot = Slot(int(rec.stem.split("-", 1)[1]))
            record = _read_record(slot)
            if record is not None and record.get("run_dir") == str(run_dir):
                out.append((slot, record))
    return out


def namespace_pids(mnt_ns: str, marker: str) -> list[int]:
    """Live processes (not zombies) in the mount namespace ``mnt_ns`` ("mnt:[inode]") whose
    mount table holds ``marker`` (the node's directory): namespace inode numbers are reused
    once a namespace is gone, e.g. by an image build on the same machine."""
    pids: list[int] = []
    for pid_dir in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if str((pid_dir / "ns" / "mnt").readlink()) != mnt_ns:
                continue
            if marker not in (pid_dir / "mountinfo").read_text():
                continue
            pid = int(pid_dir.name)
            if procs.proc_start_time(pid) is not None:
                pids.append(pid)
    return pids


def kill_namespace(mnt_ns: str, marker: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL what is left in a node's mount namespace outside its cgroups (a ``ctr`` run
    through nsenter) and wait; returns pids still there."""
    deadline = time.monotonic() + timeout
    pids = namespace_pids(mnt_ns, marker)
    while pids and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        pids = namespace_pids(mnt_ns, marker)
    return pids


def leftovers(slot: Slot, mnt_ns: str | None = None, marker: str = "") -> list[str]:
    """What of the slot is still on the machine: processes, cgroups, the bridge, veths left in
    the host namespace, and processes still in the node's mount namespace."""
    left = [f"process {pid}" for pid in sorted(cgroup_pids(slot))]
    left += [f"cgroup {h / slot.cgroup}" for h in hierarchies() if (h / slot.cgroup).exists()]
    if Path(f"/sys/class/net/{slot.bridge}").exists():
        left.append(f"bridge {slot.bridge}")
    if mnt_ns:
        for pid in namespace_pids(mnt_ns, marker):
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                left.append(f"process {pid} in {mnt_ns} ({cmd.strip()[:80]})")
    return left
