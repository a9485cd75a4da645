"""A tiny container runtime: containers are local processes, CDI edits become env and hooks.

What a runtime does with a container config, minus the isolation: the CDI edits the kubelet
resolved (``gpuslice_core.cdi``) are applied — env entries appended (a later entry with the
same name wins, as the OCI spec generator does), OCI hooks run like runc runs them, mounts and
device nodes recorded in ``edits.json`` beside the log (there is no mount namespace to apply
them in), the CDI device ids they came from in ``cdi-devices.json``. Each container runs under
a shim (``shim.py``) that owns the process group, writes the exit status to a file and survives
an agent restart, so a new agent adopts it.

Hooks (OCI runtime spec): ``prestart``, ``createRuntime``, ``createContainer`` run after the
container is created, ``startContainer`` before the command starts — a failure of any of them
fails the container; ``poststart`` and ``poststop`` failures are logged only. Each hook gets
the OCI state on stdin (ociVersion, id, status, pid, bundle, annotations), only its own env,
and is killed after its ``timeout``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from e2e.sandbox import procs
from e2e.sandbox.nodeagent import cgroups
from e2e.sandbox.nodeagent.kubeapi import now_rfc3339
from gpuslice_core.cdi import ContainerEdits, Hook
from gpuslice_core.logging import get_logger

log = get_logger(__name__)

OCI_VERSION = "1.2.0"
CREATE_HOOKS = ("prestart", "createRuntime", "createContainer")
REPO_ROOT = Path(__file__).resolve().parents[3]


class CreateContainerError(Exception):
    """The runtime could not create the container (CDI, hooks): reason CreateContainerError."""


@dataclass(frozen=True)
class ExitStatus:
    exit_code: int
    reason: str
    started_at: str
    finished_at: str
    message: str = ""
    signal: int = 0


@dataclass
class ContainerConfig:
    pod_uid: str
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    annotations: dict[str, str] = field(default_factory=dict)
    edits: ContainerEdits = field(default_factory=ContainerEdits)
    cdi_devices: list[str] = field(default_factory=list)  # the ids the edits were resolved from


def apply_env(base: dict[str, str], entries: list[str]) -> dict[str, str]:
    env = dict(base)
    for entry in entries:
        key, _, value = entry.partition("=")
        env[key] = value
    return env


def run_hooks(stage: str, hooks: list[Hook], state: dict[str, object]) -> None:
    """Run the hooks of one stage in order; raise CreateContainerError on the first failure."""
    for hook in (h for h in hooks if h.hook_name == stage):
        args = hook.args or [hook.path]
        env = dict(e.partition("=")[::2] for e in hook.env)
        try:
            out = subprocess.run(
                args,
                executable=hook.path,
                input=json.dumps(state).encode(),
                env=env,
                capture_output=True,
                timeout=hook.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise CreateContainerError(
                f"{stage} hook {hook.path} did not finish within {hook.timeout}s"
            ) from exc
        except OSError as exc:
            raise CreateContainerError(f"{stage} hook {hook.path}: {exc}") from exc
        if out.returncode != 0:
            raise CreateContainerError(
                f"{stage} hook {hook.path} exited with {out.returncode}: "
                f"{out.stderr.decode(errors='replace').strip()[-500:]}"
            )


class Container:
    """One container instance (one restart = a new instance)."""

    def __init__(
        self, directory: Path, state: dict[str, object], proc: subprocess.Popen[bytes] | None
    ):
        self.dir = directory
        self.state = state
        self._proc = proc
        self._exit: ExitStatus | None = None

    @property
    def id(self) -> str:
        return str(self.state["id"])

    @property
    def started_at(self) -> str:
        return str(self.state.get("startedAt") or "")

    @property
    def shim_pid(self) -> int:
        return int(str(self.state["shimPid"]))

    @property
    def cgroups(self) -> list[Path]:
        """The container's own cgroup directories (none without root or cgroup mounts)."""
        paths = self.state.get("cgroups")
        return [Path(str(p)) for p in paths] if isinstance(paths, list) else []

    def remove_cgroups(self) -> None:
        """Remove the container's cgroups once its shim is gone (the shim removes them itself
        when it ends normally; this covers a shim that was killed)."""
        if any(p.exists() for p in self.cgroups) and not self._shim_alive():
            left = cgroups.remove(self.cgroups)
            if left:
                log.warning("container cgroups not removed", cgroups=[str(p) for p in left])

    def _shim_alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return procs.proc_start_time(self.shim_pid) == self.state.get("shimStart")

    def poll(self) -> ExitStatus | None:
        """The exit status once the command has ended, else None."""
        if self._exit is not None:
            return self._exit
        exit_file = self.dir / "exit.json"
        if exit_file.exists():
            data = json.loads(exit_file.read_text())
            self._exit = ExitStatus(
                exit_code=int(data["exitCode"]),
                reason=str(data.get("reason") or "Error"),
                started_at=str(data.get("startedAt") or self.started_at),
                finished_at=str(data["finishedAt"]),
                message=str(data.get("message") or ""),
                signal=int(data.get("signal") or 0),
            )
        elif not self._shim_alive():
            self._exit = ExitStatus(137, "Error", self.started_at, now_rfc3339(), signal=9)
        if self._exit is not None:
            self.remove_cgroups()
        return self._exit

    def _command_pid(self) -> int | None:
        """The command's pid (= its process group), while the shim has not reaped it."""
        if self.poll() is not None:
            return None
        try:
            return int((self.dir / "pid").read_text())
        except (OSError, ValueError):
            return None

    def signal(self, sig: int) -> None:
        """Signal the command alone, as a runtime signals a container's init process."""
        pid = self._command_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill_all(self) -> None:
        """SIGKILL every process of the container (its process group), then the shim."""
        pid = self._command_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 2
        while self._shim_alive() and self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.poll() is None and self._shim_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.shim_pid, signal.SIGKILL)
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=2)
            self.remove_cgroups()

    def stop(self, grace: float) -> ExitStatus:
        """SIGTERM to the command, SIGKILL to all its processes after ``grace`` seconds."""
        if self.poll() is None:
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + max(grace, 0.0)
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.poll() is None:
                self.kill_all()
                deadline = time.monotonic() + 5
                while self.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        status = self.poll()
        assert status is not None
        return status


class Runtime:
    """Creates, starts and adopts containers of one node under ``<pods_dir>/<pod uid>/``."""

    def __init__(self, pods_dir: Path, node: str) -> None:
        self.pods_dir = pods_dir
        self.node = node

    def log_path(self, pod_uid: str, container: str, previous: bool = False) -> Path:
        suffix = ".previous.log" if previous else ".log"
        return self.pods_dir / pod_uid / f"{container}{suffix}"

    def _container_dir(self, pod_uid: str, container: str) -> Path:
        return self.pods_dir / pod_uid / ".containers" / container

    def run(self, cfg: ContainerConfig) -> Container:
        """Create the container (hooks up to createContainer), then start it."""
        cdir = self._container_dir(cfg.pod_uid, cfg.name)
        cdir.mkdir(parents=True, exist_ok=True)
        for stale in ("exit.json", "pid"):
            (cdir / stale).unlink(missing_ok=True)
        log_file = self.log_path(cfg.pod_uid, cfg.name)
        if log_file.exists() and log_file.stat().st_size:
            log_file.replace(self.log_path(cfg.pod_uid, cfg.name, previous=True))
        log_file.touch()
        env = apply_env(cfg.env, cfg.edits.env)
        (cdir / "edits.json").write_text(
            cfg.edits.model_dump_json(by_alias=True, exclude_defaults=True, indent=1)
        )
        (cdir / "cdi-devices.json").write_text(json.dumps(cfg.cdi_devices))
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        groups, skipped = cgroups.create(cfg.pod_uid, cid)
        if skipped:
            log.warning("container cgroups not made", container=cfg.name, skipped=skipped)
        shim_cfg = {
            "argv": cfg.argv,
            "env": env,
            "cwd": cfg.cwd,
            "log": str(log_file),
            "exit_file": str(cdir / "exit.json"),
            "pid_file": str(cdir / "pid"),
            "cgroups": [str(g) for g in groups],
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "e2e.sandbox.nodeagent.shim", json.dumps(shim_cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=(cdir / "shim.log").open("ab"),
                cwd=REPO_ROOT,
                start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO_ROOT)},
            )
        except OSError as exc:
            cgroups.remove(groups)
            raise CreateContainerError(f"cannot start the container shim: {exc}") from exc
        state: dict[str, object] = {
            "id": cid,
            "shimPid": proc.pid,
            "shimStart": procs.proc_start_time(proc.pid),
            "name": cfg.name,
            "cgroups": [str(g) for g in groups],
        }
        try:  # the shim is the container's init: in its cgroups before any hook sees its pid
            cgroups.enter(groups, proc.pid)
        except OSError as exc:
            self._discard(proc, groups)
            raise CreateContainerError(
                f"cannot put the container into its cgroups {[str(g) for g in groups]}: {exc}"
            ) from exc
        container = Container(cdir, state, proc)
        oci_state: dict[str, object] = {
            "ociVersion": OCI_VERSION,
            "id": cid,
            "status": "created",
            "pid": proc.pid,
            "bundle": str(cdir),
            "annotations": cfg.annotations,
        }
        try:
            for stage in CREATE_HOOKS:
                run_hooks(stage, cfg.edits.hooks, oci_state)
            run_hooks("startContainer", cfg.edits.hooks, oci_state)
        except CreateContainerError:
            self._discard(proc, groups)
            raise
        state["startedAt"] = now_rfc3339()
        assert proc.stdin is not None
        proc.stdin.write(b"start\n")
        proc.stdin.close()
        deadline = time.monotonic() + 10  # like `runc start`: back once the command runs
        while not (cdir / "pid").exists() and container.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        (cdir / "state.json").write_text(json.dumps(state))
        try:
            run_hooks("poststart", cfg.edits.hooks, {**oci_state, "status": "running"})
        except CreateContainerError as exc:
            log.warning("poststart hook failed", container=cfg.name, error=str(exc))
        return container

    @staticmethod
    def _discard(proc: subprocess.Popen[bytes], groups: list[Path]) -> None:
        if proc.stdin is not None:
            proc.stdin.close()  # EOF before "start": the shim exits without running anything
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        cgroups.remove(groups)

    def adopt(self, pod_uid: str, container: str) -> Container | None:
        """The container a previous agent left running (or exited meanwhile), if any."""
        cdir = self._container_dir(pod_uid, container)
        try:
            state = json.loads((cdir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        return Container(cdir, state, None)

    def poststop(self, cfg_hooks: list[Hook], container: Container) -> None:
        state: dict[str, object] = {
            "ociVersion": OCI_VERSION,
            "id": container.id,
            "status": "stopped",
            "pid": 0,
            "bundle": str(container.dir),
            "annotations": {},
        }
        try:
            run_hooks("poststop", cfg_hooks, state)
        except CreateContainerError as exc:
            log.warning("poststop hook failed", container=container.id, error=str(exc))


def exit_status_dict(status: ExitStatus) -> dict[str, object]:
    return asdict(status)
