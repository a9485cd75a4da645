"""GPU stage, CDI section: the spec the kubelet plugin writes for each GPU, checked on this box.

For every GPU whose whole device the plugin publishes, two claims are prepared the way the
plugin prepares them, with the plugin's own code: ``discover`` names the device, ``parse_claim``
and ``make_plan`` turn an allocation result into the claim's device record, and ``CdiWriter``
writes the spec into a CDI directory under ``workdir``, with the GPU's minor from NVML and the
node files found under ``dev_root`` (the plugin's ``--driver-root``), as ``DeviceState`` does.

- **whole**: the whole GPU (cores 100, all its memory), enforcement ``exclusive``;
- **shared**: a share of it (50 cores, half the memory) carrying the enforcer's container edits
  that the caller got from a real ``CreateShare`` (skipped, and said so, without them).

Each spec is read back the way a runtime reads it (``gpuslice_core.cdi.resolve``) and checked:

1. every host path exists: device nodes' ``hostPath``, bind mounts' ``hostPath``, hooks'
   ``path``. A missing one fails the claim and its probe is not run. The nodes the plugin left
   out because they do not exist under ``dev_root`` are listed (``omitted_nodes``).
2. the probe command runs in a child that sees only what the spec gives: its own mount
   namespace (``/`` made recursively private, so nothing leaks back), a fresh read-only tmpfs on
   ``/dev`` holding the spec's device nodes (each bind-mounted from its host path) plus
   ``/dev/null``, ``/dev/zero``, ``/dev/urandom`` and an empty ``/dev/shm``, which every
   container has and which are listed as added for the process, the spec's bind mounts with
   their options, and as environment exactly the spec's variables plus the few a process needs
   to start (``PATH``, ``HOME``, ``PYTHONPATH``, ``LD_LIBRARY_PATH`` where set), each named in
   the result. Hooks are checked, not run: they need a container's OCI state.
2a. **the driver's libraries come from the spec alone.** The spec is written as the chart's
   plugin writes it (``--driver-root-host`` set), so it mounts the driver's compute and utility
   libraries. The root file system is the host's, so before the probe starts every other file of
   the driver in the driver root's library directories (``libcuda*``, ``libnvidia-*``, ...) is
   masked with ``/dev/null``, as a runtime masks a path: CUDA starts only if the files the spec
   mounts are all it needs (``masked_driver_files`` names the others). A driver mount whose
   target the host's root lacks (the copies in ``/usr/lib/<triplet>`` and ``/usr/lib64``, which a
   runtime creates in the container's root) is not placed and is noted; its source is mounted at
   its own path too.
3. the probe's last JSON line says CUDA started (``ok``) and saw exactly one device, the
   claim's GPU (by UUID).

Isolation needs root and ``unshare(CLONE_NEWNS)``; where either is missing the result is
``skipped`` with the reason, never a pass. The parent process never changes its own mounts: the
child does everything in its own namespace, which ends with it.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

from gpuslice_api.names import DRIVER
from gpuslice_api.quantity import MIB
from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Hook, Mount, resolve
from gpuslice_core.driverroot import CONTROL_NODES, LIBRARY_DIRS, DriverRoot
from gpuslice_core.errors import GpusliceError
from gpuslice_draplugin import ClaimRef
from gpuslice_kubelet_plugin.cdispecs import CdiWriter
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord
from gpuslice_kubelet_plugin.claims import parse_claim
from gpuslice_kubelet_plugin.discovery import Device, Inventory, discover
from gpuslice_kubelet_plugin.enforcer import ShareGrant
from gpuslice_kubelet_plugin.plan import make_plan
from gpuslice_kubelet_plugin.state import record_grant
from gpuslice_nvml import GpuInfo, Nvml
from gpuslice_testkit.kubelet_plugin.dra import result as allocation_result

Kind = Literal["whole", "shared"]
Status = Literal["pass", "fail", "skipped"]
#: What an enforcer share gave: the grant itself, or only its CDI container edits (as the model
#: or its JSON, ``gpuslice_api.enforcer.cdi_edits(reply.container_edits)``).
SharedEdits = ShareGrant | ContainerEdits | Mapping[str, Any]

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "gpustage"
POOL = "gpustage"
OWNER = "gpustage"
PROBE_TIMEOUT_S = 30.0
#: Device nodes any process needs that are not GPU nodes; bound from the host's /dev.
EXTRA_NODES = ("/dev/null", "/dev/zero", "/dev/urandom")
#: Empty tmpfs directories every container has.
EXTRA_DIRS = ("/dev/shm",)
#: Given a tmpfs of its own when a spec mounts something under it that the host lacks.
RUN_DIR = "/run"
#: The level written for a share given as bare edits (it only shows in ``_ENFORCEMENT``).
BARE_EDITS_LEVEL = "hard"
STDERR_TAIL = 2000
#: The driver's user-space files (all of them, not only those the plugin mounts): masked in the
#: probe's namespace unless the spec mounts them, so CUDA can only use what the spec gives.
DRIVER_FILES = (
    "libcuda*.so*",
    "libnvidia-*.so*",
    "libnvcuvid*.so*",
    "libnvoptix*.so*",
    "lib*_nvidia*.so*",
)


@dataclass
class CdiResult:
    """One claim's spec on one GPU, and what a process given only that spec saw."""

    gpu: int
    uuid: str
    kind: Kind
    status: Status
    reason: str
    claim_uid: str = ""
    cdi_id: str = ""
    spec_path: str = ""
    #: Host paths the spec names that do not exist on this host.
    missing_host_paths: list[str] = field(default_factory=list)
    #: The GPU's node and control nodes the plugin left out: absent under the dev root.
    omitted_nodes: list[str] = field(default_factory=list)
    #: The spec's device nodes: ``{"path": in the container, "hostPath": on the host}``.
    device_nodes: list[dict[str, str]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    #: The spec's hooks with ``exists`` (checked, not run).
    hooks: list[dict[str, Any]] = field(default_factory=list)
    #: The spec's environment (``KEY=VALUE``), all the probe got besides ``process_env``.
    env: list[str] = field(default_factory=list)
    #: The driver's files the spec does not mount, masked with /dev/null for the probe.
    masked_driver_files: list[str] = field(default_factory=list)
    #: Driver mounts not placed: their targets are not on the host's root (see 2a above).
    unplaced_mounts: list[str] = field(default_factory=list)
    #: Variables added to start the process, not from the spec (name → value).
    process_env: dict[str, str] = field(default_factory=dict)
    #: Entries put into the probe's /dev for the process, not from the spec.
    added_for_process: list[str] = field(default_factory=list)
    #: What the probe's /dev held (relative paths), as the isolating child listed it.
    dev: list[str] = field(default_factory=list)
    #: The probe's last JSON line.
    probe: dict[str, Any] | None = None
    probe_exit: int | None = None
    probe_stderr: str = ""
    #: Remarks that do not decide the result (hooks not run, hooks absent).
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def to_json(self) -> dict[str, Any]:
        return {"check": "cdi", **asdict(self), "ok": self.ok}


@dataclass(frozen=True)
class _Claim:
    """A claim the plugin would write, with the GPU it is on."""

    gpu: GpuInfo
    kind: Kind
    record: ClaimRecord


def default_process_env() -> dict[str, str]:
    """What the probe needs to start that no spec gives: a PATH, a HOME, this checkout on
    PYTHONPATH (the workload is ``e2e.gpustage.workload``), and LD_LIBRARY_PATH where the host
    needs it to find its driver libraries."""
    env = {
        "PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME") or "/root",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    if os.environ.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


def check_cdi(
    nvml: Nvml,
    *,
    probe_cmd: Sequence[str],
    workdir: Path,
    shared_edits: Mapping[int, SharedEdits] | None = None,
    dev_root: Path = Path("/"),
    process_env: Mapping[str, str] | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> list[CdiResult]:
    """Check the plugin's CDI spec of a whole-GPU claim and of a shared claim on every GPU.

    ``probe_cmd``: the CUDA probe (``python -m e2e.gpustage.workload probe``); its last stdout
    line is JSON with ``ok`` and ``devices[].uuid``. ``shared_edits``: GPU index → the enforcer
    share's edits for that GPU (None: the shared claims are skipped). ``dev_root``: the plugin's
    ``--driver-root``, under which ``dev/nvidia*`` are looked for. ``process_env``: what the
    probe gets besides the spec's variables (default :func:`default_process_env`).
    """
    inventory = discover(nvml)
    # host=: the spec carries the driver's libraries, as the chart's plugin writes it
    driver = DriverRoot(dev_root, host=dev_root)
    writer = CdiWriter(ClaimSpecs(workdir / "cdi"), driver=driver)
    minors = {g.uuid: g.minor for g in inventory.gpus}  # as DeviceState._minors
    env = dict(default_process_env() if process_env is None else process_env)
    results: list[CdiResult] = []
    for gpu in inventory.gpus:
        device = _whole_device(inventory, gpu)
        if device is None:
            why = f"skipped: GPU {gpu.index} is in MIG mode; the plugin publishes its MIG devices"
            results += [_skipped(gpu, "whole", why), _skipped(gpu, "shared", why)]
            continue
        edits = None if shared_edits is None else shared_edits.get(gpu.index)
        kinds: tuple[tuple[Kind, SharedEdits | None], ...] = (("whole", None), ("shared", edits))
        for kind, given in kinds:
            if kind == "shared" and given is None:
                why = "skipped: no enforcer share edits given for this GPU"
                results.append(_skipped(gpu, kind, why))
                continue
            try:
                claim = _Claim(gpu, kind, _record(inventory, device, kind, given))
            except (GpusliceError, ValueError) as exc:
                why = f"the plugin would not write this claim: {exc}"
                results.append(CdiResult(gpu.index, gpu.uuid, kind, "fail", why))
                continue
            results.append(_check(claim, writer, minors, probe_cmd, env, timeout_s))
    return results


def driver_files(root: Path) -> list[Path]:
    """Every regular file of the driver's user space in the root's library directories (links
    left out: masking a link would mask the file it names)."""
    found: dict[Path, None] = {}
    for directory in LIBRARY_DIRS:
        for pattern in DRIVER_FILES:
            for path in sorted((root / directory).glob(pattern)):
                if path.is_file() and not path.is_symlink():
                    found[path] = None
    return list(found)


def _skipped(gpu: GpuInfo, kind: Kind, reason: str) -> CdiResult:
    return CdiResult(gpu=gpu.index, uuid=gpu.uuid, kind=kind, status="skipped", reason=reason)


def _whole_device(inventory: Inventory, gpu: GpuInfo) -> Device | None:
    whole = [d for d in inventory.on_gpu(gpu.index) if d.kind == "gpu"]
    return whole[0] if whole else None


def _grant(edits: SharedEdits, share_id: str) -> ShareGrant:
    if isinstance(edits, ShareGrant):
        return edits
    if not isinstance(edits, ContainerEdits):
        edits = ContainerEdits.model_validate(dict(edits))
    return ShareGrant(share_id=share_id, level=BARE_EDITS_LEVEL, edits=edits)


def _record(
    inventory: Inventory, device: Device, kind: Kind, edits: SharedEdits | None
) -> ClaimRecord:
    """The claim's record as ``DeviceState`` builds it (``_record``, then ``_apply``)."""
    uid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpustage/{kind}/{device.gpu_uuid}"))
    ref = ClaimRef(NAMESPACE, f"{kind}-{device.name}", uid)
    if kind == "whole":
        allocated = allocation_result(device.name, pool=POOL, request=kind)
    else:
        allocated = allocation_result(
            device.name,
            pool=POOL,
            request=kind,
            cores="50",
            memory=f"{device.memory_bytes // 2 // MIB}Mi",
            share_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpustage/share/{device.gpu_uuid}")),
        )
    claim = {
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": uid},
        "status": {"allocation": {"devices": {"results": [allocated]}}},
    }
    plan = make_plan(parse_claim(claim, ref, driver=DRIVER, pool=POOL), inventory, POOL)
    record = ClaimRecord(
        uid=uid,
        namespace=ref.namespace,
        name=ref.name,
        state="PrepareCompleted",
        owner=OWNER,
        devices=[p.record() for p in plan.devices],
        updated=time.time(),
    )
    record.enforcement = "exclusive"
    if edits is not None:
        if plan.share is None:
            raise AssertionError(f"the plugin planned no share for {ref} ({allocated})")
        record_grant(record, _grant(edits, share_id=f"gpustage-{device.name}"))
    return record


def _host_path(path: str, host_path: str) -> str:
    return host_path or path


def _missing(edits: ContainerEdits) -> list[str]:
    paths = [_host_path(n.path, n.host_path) for n in edits.device_nodes]
    paths += [m.host_path for m in edits.mounts if _is_bind(m)]
    paths += [h.path for h in edits.hooks]
    return [p for p in dict.fromkeys(paths) if not Path(p).exists()]


def _is_bind(mount: Mount) -> bool:
    return mount.type in ("", "bind") or "bind" in mount.options or "rbind" in mount.options


def _hook_json(hook: Hook) -> dict[str, Any]:
    out = hook.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    return {**out, "exists": Path(hook.path).exists()}


def _check(
    claim: _Claim,
    writer: CdiWriter,
    minors: Mapping[str, int],
    probe_cmd: Sequence[str],
    process_env: Mapping[str, str],
    timeout_s: float,
) -> CdiResult:
    start = time.monotonic()
    record, gpu = claim.record, claim.gpu
    ids = writer.write(record, dict(minors))
    cdi_id = ids[writer.device_name(record.uid, record.devices[0])][0]
    edits = resolve(writer.specs.root, [cdi_id], strict=True)
    nodes = {n.path for n in edits.device_nodes}
    expected = [f"/dev/nvidia{gpu.minor}", *(f"/dev/{name}" for name in CONTROL_NODES)]
    mounted = {os.path.realpath(m.host_path) for m in edits.mounts}
    masked = [
        str(p) for p in driver_files(writer.driver.path) if os.path.realpath(p) not in mounted
    ]
    res = CdiResult(
        gpu=gpu.index,
        uuid=record.devices[0].uuid,
        kind=claim.kind,
        status="fail",
        reason="",
        claim_uid=record.uid,
        cdi_id=cdi_id,
        spec_path=str(writer.specs.spec_path(record.uid)),
        missing_host_paths=_missing(edits),
        omitted_nodes=[p for p in expected if p not in nodes],
        device_nodes=[
            {"path": n.path, "hostPath": _host_path(n.path, n.host_path)}
            for n in edits.device_nodes
        ],
        mounts=[m.model_dump(mode="json", by_alias=True) for m in edits.mounts],
        hooks=[_hook_json(h) for h in edits.hooks],
        env=list(edits.env),
        masked_driver_files=masked,
        process_env=dict(process_env),
        added_for_process=[*EXTRA_NODES, *EXTRA_DIRS],
    )
    if edits.hooks:
        res.notes.append(f"{len(edits.hooks)} hook(s) checked, not run: they need an OCI state")
    elif claim.kind == "shared":
        res.notes.append(
            "the share's edits carry no hooks: the enforcer's --hook-path is empty (hooks "
            "disabled) or the share is not enforced"
        )
    try:
        if res.missing_host_paths:
            res.reason = f"host paths of the spec do not exist: {res.missing_host_paths}"
        elif refused := _isolation_refused():
            res.status, res.reason = "skipped", f"skipped: {refused}"
        else:
            _probe(res, edits, _driver_mounts(writer.driver), probe_cmd, timeout_s)
    finally:
        res.seconds = round(time.monotonic() - start, 3)
    return res


def _under_run(path: str) -> bool:
    """Whether a missing mount target lies under /run (or /var/run, its usual link)."""
    real = os.path.realpath(path)
    return not Path(path).exists() and (real == RUN_DIR or real.startswith(RUN_DIR + "/"))


def _isolation_refused() -> str | None:
    if os.geteuid() != 0:
        return "not root: a private mount namespace and a fresh /dev need CAP_SYS_ADMIN"
    return None


def _driver_mounts(driver: DriverRoot) -> set[tuple[str, str]]:
    return {(m.host_path, m.container_path) for m in driver.user_space()}


def _probe(
    res: CdiResult,
    edits: ContainerEdits,
    driver_mounts: set[tuple[str, str]],
    probe_cmd: Sequence[str],
    timeout_s: float,
) -> None:
    """Run the probe isolated and judge what it printed; fills in ``res``."""
    spec_env = dict(e.split("=", 1) for e in edits.env)
    plan: dict[str, Any] = {
        "nodes": [
            {"source": _host_path(n.path, n.host_path), "target": n.path}
            for n in edits.device_nodes
        ],
        "extras": [{"source": p, "target": p} for p in EXTRA_NODES],
        "tmpfs_dirs": list(EXTRA_DIRS),
        "mounts": [
            {
                "source": m.host_path,
                "target": m.container_path,
                "options": m.options,
                "driver": (m.host_path, m.container_path) in driver_mounts,
            }
            for m in edits.mounts
        ],
        "mask": list(res.masked_driver_files),
        "argv": list(probe_cmd),
        "env": {**res.process_env, **spec_env},
    }
    # A mount target a container runtime would create (e.g. the MPS pipe directory under
    # /var/run): the child gets its own tmpfs on /run, as a container has, and creates it there;
    # the host's /run is not changed.
    if (
        any(_under_run(m.container_path) for m in edits.mounts)
        and RUN_DIR not in plan["tmpfs_dirs"]
    ):
        plan["tmpfs_dirs"].append(RUN_DIR)
        res.added_for_process.append(RUN_DIR)
    run = _run_isolated(plan, timeout_s)
    res.probe_exit = run.returncode
    res.probe_stderr = run.stderr[-STDERR_TAIL:]
    setup = run.report[-1] if run.report else None
    if setup is None:
        res.reason = f"the isolating child died before it reported (exit {run.returncode})"
        return
    if not setup.get("ok"):
        stage, error = setup.get("stage"), setup.get("error")
        if stage == "unshare":
            res.status, res.reason = "skipped", f"skipped: unshare(CLONE_NEWNS) refused: {error}"
        else:
            res.reason = f"isolation failed at {stage}: {error}"
        return
    res.dev = list(setup.get("dev", []))
    res.unplaced_mounts = list(setup.get("unplaced", []))
    if res.unplaced_mounts:
        res.notes.append(
            f"{len(res.unplaced_mounts)} driver mount(s) not placed: their targets are not on "
            "this host's root (a runtime creates them in the container's); each source is also "
            "mounted at its own path"
        )
    res.probe = _last_json(run.stdout)
    if run.timed_out:
        res.reason = f"the probe did not finish within {timeout_s:g} s (killed)"
        return
    res.status, res.reason = _judge(res.probe, run.returncode, res.uuid)
    if res.status == "pass" and res.masked_driver_files:
        res.reason += f", the driver's other {len(res.masked_driver_files)} file(s) masked"


def _judge(probe: dict[str, Any] | None, returncode: int, expected: str) -> tuple[Status, str]:
    if probe is None:
        return "fail", f"the probe printed no JSON line (exit {returncode})"
    if not probe.get("ok"):
        return "fail", (
            f"CUDA did not start with only the spec's edits (exit {returncode}, "
            f"stage {probe.get('stage')}): {probe.get('error')}"
        )
    if returncode != 0:
        return "fail", f"the probe said ok but exited {returncode}"
    seen = [d.get("uuid") for d in probe.get("devices") or [] if isinstance(d, dict)]
    if seen != [expected]:
        return "fail", f"CUDA saw {len(seen)} device(s) {seen}; the claim gives only {expected}"
    return "pass", f"CUDA started and saw only {expected}"


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


@dataclass(frozen=True)
class _Run:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    report: list[dict[str, Any]]


def _run_isolated(plan: Mapping[str, Any], timeout_s: float) -> _Run:
    """Start the isolating child (which execs the probe) and collect what it and the probe
    said; the child's setup report comes over a pipe of its own."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _HELPER, json.dumps({**plan, "report_fd": write_fd})],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(write_fd,),
            env={},
            start_new_session=True,
            text=True,
        )
    finally:
        os.close(write_fd)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    with os.fdopen(read_fd, encoding="utf-8") as report:
        lines = [json.loads(line) for line in report.read().splitlines() if line.strip()]
    return _Run(proc.returncode, stdout, stderr, timed_out, lines)


def _isolate_and_exec(plan: dict[str, Any]) -> NoReturn:
    """The isolating child (run as ``python -I -c``, so standard library only): a private
    mount namespace, a fresh /dev with the spec's nodes and the extras, the spec's mounts; then
    it execs the probe with the given environment. It reports its setup as one JSON line on
    ``report_fd`` (closed by the exec) and exits 125 when a step fails."""
    import ctypes
    import json
    import os
    import stat
    import sys
    from pathlib import Path

    ms_rdonly, ms_nosuid, ms_nodev, ms_noexec = 0x1, 0x2, 0x4, 0x8
    ms_remount, ms_bind, ms_rec, ms_private = 0x20, 0x1000, 0x4000, 0x40000
    clone_newns = 0x20000
    per_mount = {"ro": ms_rdonly, "nosuid": ms_nosuid, "nodev": ms_nodev, "noexec": ms_noexec}
    libc = ctypes.CDLL(None, use_errno=True)
    report = os.fdopen(plan["report_fd"], "w")
    stage = "start"

    def say(line: dict[str, Any]) -> None:
        report.write(json.dumps(line) + "\n")
        report.flush()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
        def c(s: str | None) -> bytes | None:
            return s.encode() if s is not None else None

        rc = libc.mount(c(source), c(target), c(fstype), ctypes.c_ulong(flags), c(data))
        check(rc, f"mount {source} on {target}")

    def ours(target: str) -> bool:
        real = os.path.realpath(target)
        return any(real == d or real.startswith(d + "/") for d in ["/dev", *plan["tmpfs_dirs"]])

    def place(source_fd: int, target: str, flags: int = 0) -> None:
        """Bind the source onto ``target``: created when under /dev or a tmpfs of this
        namespace, else it must exist (the root file system is the host's, and is not
        changed)."""
        path = Path(target)
        if not path.exists() and ours(target):
            path.parent.mkdir(parents=True, exist_ok=True)
            if stat.S_ISDIR(os.fstat(source_fd).st_mode):
                path.mkdir()
            else:
                path.touch()
        if not path.exists():
            raise FileNotFoundError(f"mount target {target} does not exist on this host")
        mount(f"/proc/self/fd/{source_fd}", target, None, ms_bind | flags, "")

    try:
        stage = "unshare"
        unshare = getattr(os, "unshare", None)  # Python 3.12+
        if unshare is not None:
            unshare(clone_newns)
        else:
            check(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
        stage = "make / private"
        mount(None, "/", None, ms_rec | ms_private, "")
        stage = "open sources"  # before /dev is covered; in this namespace, so bindable
        entries = [*plan["nodes"], *plan["extras"], *plan["mounts"]]
        fds = {e["source"]: os.open(e["source"], os.O_PATH) for e in entries}
        null = os.open("/dev/null", os.O_PATH)
        stage = "mask the driver's other files"  # before the spec's mounts go on top
        for masked in plan["mask"]:
            mount(f"/proc/self/fd/{null}", masked, None, ms_bind, "")
        stage = "tmpfs on /dev"
        dev_flags = ms_nosuid | ms_nodev | ms_noexec
        mount("tmpfs", "/dev", "tmpfs", dev_flags, "mode=755,size=1m")
        stage = "device nodes"
        for e in [*plan["nodes"], *plan["extras"]]:
            place(fds[e["source"]], e["target"])
        for d in plan["tmpfs_dirs"]:
            Path(d).mkdir(parents=True, exist_ok=True)
            mount("tmpfs", d, "tmpfs", ms_nosuid | ms_nodev, "mode=1777")
        stage = "mounts"
        unplaced = []
        for m in plan["mounts"]:
            if m["driver"] and not Path(m["target"]).exists() and not ours(m["target"]):
                unplaced.append(m["target"])
                continue
            place(fds[m["source"]], m["target"], ms_rec if "rbind" in m["options"] else 0)
            extra = sum(v for k, v in per_mount.items() if k in m["options"])
            if extra:
                mount(None, m["target"], None, ms_remount | ms_bind | extra, "")
        stage = "read-only /dev"
        mount(None, "/dev", None, ms_remount | ms_bind | ms_rdonly | dev_flags, "")
        for fd in [*fds.values(), null]:
            os.close(fd)
        dev = sorted(
            str(Path(root, name).relative_to("/dev"))
            for root, dirs, files in os.walk("/dev")
            for name in [*dirs, *files]
        )
        say({"ok": True, "dev": dev, "unplaced": unplaced})
        stage = "exec"
        os.set_inheritable(report.fileno(), False)
        os.execvpe(plan["argv"][0], plan["argv"], plan["env"])
    except OSError as exc:
        say({"ok": False, "stage": stage, "errno": exc.errno, "error": str(exc)})
    sys.exit(125)


_HELPER = (
    "from __future__ import annotations\nimport json, sys\nfrom typing import Any, NoReturn\n"
    + textwrap.dedent(inspect.getsource(_isolate_and_exec))
    + "\n_isolate_and_exec(json.loads(sys.argv[1]))\n"
)
