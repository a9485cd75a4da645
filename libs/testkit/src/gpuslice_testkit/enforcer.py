"""Helpers for tests that run the enforcer for real: a process on a unix socket, real cgroups,
fake-GPU workloads, and CDI hooks run the way runc runs them — either hook: the static Go binary
the chart installs (``go_hook``, built by hack/hook-binary.sh) or the Python one
(``gpuslice_enforcer.hook``), chosen by ``HOOK_KINDS``.

Used by e2e/tests/enforcer/test_enforcer*.py and bench/bench_enforcer.py; they clean up after
themselves (cgroups removed, processes and MPS daemons stopped) even when a test fails.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc

from gpuslice_core.grpcserver import check_health
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc
from gpuslice_testkit.core import ServiceProcess
from gpuslice_testkit.nvml_mock import NvmlBackend, enforcer_flags, nvml_env, nvml_flags

FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")
BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[4]
#: The hooks a protocol test runs: the static binary the chart installs, and the Python hook.
HOOK_KINDS = ("go", "python")
#: The Python hook as the chart used to install it: no site.py, no runpy.
HOOK_MAIN = "import sys; from gpuslice_enforcer.hook import main; sys.exit(main())"


class GoMissingError(Exception):
    """No Go toolchain: the static hook cannot be built here (tests of it skip, saying so)."""


@functools.cache
def go_hook() -> Path:
    """The static hook of this tree (services/enforcer/hook), as hack/hook-binary.sh builds it:
    cached outside the work tree, rebuilt (after its gofmt, vet and Go tests) when its sources
    change. GoMissingError where there is no Go; RuntimeError when the build fails."""
    if shutil.which("go") is None:
        raise GoMissingError(
            "Go is not installed, so the static hook (services/enforcer/hook) cannot be built "
            "and is not tested; install Go 1.22 or newer"
        )
    built = subprocess.run(
        ["bash", str(REPO_ROOT / "hack" / "hook-binary.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if built.returncode != 0:
        raise RuntimeError(f"hack/hook-binary.sh failed:\n{built.stderr[-4000:]}")
    return Path(built.stdout.strip().splitlines()[-1])


def hook_missing(kind: str) -> str | None:
    """Why hook ``kind`` cannot be tested here (Go is missing), or None: the reason a test of
    it skips with. A failed build raises."""
    if kind == "go":
        try:
            go_hook()
        except GoMissingError as exc:
            return str(exc)
    return None


def hook_path(kind: str) -> Path:
    """The executable of hook ``kind`` for ``--hook-path``: the static binary, or the Python
    hook's console script in this environment."""
    if kind == "go":
        return go_hook()
    if kind == "python":
        return BIN / "gpuslice-enforcer-hook"
    raise ValueError(f"hook kind {kind!r}: choose one of {HOOK_KINDS}")


def run_hook_command(
    kind: str,
    args: Sequence[str],
    state: object,
    timeout: float = 30,
) -> subprocess.CompletedProcess[str]:
    """Run hook ``kind`` with ``args`` (without the program) and the OCI state ``state`` (an
    object, sent as JSON; a str, sent as it is) on stdin, from an empty environment as runc
    runs hooks, and return what it did. The Python hook runs as the chart installed it
    (``python -s -S -c``), with this tree's packages on PYTHONPATH."""
    if kind == "python":
        argv = [sys.executable, "-s", "-S", "-c", HOOK_MAIN, *args]
        env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())}
    else:
        argv, env = [str(hook_path(kind)), *args], {}
    return subprocess.run(
        argv,
        input=state if isinstance(state, str) else json.dumps(state),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def cgroup2_root() -> Path | None:
    """The cgroup v2 mount of this machine (unified or hybrid), or None."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"]:
            return Path(left.split()[4])
    return None


def short_tempdir(prefix: str = "gs-") -> Path:
    """A temporary directory with a short path (unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Cgroups:
    """``gpuslice-test-<random>`` cgroups, each removed (processes moved out, thawed) at close."""

    def __init__(self) -> None:
        self.made: list[Path] = []

    def make(self, root: Path) -> Path:
        path = root / f"gpuslice-test-{secrets.token_hex(4)}"
        path.mkdir()
        self.made.append(path)
        return path

    def container(self) -> list[Path]:
        """A container's cgroups: one in the v1 freezer hierarchy and one in cgroup v2."""
        dirs = []
        if (FREEZER_ROOT / "cgroup.procs").exists():
            dirs.append(self.make(FREEZER_ROOT))
        v2 = cgroup2_root()
        if v2 is not None:
            dirs.append(self.make(v2))
        return dirs

    def close(self) -> None:
        for path in reversed(self.made):
            remove_cgroup(path)
        self.made.clear()

    def __enter__(self) -> Cgroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_tree(path: Path) -> None:
    """Remove a test's working directory (sockets, state, logs)."""
    for child in sorted(path.rglob("*"), reverse=True):
        if child.is_dir() and not child.is_symlink():
            child.rmdir()
        else:
            child.unlink()
    path.rmdir()


def remove_cgroup(path: Path) -> None:
    if not path.exists():
        return
    with contextlib.suppress(OSError):
        if (path / "freezer.state").exists():
            (path / "freezer.state").write_text("THAWED")
        elif (path / "cgroup.freeze").exists():
            (path / "cgroup.freeze").write_text("0")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pids = (path / "cgroup.procs").read_text().split()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                (path.parent / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        path.rmdir()


class Workload:
    """``python -m gpuslice_nvml.fake.workload``: a fake CUDA program in the given cgroups."""

    def __init__(
        self,
        config: Path,
        *,
        device: str = "0",
        sm: int = 0,
        memory: int = 0,
        cgroup_dirs: Sequence[Path] = (),
        mps_pipe_dir: Path | None = None,
    ) -> None:
        """``mps_pipe_dir``: its CUDA_MPS_PIPE_DIRECTORY (unset when None, as a process that
        does not use the share's MPS server would have it)."""
        args = [sys.executable, "-m", "gpuslice_nvml.fake.workload", "--config", str(config)]
        args += ["--device", device, "--sm", str(sm), "--memory", str(memory)]
        for directory in cgroup_dirs:
            args += ["--cgroup", str(directory)]
        env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_PIPE_DIRECTORY"}
        if mps_pipe_dir is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(mps_pipe_dir)
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.stop()
            raise RuntimeError(f"the workload did not start: {line.strip()!r}")
        self.pid = self.proc.pid

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class EnforcerProcess(ServiceProcess):
    """``gpuslice-enforcer`` as a real process on a unix socket, on the fake NVML of ``config``
    (or, with ``backend="mock"``, on the real backend over the mock library, same node, with
    the fake's stand-in MPS control daemon: ``enforcer_flags``)."""

    def __init__(
        self,
        config: Path,
        workdir: Path,
        extra_args: Sequence[str] = (),
        *,
        hook: str = "python",
        backend: NvmlBackend = "fake",
    ) -> None:
        """``hook``: the hook kind (``HOOK_KINDS``) the share's container edits name."""
        self.config = config
        self.workdir = workdir
        self.extra_args = list(extra_args)
        self.hook = hook
        self.backend = backend
        added = nvml_env(backend, config)
        super().__init__(
            "gpuslice-enforcer",
            self.args(),
            log=workdir / "enforcer.log",
            ready=lambda: self.socket.exists() and check_health(self.socket, timeout=1),
            env={**os.environ, **added} if added else None,
        )

    @property
    def socket(self) -> Path:
        return self.workdir / "enforcer.sock"

    @property
    def mps_root(self) -> Path:
        return self.workdir / "mps"

    @property
    def state_dir(self) -> Path:
        return self.workdir / "state"

    def args(self) -> list[str]:
        return [
            str(BIN / "gpuslice-enforcer"),
            *nvml_flags(self.backend, self.config),
            f"--socket={self.socket}",
            f"--state-dir={self.state_dir}",
            f"--mps-root={self.mps_root}",
            f"--hook-path={hook_path(self.hook)}",
            "--metrics-addr=",
            "--health-addr=",
            "--log-level=debug",
            *enforcer_flags(self.backend, self.config),
            *self.extra_args,
        ]

    def stop_mps_daemons(self, timeout: float = 10.0) -> None:
        """Stop every MPS control daemon started under this enforcer's MPS root."""
        stop_mps_daemons(self.mps_root, timeout)

    @contextlib.contextmanager
    def channel(self) -> Iterator[grpc.Channel]:
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            yield channel

    def stub(self, channel: grpc.Channel) -> pb_grpc.EnforcerStub:
        return pb_grpc.EnforcerStub(channel)


def _exited(pid: int) -> bool:
    """Gone, or a zombie (exited; whoever started it reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def share_request(
    claim_uid: str,
    device_uuid: str,
    *,
    cores: int = 50,
    memory: int = 1 << 30,
    mode: pb.EnforcementMode.ValueType = pb.ENFORCEMENT_MODE_AUTO,
    strict: bool = False,
    work_conserving: bool = False,
    pod_uid: str = "",
) -> pb.CreateShareRequest:
    return pb.CreateShareRequest(
        claim_uid=claim_uid,
        claim_namespace="default",
        claim_name=f"claim-{claim_uid[:8]}",
        pods=[pb.PodReference(uid=pod_uid or f"pod-{claim_uid}", namespace="default", name="p")],
        device_uuids=[device_uuid],
        cores_percent=cores,
        memory_bytes=memory,
        mode=mode,
        strict=strict,
        work_conserving=work_conserving,
    )


def run_hook(hook: pb.Hook, container_id: str, pid: int, timeout: float | None = None) -> int:
    """Run one OCI hook as runc does: the OCI state on stdin, only the hook's own env."""
    state = {
        "ociVersion": "1.2.0",
        "id": container_id,
        "status": "created",
        "pid": pid,
        "bundle": "/",
        "annotations": {},
    }
    env = dict(e.partition("=")[::2] for e in hook.env)
    out = subprocess.run(
        list(hook.args) or [hook.path],
        executable=hook.path,
        input=json.dumps(state).encode(),
        env=env,
        capture_output=True,
        timeout=timeout or (hook.timeout_seconds if hook.HasField("timeout_seconds") else 30),
        check=False,
    )
    if out.returncode != 0:
        raise HookFailedError(out.returncode, out.stderr.decode(errors="replace"))
    return out.returncode


class HookFailedError(Exception):
    def __init__(self, code: int, stderr: str) -> None:
        super().__init__(f"hook exited with {code}: {stderr.strip()}")
        self.code = code
        self.stderr = stderr


def watch_violations(
    channel: grpc.Channel,
) -> tuple[queue.Queue[pb.Violation], Callable[[], object]]:
    """Collect ``WatchViolations`` in a thread; returns the queue and a function that stops."""
    got: queue.Queue[pb.Violation] = queue.Queue()
    call = pb_grpc.EnforcerStub(channel).WatchViolations(pb.WatchViolationsRequest())

    def pump() -> None:
        try:
            for violation in call:
                got.put(violation)
        except grpc.RpcError:
            pass

    threading.Thread(target=pump, daemon=True).start()
    return got, call.cancel


def stop_mps_daemons(mps_root: Path, timeout: float = 10.0) -> None:
    """Stop every MPS control daemon started under ``mps_root`` and wait until they are gone
    (a daemon on its way out still writes its log). The enforcer leaves them running on
    purpose (clients keep their server across its restarts); a test must not."""
    pids = []
    for pid_file in mps_root.glob("*/nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"mps_control" in cmdline or b"nvidia-cuda-mps-control" in cmdline:
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while not _exited(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
