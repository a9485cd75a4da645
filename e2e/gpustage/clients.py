"""Workload processes and the "containers" the stage puts them in.

A workload is ``python -m e2e.gpustage.workload <command> --wait …``: it reads one line from
stdin before it touches CUDA, so the stage can do what the runtime and the CDI hook would do for
a container first — move it into fresh cgroups, attach it to its share, give it the share's
environment — and then let it go. Each stdout line is one JSON object; the reader thread keeps
every line with the monotonic and wall-clock time it arrived, so reaction times are measured
from what the workload said (its progress and ready lines) to what happened to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc

WORKLOAD_MODULE = "e2e.gpustage.workload"
#: exit status of a workload whose CUDA context could not be created
EXIT_CONTEXT = 3


@dataclass(frozen=True)
class Line:
    at: float  # time.monotonic() when it was read
    wall: float  # time.time() when it was read
    data: dict[str, object]


@dataclass(frozen=True)
class Launcher:
    """How to start a workload on this stage's GPU and backend."""

    module: str
    backend: str  # "cuda" | "fake"
    device: int
    gpu_uuid: str
    fake_config: Path | None
    logs: Path
    #: pid of every workload started, to check at the end that none is left
    started: list[int] = field(default_factory=list)

    def argv(self, command: Sequence[str]) -> list[str]:
        argv = [sys.executable, "-m", self.module, *command]
        if self.backend == "fake":
            assert self.fake_config is not None
            argv += ["--device", str(self.device), "--backend", "fake"]
            argv += ["--fake-nvml-config", str(self.fake_config)]
        else:
            # The client sees only the stage's GPU, as device 0: the same numbering an MPS
            # daemon started with CUDA_VISIBLE_DEVICES=<uuid> gives its clients.
            argv += ["--device", "0", "--backend", "cuda"]
        return argv

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The stage's environment without any MPS setting of its own, plus ``extra``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        if self.backend == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = self.gpu_uuid
        env.update(extra or {})
        return env

    def start(
        self,
        name: str,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        wait: bool = True,
    ) -> WorkloadProcess:
        argv = self.argv([*command, *(["--wait"] if wait else [])])
        proc = WorkloadProcess(name, argv, self.env(env), self.logs / f"{name}.stderr")
        self.started.append(proc.pid)
        return proc


class WorkloadProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], stderr: Path) -> None:
        self.name = name
        self.argv = argv
        stderr.parent.mkdir(parents=True, exist_ok=True)
        self.stderr_path = stderr
        with stderr.open("wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                text=True,
                start_new_session=True,  # a signal to the stage's group never reaches it
            )
        self.pid = self.proc.pid
        self.lines: list[Line] = []
        self.eof_at: float | None = None
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                data = json.loads(raw)
            except ValueError:
                data = {"text": raw.rstrip("\n")}
            if not isinstance(data, dict):
                data = {"value": data}
            with self._changed:
                self.lines.append(Line(time.monotonic(), time.time(), data))
                self._changed.notify_all()
        with self._changed:
            self.eof_at = time.monotonic()
            self._changed.notify_all()

    def go(self) -> None:
        """The line ``--wait`` waits for."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()

    def wait_line(self, key: str, timeout: float) -> Line | None:
        """The first line with ``key``, or None when the stream ends or time runs out first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if key in line.data:
                        return line
                left = deadline - time.monotonic()
                if self.eof_at is not None or left <= 0:
                    return None
                self._changed.wait(min(left, 0.05))

    def ready(self, timeout: float) -> Line | None:
        return self.wait_line("ready", timeout)

    def finish(self, timeout: float) -> int | None:
        """Wait for the process to end; its exit status, or None if it is still running."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5)
        return code

    @property
    def result(self) -> dict[str, object] | None:
        """The last line, when the workload ended on its own (the contract's result line)."""
        if self.proc.returncode is None or self.proc.returncode < 0 or not self.lines:
            return None
        last = self.lines[-1].data
        return last if "ok" in last else None

    def stderr_tail(self, chars: int = 600) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""

    def describe_end(self) -> str:
        """How it ended, in words, for a row's detail."""
        code = self.proc.returncode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        result = self.result or {}
        error = result.get("error") or self.stderr_tail()
        return f"exit {code}" + (f": {error}" if error else "")

    def kill(self) -> None:
        """SIGKILL, without waiting: a process in a frozen cgroup dies only once thawed."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """Kill and reap it; one that does not die in time is left for the cleanup rows."""
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self._reader.join(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def move_into(pid: int, cgroup_dirs: Sequence[Path]) -> None:
    for directory in cgroup_dirs:
        (directory / "cgroup.procs").write_text(str(pid))


def attach(
    containers: pb_grpc.EnforcerContainersStub,
    share: pb.CreateShareResponse,
    claim_uid: str,
    container_id: str,
    pid: int,
) -> pb.AttachContainerResponse:
    """What the createContainer hook does: bind the container (its init pid's cgroups) to the
    share; returns once the limits are in force."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    reply: pb.AttachContainerResponse = containers.AttachContainer(
        pb.AttachContainerRequest(
            claim_uid=claim_uid,
            share_id=share.share_id,
            container_id=container_id,
            pid=pid,
            cgroup_lines=lines,
        ),
        timeout=30,
    )
    return reply


def share_env(edits: pb.ContainerEdits) -> dict[str, str]:
    """The edits' environment as a process on the host needs it: the stage has no container
    mount namespace, so CUDA_MPS_PIPE_DIRECTORY becomes the host path of the mount the edits put
    at the container path it names."""
    env = dict(entry.split("=", 1) for entry in edits.env)
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe is not None:
        mount = next((m for m in edits.mounts if m.container_path == pipe), None)
        if mount is None:
            raise RuntimeError(
                f"the share's edits set CUDA_MPS_PIPE_DIRECTORY={pipe} but mount nothing there"
            )
        env["CUDA_MPS_PIPE_DIRECTORY"] = mount.host_path
    return env


def thaw(cgroup_dirs: Sequence[Path]) -> None:
    for directory in cgroup_dirs:
        with contextlib.suppress(OSError):
            if (directory / "freezer.state").exists():
                (directory / "freezer.state").write_text("THAWED")
            elif (directory / "cgroup.freeze").exists():
                (directory / "cgroup.freeze").write_text("0")


def frozen(cgroup_dirs: Sequence[Path]) -> bool:
    """Whether the freezer holds any of these cgroups (v1 freezer.state, v2 cgroup.freeze)."""
    for directory in cgroup_dirs:
        with contextlib.suppress(OSError):
            if (directory / "freezer.state").exists():
                if (directory / "freezer.state").read_text().strip() != "THAWED":
                    return True
            elif (directory / "cgroup.freeze").read_text().strip() == "1":
                return True
    return False
