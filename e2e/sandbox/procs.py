"""Child processes of the sandbox: one process group each, logs on disk, bounded termination,
identity by (pid, start time) so a recycled pid is never signalled, and port checks."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """True when a server could bind and listen on host:port (SO_REUSEADDR, as servers set it,
    so TIME_WAIT leftovers of closed connections do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def proc_start_time(pid: int) -> int | None:
    """The process' start time in clock ticks since boot (/proc/<pid>/stat field 22), or None
    when no such process exists or it is gone for good (a zombie whose threads all exited).

    A multi-threaded process (every Go program) whose main thread has exited shows as a zombie
    while its other threads are still tearing down and still hold its sockets: that counts as
    alive, or a port would be reported free too early."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = stat[stat.rindex(")") + 2 :].split()
    state, start = rest[0], rest[19]
    if state in ("Z", "X"):
        try:
            threads = sum(1 for _ in Path(f"/proc/{pid}/task").iterdir())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            return None
        if threads <= 1:
            return None
    return int(start)


def listening_ports(pid: int) -> set[int]:
    """TCP ports the process listens on (its socket inodes matched against /proc/net/tcp*)."""
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except (FileNotFoundError, PermissionError):
        return set()
    for fd in fds:
        with contextlib.suppress(OSError):
            target = str(fd.readlink())
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


#: Put in front of a command by ``start(..., die_with_parent=True)``; see its docstring.
DEATHSIG = Path(__file__).with_name("deathsig.py")


def _program(argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> str:
    """``argv[0]`` as the wrapper will exec it; FileNotFoundError here, as Popen would raise,
    when there is no such program."""
    program = argv[0]
    if os.sep in program and not Path(program).is_absolute():
        program = str(cwd / program)
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
    return program


@dataclass
class Proc:
    """A started component. `popen` is set only in the process that started it."""

    name: str
    argv: list[str]
    log: Path
    pid: int
    start_time: int | None
    ports: list[int] = field(default_factory=list)
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            return False
        now = proc_start_time(self.pid)
        return now is not None and now == self.start_time

    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal the process group (pgid == pid: each component leads its own session), but
        only while the pid still belongs to the process we started."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"(no log at {self.log})"
        return "\n".join(text[-lines:])

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "argv": self.argv,
            "log": str(self.log),
            "pid": self.pid,
            "start_time": self.start_time,
            "ports": self.ports,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Proc:
        return cls(
            name=str(data["name"]),
            argv=[str(a) for a in data["argv"]],
            log=Path(data["log"]),
            pid=int(data["pid"]),
            start_time=None if data["start_time"] is None else int(data["start_time"]),
            ports=[int(p) for p in data["ports"]],
        )


def start(
    name: str,
    argv: Sequence[str],
    log: Path,
    env: Mapping[str, str],
    *,
    cwd: Path,
    die_with_parent: bool,
) -> Proc:
    """Start argv in its own session (process group) with stdout+stderr appended to `log`;
    with `die_with_parent` it is SIGKILLed when the thread that started it dies.

    Never with a ``preexec_fn``: that makes ``subprocess`` fork() this process, and in a
    process that runs gRPC (every test process: health probes, the node agents' servers) the
    child then restarts gRPC's poller, ``close_fds`` closes the poller's epoll descriptor, and
    the child aborts before exec ("epoll_wait error: Bad file descriptor", issue 27). Without
    one, ``subprocess`` uses vfork() and exec, which runs no fork handlers; the death signal is
    armed by a small wrapper after that exec (``deathsig.py``), which then execs `argv` in
    the same process, so `pid` is the command's."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if not die_with_parent:
        return _spawn(name, argv, list(argv), log, env, cwd, ())
    program = _program(argv, env, cwd)
    armed_r, armed_w = os.pipe()
    with os.fdopen(armed_r, "rb") as armed:
        try:
            wrapper = [sys.executable, "-I", "-S", str(DEATHSIG), str(os.getpid()), str(armed_w)]
            proc = _spawn(name, argv, [*wrapper, program, *argv[1:]], log, env, cwd, (armed_w,))
        finally:
            os.close(armed_w)
        armed.read()  # EOF: the wrapper armed the signal (or ended); this thread may end now
    return proc


def _spawn(
    name: str,
    argv: Sequence[str],
    command: list[str],
    log: Path,
    env: Mapping[str, str],
    cwd: Path,
    pass_fds: tuple[int, ...],
) -> Proc:
    with log.open("ab") as out:
        out.write(f"### {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        out.flush()
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
        )
    return Proc(name, list(argv), log, popen.pid, proc_start_time(popen.pid), popen=popen)


def _wait_dead(procs: Iterable[Proc], deadline: float) -> list[Proc]:
    pending = [p for p in procs if p.alive()]
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [p for p in pending if p.alive()]
    return pending


def stop(procs: Sequence[Proc], grace: float) -> list[str]:
    """SIGTERM the groups, wait up to `grace` seconds, SIGKILL what is left and wait up to
    5 s more. Returns the names of processes that still exist afterwards (normally none)."""
    for p in procs:
        p.signal_group(signal.SIGTERM)
    left = _wait_dead(procs, time.monotonic() + grace)
    for p in left:
        p.signal_group(signal.SIGKILL)
    left = _wait_dead(left, time.monotonic() + 5.0)
    for p in procs:
        if p.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=0.5)
    return [f"{p.name} (pid {p.pid})" for p in left]
