"""The enforcer as the stage runs it: a real ``gpuslice-enforcer`` process on a unix socket in
a temporary directory (``gpuslice_testkit.enforcer.EnforcerProcess``), no CDI hook in the edits
(the stage attaches containers itself), and every share it creates released at the end.

Violations are collected from ``WatchViolations`` from the start, each with the monotonic time it
arrived, so a measurement can ask "did the enforcer act on this share, and when". Also here: the
GetCapabilities answer as the report's JSON and rows, and whether the enforcer knows a flag.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from e2e.gpustage.report import Row
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc
from gpuslice_testkit.enforcer import BIN, EnforcerProcess, share_request

#: the watchdog's sampling period the stage runs the enforcer with (its default)
SAMPLE_INTERVAL_S = 0.1

MECHANISM_NAMES = {
    pb.MECHANISM_MEMORY_PARTITION: "memory-partition",
    pb.MECHANISM_MPS_PROTOCOL3: "mps-protocol3",
    pb.MECHANISM_MPS_LEGACY: "mps-legacy",
    pb.MECHANISM_WATCHDOG: "watchdog",
    pb.MECHANISM_NONE: "none",
}


def mechanism_name(mechanism: pb.Mechanism.ValueType) -> str:
    return MECHANISM_NAMES.get(mechanism, pb.Mechanism.Name(mechanism))


@dataclass(frozen=True)
class Seen:
    at: float  # time.monotonic() when the stream delivered it
    violation: pb.Violation


class Violations:
    """``WatchViolations`` collected by a thread."""

    def __init__(self, stub: pb_grpc.EnforcerStub) -> None:
        self.seen: list[Seen] = []
        self._changed = threading.Condition()
        self._call = stub.WatchViolations(pb.WatchViolationsRequest())
        self._thread = threading.Thread(target=self._pump, name="violations", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for violation in self._call:
                with self._changed:
                    self.seen.append(Seen(time.monotonic(), violation))
                    self._changed.notify_all()

    def first(self, match: Callable[[pb.Violation], bool], since: float = 0.0) -> Seen | None:
        with self._changed:
            return next((s for s in self.seen if s.at >= since and match(s.violation)), None)

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(5)


class StageEnforcer:
    """One enforcer for the whole stage; ``close`` releases every share and stops it."""

    def __init__(
        self, backend: str, fake_config: Path | None, workdir: Path, extra: Sequence[str] = ()
    ) -> None:
        args = [
            f"--nvml={backend}",
            "--hook-path=",  # no hooks in the edits: the stage attaches containers itself
            f"--sample-interval={SAMPLE_INTERVAL_S}",
            "--stop-mps-on-exit",
            *extra,
        ]
        # --fake-nvml-config is ignored with --nvml=real; the class wants a path regardless.
        config = fake_config or workdir / "no-fake-config.yaml"
        self.proc = EnforcerProcess(config, workdir, args)
        self.claims: list[str] = []
        self._channel: grpc.Channel | None = None
        self._violations: Violations | None = None
        self.proc.start()
        try:
            self._channel = grpc.insecure_channel(f"unix://{self.proc.socket}")
            self.stub = pb_grpc.EnforcerStub(self._channel)
            self.containers = pb_grpc.EnforcerContainersStub(self._channel)
            self._violations = Violations(self.stub)
        except BaseException:
            self.close()
            raise

    @property
    def violations(self) -> Violations:
        assert self._violations is not None
        return self._violations

    @property
    def mps_root(self) -> Path:
        return self.proc.mps_root

    def capabilities(self, gpu_uuid: str) -> pb.GpuCapabilities | None:
        reply = self.stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=30)
        return next((g for g in reply.gpus if g.uuid == gpu_uuid), None)

    def create(
        self,
        claim_uid: str,
        gpu_uuid: str,
        *,
        cores: int,
        memory: int,
        mode: pb.EnforcementMode.ValueType,
    ) -> tuple[pb.CreateShareResponse, float]:
        """A share and how long CreateShare took, in seconds."""
        request = share_request(claim_uid, gpu_uuid, cores=cores, memory=memory, mode=mode)
        self.claims.append(claim_uid)
        start = time.perf_counter()
        reply: pb.CreateShareResponse = self.stub.CreateShare(request, timeout=60)
        return reply, time.perf_counter() - start

    def release(self, claim_uid: str) -> None:
        self.stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid=claim_uid), timeout=60)
        with contextlib.suppress(ValueError):
            self.claims.remove(claim_uid)

    def log_tail(self, chars: int = 2000) -> str:
        return self.proc.tail(chars)

    def close(self) -> None:
        """Release every share (the last MPS share stops its daemon), stop the enforcer
        (SIGTERM; with --stop-mps-on-exit it stops daemons too), and stop any daemon still
        running under its MPS root."""
        if self._channel is not None:
            for claim in list(self.claims):
                with contextlib.suppress(grpc.RpcError):
                    self.release(claim)
            if self._violations is not None:
                self._violations.close()
            self._channel.close()
        self.proc.stop()
        self.proc.stop_mps_daemons()


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def limit_mechanisms(reply: pb.CreateShareResponse) -> dict[str, str]:
    """{"memory": …, "cores": …} → mechanism names, from a CreateShare answer."""
    names = {pb.RESOURCE_MEMORY: "memory", pb.RESOURCE_CORES: "cores"}
    return {names[lim.resource]: mechanism_name(lim.mechanism) for lim in reply.limits}


def limit_reasons(reply: pb.CreateShareResponse) -> dict[str, str]:
    names = {pb.RESOURCE_MEMORY: "memory", pb.RESOURCE_CORES: "cores"}
    return {names[lim.resource]: lim.reason for lim in reply.limits}


def enforcer_has_flag(flag: str) -> bool:
    """Whether this checkout's enforcer knows ``flag`` (an enforcer without --compute-mode never
    changes the compute mode, so --keep-gpu-settings has nothing to pass to it)."""
    out = subprocess.run(
        [str(BIN / "gpuslice-enforcer"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return flag in out.stdout


def capabilities_json(caps: pb.GpuCapabilities) -> dict[str, object]:
    def cap(c: pb.Capability) -> dict[str, object]:
        return {"available": c.available, "reason": c.reason}

    return {
        "uuid": caps.uuid,
        "driver_version": caps.driver_version,
        "level": pb.EnforcementLevel.Name(caps.level),
        "memory_mechanism": mechanism_name(caps.memory_mechanism),
        "cores_mechanism": mechanism_name(caps.cores_mechanism),
        "memory_partitioning": cap(caps.memory_partitioning),
        "mps_protocol3": cap(caps.mps_protocol3),
        "mps_legacy": cap(caps.mps_legacy),
        "mig": cap(caps.mig),
    }


def unavailable_rows(caps: pb.GpuCapabilities) -> list[Row]:
    """A skipped row for each hard mechanism this GPU does not offer (or the enforcer does not
    use), with the enforcer's reason."""
    rows = []
    for name, cap in (
        ("memory-partition", caps.memory_partitioning),
        ("mps-protocol3", caps.mps_protocol3),
        ("mps-legacy", caps.mps_legacy),
    ):
        if not cap.available:
            rows.append(Row("mechanisms", name, "offered", "no", "-", "skipped", cap.reason))
        elif name == "mps-legacy" and caps.mps_protocol3.available:
            reason = "offered, but MPS protocol 3 is used where both are"
            rows.append(Row("mechanisms", name, "offered", "yes", "-", "skipped", reason))
    return rows
