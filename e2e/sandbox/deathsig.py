"""Exec a command that dies with the thread that started it (Linux ``PR_SET_PDEATHSIG``).

    python -I -S deathsig.py PARENT_PID ARMED_FD COMMAND [ARG...]

:func:`e2e.sandbox.procs.start` puts this in front of a command instead of a ``preexec_fn``: a
``preexec_fn`` makes ``subprocess`` fork() the whole launcher, and a launcher that runs gRPC
(every test process does) then gets gRPC's poller restarted in the child, where ``close_fds``
closes its epoll descriptor before exec: the child aborts with "epoll_wait error: Bad file
descriptor" instead of becoming the service (issue 27, docs/sandbox.md "Starting processes").
Without a ``preexec_fn``, ``subprocess`` starts this script with vfork() and exec, which runs no
fork handlers and copies no threads; the signal is set here, in the started process, and it
survives the exec below (the kernel clears it only for set-user-ID programs). Closing
``ARMED_FD`` tells the launcher that the signal is armed: until then the thread that started
this process must not end, or its end would go unnoticed.

Standard library only, run with ``-I -S``: nothing of the launcher's environment or packages.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
#: Exit status when the command cannot be started (as a shell reports "command not found").
EXIT_CANNOT_EXEC = 127


def main(argv: list[str]) -> int:
    if len(argv) < 4 or not argv[1].isdigit() or not argv[2].isdigit():
        print("usage: deathsig.py PARENT_PID ARMED_FD COMMAND [ARG...]", file=sys.stderr)
        return 2
    parent, armed, command = int(argv[1]), int(argv[2]), argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        print(f"deathsig: prctl(PR_SET_PDEATHSIG): {os.strerror(error)}", file=sys.stderr)
        return EXIT_CANNOT_EXEC
    if os.getppid() != parent:  # the launcher died before the signal was armed
        return 1
    os.close(armed)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"deathsig: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
    return EXIT_CANNOT_EXEC


if __name__ == "__main__":
    sys.exit(main(sys.argv))
