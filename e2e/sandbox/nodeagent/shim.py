"""The per-container shim (what containerd-shim + runc are to a real container).

Started by the runtime with the container's config as JSON on the command line. It is the
container's "init" process from creation on, so CDI hooks see its pid in the OCI state; it
starts the command only when the runtime writes ``start`` on its stdin (runc's create/start
split), sends the command's output to the log file, and writes the exit status atomically to
``exit_file`` so that whoever holds the container next — the same agent or a restarted one —
can report it. The command runs in a process group of its own (its "PID namespace"): the
runtime sends SIGTERM to the command alone, as a runtime signals a container's init process,
and SIGKILL to the whole group; when the command ends, whatever it left in its group is
killed, as the kernel does when a container's init exits. If the shim's parent dies it stops
the command (no orphans).

    python -m e2e.sandbox.nodeagent.shim '<json>'
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from e2e.sandbox.nodeagent import cgroups


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_exit(path: Path, status: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(status))
    tmp.replace(path)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _default_signals() -> None:
    """Ignored signals stay ignored across exec: give the command the defaults back."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    exit_file = Path(config["exit_file"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    groups = [Path(p) for p in config.get("cgroups") or []]
    if sys.stdin.readline().strip() != "start":
        cgroups.remove(groups)
        return 0  # the container was deleted before it started
    log = Path(config["log"]).open("ab", buffering=0)  # noqa: SIM115 - lives as long as the child
    started = _now()
    try:
        child = subprocess.Popen(
            config["argv"],
            env=config["env"],
            cwd=config["cwd"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_default_signals,
            start_new_session=True,
        )
    except OSError as exc:
        log.write(f"exec {config['argv'][0]}: {exc}\n".encode())
        cgroups.remove(groups)
        _write_exit(
            exit_file,
            {
                "exitCode": 128,
                "reason": "StartError",
                "message": str(exc),
                "startedAt": started,
                "finishedAt": _now(),
            },
        )
        return 0
    # atomically: the runtime takes the file's existence for "started" and reads it at once
    pid_file = Path(config["pid_file"])
    pid_tmp = pid_file.with_name(pid_file.name + ".tmp")
    pid_tmp.write_text(str(child.pid))
    pid_tmp.replace(pid_file)
    while True:
        code = child.poll()
        if code is not None:
            break
        if os.getppid() != parent:  # the agent's process is gone: take the command down
            _killpg(child.pid, signal.SIGTERM)
            time.sleep(2)
            _killpg(child.pid, signal.SIGKILL)
        time.sleep(0.05)
    _killpg(child.pid, signal.SIGKILL)  # the rest of the container's processes
    cgroups.remove(groups)  # and whatever left the group but not the cgroups
    exit_code = code if code >= 0 else 128 - code
    _write_exit(
        exit_file,
        {
            "exitCode": exit_code,
            "signal": -code if code < 0 else 0,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": started,
            "finishedAt": _now(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
