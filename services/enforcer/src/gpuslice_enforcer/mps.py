"""MPS control daemons: one per GPU, started, supervised and stopped by the enforcer.

Layout on the host (``--mps-root``, default ``/var/run/gpuslice/mps``)::

    <root>/<gpu index>/                 the daemon's CUDA_MPS_PIPE_DIRECTORY
    <root>/<gpu index>/gpuslice/<share id>/control    (protocol 3) a claim's namespace socket
    <root>/log/<gpu index>/             CUDA_MPS_LOG_DIRECTORY
    <root>/<gpu index>.toml             the protocol 3 start-up configuration (-a)

Protocol 3 (driver 615+): the daemon starts with ``-f -p 3 -a <toml>`` declaring one server,
``gpuslice``, whose ``allowed_devices`` is the GPU; each share is a namespace of it, created with
``namespace create --server=gpuslice --name=<share id> --active-thread-percentage=<cores>
--pinned-memory-limit=<MiB>M`` and removed with ``namespace delete``. The claim's containers get
the namespace's directory as their pipe directory, so their clients connect to the namespace.

Legacy MPS (protocol 2): the daemon starts with ``-f`` (``-m`` for multi-user) and
``CUDA_VISIBLE_DEVICES=<GPU UUID>``; containers get the whole pipe directory and their limits in
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.

Daemons run in their own session, so they outlive an enforcer that dies or restarts (clients
keep working); a restarted enforcer adopts them by pid and start time. A daemon that dies is
started again and its namespaces re-created. The protocol-3 command words follow NVIDIA's
``<module> <verb> --option=value`` syntax; check them on the GPU stage (docs/enforcer.md).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import time
from pathlib import Path

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_core.files import make_dirs
from gpuslice_core.logging import get_logger
from gpuslice_enforcer.cgroups import start_time
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.state import DaemonRecord

log = get_logger(__name__)

SERVER = "gpuslice"
PID_FILE = "nvidia-cuda-mps-control.pid"
START_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 10.0
MIB = 1 << 20


class MpsManager:
    def __init__(self, config: EnforcerConfig) -> None:
        self.config = config
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # -- paths ----------------------------------------------------------------------------
    def pipe_dir(self, gpu_index: int) -> Path:
        return self.config.mps_root / str(gpu_index)

    def namespace_dir(self, record: DaemonRecord, share_id: str) -> Path:
        return Path(record.pipe_dir) / SERVER / share_id

    def _env(self, record: DaemonRecord) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **self.config.mps_env,
            "CUDA_MPS_PIPE_DIRECTORY": record.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": record.log_dir,
            "CUDA_VISIBLE_DEVICES": record.gpu_uuid,
        }

    # -- daemons --------------------------------------------------------------------------
    def alive(self, record: DaemonRecord) -> bool:
        child = self._children.get(record.pid)
        if child is not None and child.poll() is not None:
            del self._children[record.pid]
            return False
        return record.pid > 0 and start_time(record.pid) == record.start_time

    def start(self, gpu_index: int, gpu_uuid: str, protocol: int) -> DaemonRecord:
        """Start the GPU's control daemon and wait until it answers."""
        record = DaemonRecord(
            gpu_uuid=gpu_uuid,
            gpu_index=gpu_index,
            protocol=protocol,
            pipe_dir=str(self.pipe_dir(gpu_index)),
            log_dir=str(self.config.mps_root / "log" / str(gpu_index)),
        )
        pipe, logs = Path(record.pipe_dir), Path(record.log_dir)
        # Explicit modes whatever the umask: containers of any user reach the pipe directory
        # (the daemon sets its sockets' modes); the logs stay the node's.
        make_dirs(pipe, 0o755)
        make_dirs(logs, 0o700)
        (pipe / PID_FILE).unlink(missing_ok=True)
        args = [*self.config.mps_control, "-f"]
        if protocol == 3:
            toml = self.config.mps_root / f"{gpu_index}.toml"
            toml.write_text(
                'schema_version = "1.0"\n\n'
                f"[servers.{SERVER}]\n"
                f'allowed_devices = "{gpu_uuid}"\n'
                'active_thread_percentage = "100"\n'
            )
            args += ["-p", "3", "-a", str(toml)]
        elif self.config.mps_multiuser:
            args.append("-m")
        output = (logs / "daemon.out").open("ab")
        try:
            child = subprocess.Popen(
                args,
                env=self._env(record),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives the enforcer: clients keep their server
            )
        except OSError as exc:
            raise FailedPreconditionError(
                f"cannot start the MPS control daemon {shlex.join(args)}: {exc.strerror}"
            ) from exc
        finally:
            output.close()
        self._children[child.pid] = child
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if child.poll() is not None:
                self._children.pop(child.pid, None)
                tail = (logs / "daemon.out").read_text(errors="replace")[-800:].strip()
                raise FailedPreconditionError(
                    f"the MPS control daemon for GPU {gpu_uuid} exited with {child.returncode}: "
                    f"{tail}"
                )
            if (pipe / PID_FILE).exists() and (pipe / "control").exists():
                record.pid = child.pid
                record.start_time = start_time(child.pid)
                log.info("mps daemon started", gpu=gpu_uuid, protocol=protocol, pid=child.pid)
                return record
            time.sleep(0.01)
        child.kill()
        child.wait()
        self._children.pop(child.pid, None)
        raise FailedPreconditionError(
            f"the MPS control daemon for GPU {gpu_uuid} did not answer within {START_TIMEOUT_S}s"
        )

    def running_daemons(self) -> list[DaemonRecord]:
        """Live control daemons found in the GPUs' pipe directories under the MPS root,
        recorded or not (a protocol is not known from outside: they are stopped with ``quit``,
        then killed)."""
        found = []
        for pid_file in sorted(self.config.mps_root.glob(f"*/{PID_FILE}")):
            gpu = pid_file.parent.name
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            started = start_time(pid)
            if not gpu.isdigit() or started is None:
                continue
            found.append(
                DaemonRecord(
                    gpu_uuid="",
                    gpu_index=int(gpu),
                    protocol=2,
                    pipe_dir=str(pid_file.parent),
                    log_dir=str(self.config.mps_root / "log" / gpu),
                    pid=pid,
                    start_time=started,
                )
            )
        return found

    def stop(self, record: DaemonRecord) -> None:
        """Quit the daemon (and its servers); kill it if it does not go."""
        if not self.alive(record):
            return
        with contextlib.suppress(FailedPreconditionError):
            self.command(record, "quit" if record.protocol == 2 else "-q")
        deadline = time.monotonic() + 5
        while self.alive(record) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive(record):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, 9)
        child = self._children.pop(record.pid, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)
        log.info("mps daemon stopped", gpu=record.gpu_uuid, pid=record.pid)

    # -- control commands -----------------------------------------------------------------
    def command(self, record: DaemonRecord, *args: str) -> str:
        """Run the control command against the GPU's daemon; its output, or an error."""
        argv = [*self.config.mps_control, *args]
        stdin = None
        if record.protocol == 2 and args and not args[0].startswith("-"):
            argv, stdin = list(self.config.mps_control), " ".join(args) + "\n"
        try:
            out = subprocess.run(
                argv,
                env=self._env(record),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FailedPreconditionError(f"MPS control {shlex.join(args)}: {exc}") from exc
        if out.returncode != 0:
            raise FailedPreconditionError(
                f"MPS control {shlex.join(args)} failed on GPU {record.gpu_uuid}: "
                f"{(out.stderr or out.stdout).strip()}"
            )
        return out.stdout

    def create_namespace(
        self, record: DaemonRecord, share_id: str, cores_percent: int, memory_bytes: int
    ) -> Path:
        """Create the share's namespace (or set its limits if a crashed attempt left it)."""
        verb = "set" if share_id in self.namespaces(record) else "create"
        self.command(
            record,
            "namespace",
            verb,
            f"--server={SERVER}",
            f"--name={share_id}",
            f"--active-thread-percentage={cores_percent}",
            f"--pinned-memory-limit={max(1, memory_bytes // MIB)}M",
        )
        return self.namespace_dir(record, share_id)

    def delete_namespace(self, record: DaemonRecord, share_id: str) -> None:
        if share_id in self.namespaces(record):
            self.command(record, "namespace", "delete", f"--server={SERVER}", f"--name={share_id}")

    def namespaces(self, record: DaemonRecord) -> list[str]:
        return self.command(record, "namespace", "list", f"--server={SERVER}").split()
