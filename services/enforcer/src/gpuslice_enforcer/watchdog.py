"""The NVML watchdog: samples per-process memory and SM use, kills and throttles.

Every ``sample_interval_s`` (default 100 ms), for each GPU that has shares:

1. read the GPU's compute processes (memory) and per-process SM utilization since the last
   sample from NVML;
2. map each PID to a share through its cgroups (``/proc/<pid>/cgroup``): a cgroup at or below a
   container cgroup the CDI hook attached, or else a cgroup path naming the pod UID of exactly
   one share. A process that maps to no known share is never touched;
3. memory: a share above its limit on a device is a violation; where the watchdog enforces
   memory and ``memory_action`` is ``kill``, its largest process there is killed (SIGKILL through
   a pidfd, after checking the pid still is the same process of the same share) and the reason
   recorded; otherwise the breach is reported;
4. cores: the share's SM use feeds its credit bucket (``throttle``); while the credit is negative
   the share's cgroups are frozen (v1 ``freezer.state`` / v2 ``cgroup.freeze``) for the next
   period, so the long-run use converges to the limit.

Safety: a failed sample (any NVML error, or any crash of the sample) kills nothing and thaws
the shares it concerns (fail open);
processes of unknown owners are ignored; a root cgroup or the enforcer's own is never frozen;
every frozen cgroup is thawed when its share is released and when the watchdog stops, and a
restarted watchdog thaws whatever its predecessor left frozen that it does not want frozen.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gpuslice_core.cgroupnames import names_pod
from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_enforcer import cgroups as cg
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.metrics import EnforcerMetrics
from gpuslice_enforcer.smmeter import SmMeter
from gpuslice_enforcer.state import Mechanism, ShareRecord
from gpuslice_enforcer.throttle import Bucket
from gpuslice_enforcer.violations import Violation, ViolationBus
from gpuslice_nvml import Nvml, NvmlError, ProcessInfo

log = get_logger(__name__)

#: A breach that is only reported is reported again after this long.
REPORT_EVERY_S = 10.0


@dataclass
class DeviceUsage:
    device_uuid: str
    memory_used: int = 0
    memory_limit: int = 0
    sm_percent: float = 0.0
    sm_limit: int = 0
    throttled_s: float = 0.0
    kills: int = 0
    violations: int = 0
    memory_mechanism: Mechanism = Mechanism.WATCHDOG
    cores_mechanism: Mechanism = Mechanism.WATCHDOG


@dataclass
class _Runtime:
    """What the watchdog keeps about one share between samples."""

    buckets: dict[int, Bucket] = field(default_factory=dict)
    usage: dict[int, DeviceUsage] = field(default_factory=dict)
    targets: set[Path] = field(default_factory=set)
    frozen: bool = False
    last_report: dict[tuple[int, str], float] = field(default_factory=dict)
    #: (pid, start time) of the share's processes seen bypassing MPS, and whether this sample
    #: found one it had not seen before (frozen at once, before its first SM sample).
    bypassers: set[tuple[int, int]] = field(default_factory=set)
    new_bypasser: bool = False


@dataclass
class _Owned:
    share: ShareRecord
    info: ProcessInfo
    start: int
    #: SM percent as of the process's latest utilization samples.
    sm: float
    target: Path | None
    #: SM percent-seconds its samples that arrived this period account for.
    busy: float = 0.0
    #: A process of an MPS share with a context of its own (not a client of the MPS server).
    bypass: bool = False


class LiveProcesses:
    """Which of the processes seen before have exited, with one ``poll`` per sample.

    A pidfd (``pidfd_open``, Linux 5.3+) refers to one process for as long as it is open, and
    polls readable once that process exited, so a process tracked here is the same one until
    :meth:`exited` names its pid: no ``/proc`` read per process per sample. Where pidfds are not
    available (old kernels, seccomp), ``track`` returns False and the caller reads the start
    time each sample instead.
    """

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._pids: dict[int, int] = {}  # pidfd -> pid
        self._poll = select.poll()
        self._available = hasattr(os, "pidfd_open")

    def tracking(self, pid: int) -> bool:
        return pid in self._fds

    def track(self, pid: int) -> bool:
        """Hold a pidfd for ``pid``; False if it cannot (gone, or no pidfds here)."""
        if pid in self._fds:
            return True
        if not self._available:
            return False
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM):
                self._available = False
            return False
        self._fds[pid], self._pids[fd] = fd, pid
        self._poll.register(fd, select.POLLIN)
        return True

    def exited(self) -> list[int]:
        """Pids of tracked processes that exited since the last call (and are forgotten)."""
        gone = [self._pids[fd] for fd, _ in self._poll.poll(0) if fd in self._pids]
        for pid in gone:
            self.forget(pid)
        return gone

    def forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is None:
            return
        del self._pids[fd]
        self._poll.unregister(fd)
        os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self.forget(pid)


class Watchdog:
    def __init__(
        self,
        nvml: Nvml,
        config: EnforcerConfig,
        cgroups: cg.CgroupView,
        shares: Callable[[], tuple[int, list[ShareRecord]]],
        bus: ViolationBus,
        metrics: EnforcerMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.nvml = nvml
        self.config = config
        self.cgroups = cgroups
        self._shares = shares
        self.bus = bus
        self.metrics = metrics
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.RLock()
        self._runtime: dict[str, _Runtime] = {}
        #: pid -> (start time, shares generation, owning claim UID, freeze target)
        self._owners: dict[int, tuple[int, int, str | None, Path | None]] = {}
        self._live = LiveProcesses()
        self._last_sample: dict[int, float] = {}
        self._last_ts: dict[int, int] = {}
        self._sm = SmMeter()
        self._killed: dict[tuple[int, int], float] = {}
        self._error_logged: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0
        self.last_sample_wall = 0.0

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The sampling thread once started (a liveness check asks whether it still runs)."""
        return self._thread

    def stop(self) -> None:
        """Stop sampling and thaw everything this watchdog may have frozen."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for runtime in self._runtime.values():
                self._apply(runtime, frozen=False)
            self._live.close()

    def _run(self) -> None:
        structlog.contextvars.bind_contextvars(thread="watchdog")
        interval = self.config.sample_interval_s
        next_at = self._clock()
        crashed: dict[str, tuple[float, int]] = {}  # error text -> (last logged, times since)
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as exc:  # the loop must survive anything; a sample is only a sample
                # The same failure every period (e.g. out of file descriptors) is logged with
                # its traceback once per REPORT_EVERY_S, with how often it recurred meanwhile.
                key, now = f"{type(exc).__name__}: {exc}"[:200], self._clock()
                last, times = crashed.get(key, (-REPORT_EVERY_S, 0))
                if now - last >= REPORT_EVERY_S:
                    log.exception("watchdog sample crashed", recurred=times)
                    crashed[key] = (now, 0)
                else:
                    crashed[key] = (last, times + 1)
                if len(crashed) > 64:
                    crashed.clear()
                self._fail_open()
            next_at += interval
            delay = next_at - self._clock()
            if delay < 0:  # fell behind: do not try to catch up in a burst
                next_at, delay = self._clock(), 0
            self._stop.wait(delay)

    def _fail_open(self) -> None:
        """After a sample that crashed: thaw every share this watchdog froze, as a failed NVML
        sample does. A share frozen for one period must not stay frozen because the sample that
        would have thawed it failed (e.g. a /proc read racing an exit, out of descriptors)."""
        with self._lock:
            for runtime in self._runtime.values():
                if runtime.frozen:
                    for bucket in runtime.buckets.values():
                        bucket.frozen = False
                    try:
                        self._apply(runtime, frozen=False)
                    except Exception:  # best effort: the next sample tries again
                        log.warning("cannot thaw a share after a crashed sample", exc_info=True)

    # -- one sample -----------------------------------------------------------------------
    def sample_once(self) -> None:
        generation, shares = self._shares()
        by_gpu: dict[int, list[ShareRecord]] = {}
        for share in shares:
            for index in share.gpu_indices:
                by_gpu.setdefault(index, []).append(share)
        with self._lock, self.metrics.sample.time():
            for pid in self._live.exited():  # whatever is cached about them is stale
                self._owners.pop(pid, None)
            for uid in list(self._runtime):
                if all(s.claim_uid != uid for s in shares):
                    self._drop(uid)
            want_frozen: dict[str, bool] = {}
            dts: dict[str, float] = {}
            seen: set[int] = set()
            by_uid = {s.claim_uid: s for s in shares}
            for gpu, gpu_shares in by_gpu.items():
                self._sample_gpu(gpu, gpu_shares, by_uid, generation, want_frozen, dts, seen)
            self._forget_pids(seen)
            for share in shares:
                runtime = self._runtime.setdefault(share.claim_uid, _Runtime())
                runtime.targets |= self._container_targets(share)
                frozen = want_frozen.get(share.claim_uid, False)
                if runtime.frozen:
                    self._account_throttled(share, runtime, dts.get(share.claim_uid, 0.0))
                self._apply(runtime, frozen=frozen)
            self.samples += 1
            self.last_sample_wall = self._wall()

    def _sample_gpu(
        self,
        gpu: int,
        gpu_shares: list[ShareRecord],
        all_shares: dict[str, ShareRecord],
        generation: int,
        want_frozen: dict[str, bool],
        dts: dict[str, float],
        seen: set[int],
    ) -> None:
        now = self._clock()
        try:
            processes = self.nvml.running_processes(gpu)
            clients: set[int] = set()
            if any(s.cores_mechanism.mps for s in gpu_shares):
                mps = self.nvml.mps_processes(gpu)
                clients = {p.pid for p in mps}
                processes = [p for p in processes if p.pid not in clients] + mps
            samples = self.nvml.process_utilization(gpu, self._last_ts.get(gpu, 0))
        except NvmlError as exc:
            self.metrics.sample_errors.labels(gpu=str(gpu)).inc()
            if now - self._error_logged.get(gpu, -REPORT_EVERY_S) >= REPORT_EVERY_S:
                self._error_logged[gpu] = now  # a persistent error is logged every 10 s
                log.warning("watchdog sample failed; nothing enforced", gpu=gpu, error=str(exc))
            self._last_sample.pop(gpu, None)
            return  # shares of this GPU are not frozen this period (fail open)
        dt = now - self._last_sample.get(gpu, now - self.config.sample_interval_s)
        self._last_sample[gpu] = now
        previous_ts = self._last_ts.get(gpu)
        if samples:
            self._last_ts[gpu] = max(s.timestamp_us for s in samples)
        busy = self._sm.add(gpu, samples, previous_ts, self.config.sample_interval_s)
        self._sm.retain(gpu, {p.pid for p in processes} | {s.pid for s in samples})
        total_sm = sum(self._sm.rate(gpu, p.pid) for p in processes)

        owned: dict[str, list[_Owned]] = {s.claim_uid: [] for s in gpu_shares}
        for info in processes:
            seen.add(info.pid)
            found = self._owner(info.pid, all_shares, generation)
            if found is None:
                continue
            share, start, target = found
            if share.claim_uid in owned:
                owned[share.claim_uid].append(
                    _Owned(
                        share,
                        info,
                        start,
                        self._sm.rate(gpu, info.pid),
                        target,
                        busy.get(info.pid, 0.0),
                        bypass=share.cores_mechanism.mps and info.pid not in clients,
                    )
                )
        uuid = gpu_shares[0].device_uuids[gpu_shares[0].gpu_indices.index(gpu)]
        for share in gpu_shares:
            runtime = self._runtime.setdefault(share.claim_uid, _Runtime())
            mine = owned[share.claim_uid]
            runtime.targets.update(item.target for item in mine if item.target is not None)
            usage = runtime.usage.setdefault(
                gpu,
                DeviceUsage(
                    device_uuid=uuid,
                    memory_limit=share.memory_bytes,
                    sm_limit=share.cores_percent,
                    memory_mechanism=share.memory_mechanism,
                    cores_mechanism=share.cores_mechanism,
                ),
            )
            usage.memory_used = sum(item.info.used_memory_bytes or 0 for item in mine)
            usage.sm_percent = sum(item.sm for item in mine)
            used = sum(item.busy for item in mine) / dt if dt > 0 else usage.sm_percent
            self._publish_usage(share, usage)
            unenforced = self._unenforced(share, gpu, usage, mine, runtime)
            self._check_memory(share, gpu, usage, mine, runtime, unenforced)
            frozen = self._check_cores(
                share, gpu, usage, runtime, used, total_sm - usage.sm_percent, dt, unenforced
            )
            want_frozen[share.claim_uid] = want_frozen.get(share.claim_uid, False) or frozen
            dts[share.claim_uid] = max(dts.get(share.claim_uid, 0.0), dt)

    # -- ownership ------------------------------------------------------------------------
    def _forget_pids(self, seen: set[int]) -> None:
        """Drop what is cached about processes NVML no longer lists."""
        for pid in [p for p in self._owners if p not in seen]:
            del self._owners[pid]
            self._live.forget(pid)
        horizon = self._clock() - 30.0
        for key in [k for k, at in self._killed.items() if at < horizon]:
            del self._killed[key]

    def _owner(
        self, pid: int, shares: dict[str, ShareRecord], generation: int
    ) -> tuple[ShareRecord, int, Path | None] | None:
        """(share, start time, freeze target) of a process, cached per process and shares
        generation. A process the watchdog holds a pidfd for is the same process until the
        pidfd says it exited (``LiveProcesses``), so a known process costs no system call;
        without pidfds, one read of /proc/<pid>/stat per sample tells a reused pid apart.
        A process in no share is looked at again every sample (one read of its cgroups): it
        may be moved into a share's cgroup later, as a process that bypasses the share's MPS
        server after starting outside the container would be, and a cached "no share" would
        never see it (a test caught the watchdog missing such a process for good)."""
        cached = self._owners.get(pid)
        if cached is None or not self._live.tracking(pid):
            tracked = self._live.track(pid)  # before reading: the pidfd pins what is read
            start = cg.start_time(pid)
            if start is None:
                self._live.forget(pid)
                return None
            if cached is not None and cached[0] != start:
                cached = None  # the pid was reused
            if not tracked:
                self._live.forget(pid)
        else:
            start = cached[0]
        if cached is None or cached[1] != generation or cached[2] is None:
            groups = self.cgroups.of_pid(pid)
            owner = match_share(groups, list(shares.values())) if groups is not None else None
            target = self.cgroups.freeze_target(groups) if groups is not None and owner else None
            cached = (start, generation, owner.claim_uid if owner else None, target)
            self._owners[pid] = cached
        uid = cached[2]
        share = shares.get(uid) if uid is not None else None
        return (share, start, cached[3]) if share is not None else None

    def _container_targets(self, share: ShareRecord) -> set[Path]:
        targets = set()
        for c in share.containers.values():
            groups = cg.ProcessCgroups(
                v2_path=c.v2_path,
                freezer_path=c.freezer_path,
                v2_dir=Path(c.v2_dir) if c.v2_dir else None,
                freezer_dir=Path(c.freezer_dir) if c.freezer_dir else None,
            )
            target = self.cgroups.freeze_target(groups)
            if target is not None:
                targets.add(target)
        return targets

    # -- the backstop ---------------------------------------------------------------------
    def _unenforced(
        self,
        share: ShareRecord,
        gpu: int,
        usage: DeviceUsage,
        mine: list[_Owned],
        runtime: _Runtime,
    ) -> str:
        """Why a share's hard mechanism evidently does not hold it this sample ("" if it
        does): a process of an MPS share that is not a client of the GPU's MPS server (it
        has a context of its own, beside the server), or memory use above a limit a hard
        mechanism claims to hold. The watchdog then enforces the share itself."""
        if share.memory_mechanism is Mechanism.NONE and share.cores_mechanism is Mechanism.NONE:
            return ""
        if self.config.sm_action == "throttle":
            mine = [i for i in mine if not (i.bypass and self._kill_bypasser(i, usage, runtime))]
        bypassing = sorted(item.info.pid for item in mine if item.bypass)
        seen = {(item.info.pid, item.start) for item in mine if item.bypass}
        runtime.new_bypasser = bool(seen - runtime.bypassers)
        if seen - runtime.bypassers:
            self.metrics.bypasses.labels(*_labels(share, usage)).inc(len(seen - runtime.bypassers))
        runtime.bypassers = seen
        if bypassing:
            why = (
                f"pid {', '.join(map(str, bypassing))} of share {share.share_id} "
                f"{'is' if len(bypassing) == 1 else 'are'} not a client of the MPS server of "
                f"{usage.device_uuid} (a context of its own: the pipe directory was not used), "
                "so MPS does not hold it"
            )
            if self._due(runtime, gpu, "bypass"):
                self._violation(
                    share,
                    usage,
                    bypassing[0],
                    "cores",
                    usage.sm_percent,
                    share.cores_percent,
                    "reported",
                    why + "; the watchdog enforces the share's limits",
                )
            return why
        runtime.last_report.pop((gpu, "bypass"), None)
        if share.memory_mechanism.hard and usage.memory_used > share.memory_bytes:
            return (
                f"share {share.share_id} uses {usage.memory_used} bytes on {usage.device_uuid}, "
                f"over the limit of {share.memory_bytes} that {share.memory_mechanism.value} "
                "should hold"
            )
        return ""

    def _kill_bypasser(self, item: _Owned, usage: DeviceUsage, runtime: _Runtime) -> bool:
        """Kill a process of an MPS share that runs beside the MPS server instead of through
        it; True once it is killed (now or in an earlier sample).

        Killed, not frozen: freezing is per cgroup, and the share's legitimate MPS clients in
        the same container would be frozen with it (on an H100 a 30 % client fell to 6 %
        while the bypasser was held). Where the enforcer holds the GPU in EXCLUSIVE_PROCESS
        such a process cannot even create its context, so killing it here ends the same way.
        """
        share, pid = item.share, item.info.pid
        key = (pid, item.start)
        if key in self._killed:
            return True  # NVML still lists it for a moment
        if not self._kill(item, share, "not a client of its share's MPS server"):
            return False
        self._killed[key] = self._clock()
        usage.kills += 1
        self.metrics.kills.labels(*_labels(share, usage)).inc()
        if key not in runtime.bypassers:  # else counted when it was first seen
            self.metrics.bypasses.labels(*_labels(share, usage)).inc()
        self._violation(
            share,
            usage,
            pid,
            "cores",
            usage.sm_percent,
            share.cores_percent,
            "killed",
            f"pid {pid} of share {share.share_id} is not a client of the MPS server of "
            f"{usage.device_uuid} (a context of its own: the pipe directory "
            "CUDA_MPS_PIPE_DIRECTORY was not used), so MPS does not hold it; killed it",
            mechanism=Mechanism.WATCHDOG,
        )
        return True

    # -- memory ---------------------------------------------------------------------------
    def _check_memory(
        self,
        share: ShareRecord,
        gpu: int,
        usage: DeviceUsage,
        mine: list[_Owned],
        runtime: _Runtime,
        unenforced: str,
    ) -> None:
        if usage.memory_used <= share.memory_bytes or share.memory_mechanism is Mechanism.NONE:
            runtime.last_report.pop((gpu, "memory"), None)
            return
        enforce = share.memory_mechanism is Mechanism.WATCHDOG or bool(unenforced)
        if enforce and self.config.memory_action == "kill":
            victim = max(mine, key=lambda item: item.info.used_memory_bytes or 0)
            key = (victim.info.pid, victim.start)
            if key in self._killed:
                return  # already killed; NVML still lists it for a moment
            if self._kill(victim, share, "over its share's memory limit"):
                self._killed[key] = self._clock()
                usage.kills += 1
                self.metrics.kills.labels(*_labels(share, usage)).inc()
                self._violation(
                    share,
                    usage,
                    victim.info.pid,
                    "memory",
                    usage.memory_used,
                    share.memory_bytes,
                    "killed",
                    f"share {share.share_id} used {usage.memory_used} bytes on "
                    f"{usage.device_uuid}, over its limit of {share.memory_bytes}; killed pid "
                    f"{victim.info.pid}, its largest process "
                    f"({victim.info.used_memory_bytes} bytes)"
                    + (f"; unenforced: {unenforced}" if unenforced else ""),
                    mechanism=Mechanism.WATCHDOG,
                )
            return
        if self._due(runtime, gpu, "memory"):
            self._violation(
                share,
                usage,
                0,
                "memory",
                usage.memory_used,
                share.memory_bytes,
                "reported",
                f"share {share.share_id} uses {usage.memory_used} bytes on {usage.device_uuid}, "
                f"over its limit of {share.memory_bytes} (enforced by "
                f"{share.memory_mechanism.value}; the watchdog only reports)",
            )

    def _kill(self, victim: _Owned, share: ShareRecord, why: str) -> bool:
        """SIGKILL through a pidfd, after checking the pid is still that process of that share."""
        pid = victim.info.pid
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        try:
            if cg.start_time(pid) != victim.start:
                return False
            groups = self.cgroups.of_pid(pid)
            _, shares = self._shares()
            owner = match_share(groups, shares) if groups is not None else None
            if owner is None or owner.claim_uid != share.claim_uid:
                return False
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            log.warning(
                "killed a process",
                reason=why,
                pid=pid,
                claim_uid=share.claim_uid,
                share_id=share.share_id,
            )
            return True
        except OSError as exc:
            log.warning("could not kill a process", pid=pid, error=str(exc))
            return False
        finally:
            os.close(fd)

    # -- cores ----------------------------------------------------------------------------
    def _check_cores(
        self,
        share: ShareRecord,
        gpu: int,
        usage: DeviceUsage,
        runtime: _Runtime,
        used: float,
        others: float,
        dt: float,
        unenforced: str,
    ) -> bool:
        if share.cores_mechanism is Mechanism.NONE:
            return False
        bucket = runtime.buckets.get(gpu)
        if bucket is None:
            bucket = runtime.buckets[gpu] = Bucket(share.cores_percent, self.config.burst_s)
        if unenforced:
            bucket.credit = min(bucket.credit, 0.0)  # no burst for what escaped its mechanism
        if unenforced and runtime.new_bypasser:
            # A process that just escaped MPS is frozen now, not once the driver's first sample
            # of it arrives (one to two periods later): two periods' worth of debt.
            bucket.credit = -2.0 * share.cores_percent * self.config.sample_interval_s
        was = bucket.frozen
        over = bucket.step(used, dt, others_percent=others, work_conserving=share.work_conserving)
        throttle = self.config.sm_action == "throttle" and (
            share.cores_mechanism is Mechanism.WATCHDOG or bool(unenforced)
        )
        if over and (not was or self._due(runtime, gpu, "cores")):
            runtime.last_report[(gpu, "cores")] = self._clock()
            action = "throttled" if throttle else "reported"
            self._violation(
                share,
                usage,
                0,
                "cores",
                usage.sm_percent,
                share.cores_percent,
                action,
                f"share {share.share_id} used {max(used, usage.sm_percent):.0f}% SM on "
                f"{usage.device_uuid}, over its limit of {share.cores_percent}%; "
                + ("throttling by freezing its cgroups" if throttle else "reported only")
                + (f"; unenforced: {unenforced}" if unenforced else ""),
                mechanism=Mechanism.WATCHDOG if unenforced else None,
            )
        return over and throttle

    def _account_throttled(self, share: ShareRecord, runtime: _Runtime, dt: float) -> None:
        for usage in runtime.usage.values():
            usage.throttled_s += dt
            self.metrics.throttled.labels(*_labels(share, usage)).inc(dt)

    def _apply(self, runtime: _Runtime, *, frozen: bool) -> None:
        """Freeze or thaw every target of a share (each target is checked, so a cgroup left
        frozen by an earlier enforcer is thawed too)."""
        for target in list(runtime.targets):
            if cg.is_frozen(target) == frozen:
                continue
            try:
                cg.set_frozen(target, frozen)
            except GpusliceError as exc:
                log.warning("cannot change a cgroup's freezer", cgroup=str(target), error=str(exc))
                if not target.exists():
                    runtime.targets.discard(target)
        runtime.frozen = frozen

    # -- reporting ------------------------------------------------------------------------
    def _due(self, runtime: _Runtime, gpu: int, resource: str) -> bool:
        last = runtime.last_report.get((gpu, resource))
        now = self._clock()
        if last is None or now - last >= REPORT_EVERY_S:
            runtime.last_report[(gpu, resource)] = now
            return True
        return False

    def _violation(
        self,
        share: ShareRecord,
        usage: DeviceUsage,
        pid: int,
        resource: str,
        observed: float,
        limit: float,
        action: str,
        message: str,
        *,
        mechanism: Mechanism | None = None,
    ) -> None:
        usage.violations += 1
        if mechanism is None:
            mechanism = share.memory_mechanism if resource == "memory" else share.cores_mechanism
        self.metrics.violations.labels(*_labels(share, usage), resource, action).inc()
        log.info(
            "limit violation",
            claim_uid=share.claim_uid,
            share_id=share.share_id,
            device=usage.device_uuid,
            resource=resource,
            action=action,
            pid=pid or None,
            detail=message,
        )
        self.bus.publish(
            Violation(
                claim_uid=share.claim_uid,
                share_id=share.share_id,
                device_uuid=usage.device_uuid,
                pod=share.pods[0] if len(share.pods) == 1 else None,
                pid=pid,
                resource=resource,
                observed=float(observed),
                limit=float(limit),
                action=action,
                mechanism=mechanism,
                time=self._wall(),
                message=message,
            )
        )

    def _publish_usage(self, share: ShareRecord, usage: DeviceUsage) -> None:
        labels = _labels(share, usage)
        self.metrics.memory_used.labels(*labels).set(usage.memory_used)
        self.metrics.memory_limit.labels(*labels).set(usage.memory_limit)
        self.metrics.sm_used.labels(*labels).set(usage.sm_percent / 100)
        self.metrics.sm_limit.labels(*labels).set(usage.sm_limit / 100)

    # -- queries and share changes --------------------------------------------------------
    def usage(self, share: ShareRecord) -> list[DeviceUsage]:
        """The share's usage per device as of the last sample (zeros before the first)."""
        with self._lock:
            runtime = self._runtime.get(share.claim_uid)
            result = []
            for index, uuid in zip(share.gpu_indices, share.device_uuids, strict=False):
                found = runtime.usage.get(index) if runtime else None
                result.append(
                    DeviceUsage(**found.__dict__)
                    if found
                    else DeviceUsage(
                        device_uuid=uuid,
                        memory_limit=share.memory_bytes,
                        sm_limit=share.cores_percent,
                        memory_mechanism=share.memory_mechanism,
                        cores_mechanism=share.cores_mechanism,
                    )
                )
            return result

    def forget(self, claim_uid: str) -> None:
        """A share was released: thaw its cgroups and drop its state."""
        with self._lock:
            self._drop(claim_uid)

    def _drop(self, claim_uid: str) -> None:
        runtime = self._runtime.pop(claim_uid, None)
        if runtime is not None:
            self._apply(runtime, frozen=False)

    def thaw_share(self, share: ShareRecord) -> None:
        """Thaw a share's container cgroups now (start-up after a crash, release)."""
        with self._lock:
            runtime = self._runtime.setdefault(share.claim_uid, _Runtime())
            runtime.targets |= self._container_targets(share)
            with contextlib.suppress(GpusliceError):
                self._apply(runtime, frozen=False)


def _labels(share: ShareRecord, usage: DeviceUsage) -> tuple[str, str, str]:
    """``claim_uid``, ``gpu`` (the index, as dcgm-exporter writes it), ``UUID``."""
    index = dict(zip(share.device_uuids, share.gpu_indices, strict=False)).get(usage.device_uuid)
    return (share.claim_uid, "" if index is None else str(index), usage.device_uuid)


def match_share(groups: cg.ProcessCgroups, shares: list[ShareRecord]) -> ShareRecord | None:
    """The share a process belongs to, by its cgroups; None when unknown or ambiguous."""
    best: tuple[int, ShareRecord] | None = None
    for share in shares:
        for c in share.containers.values():
            pairs = ((groups.v2_path, c.v2_path), (groups.freezer_path, c.freezer_path))
            for mine, theirs in pairs:
                if mine and theirs and theirs != "/" and cg.within(mine, theirs):
                    depth = theirs.count("/")
                    if best is None or depth > best[0]:
                        best = (depth, share)
    if best is not None:
        return best[1]
    paths = groups.paths()
    candidates = [share for share in shares if any(names_pod(paths, p.uid) for p in share.pods)]
    return candidates[0] if len(candidates) == 1 else None
