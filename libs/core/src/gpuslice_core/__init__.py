"""gpuslice shared library.

Importing it turns gRPC's fork support off unless the environment says otherwise. gRPC reads
``GRPC_ENABLE_FORK_SUPPORT`` once, when ``grpc`` is imported, so this works only in a process
that imports gpuslice_core first: every service's entry point does
(libs/core/tests/test_fork_support.py checks each), a test process that imports grpc first does
not.

Fork support exists for children that go on using gRPC after fork() without exec; no gpuslice
process has such children. What it does to a child that execs is harm: its fork handlers
restart gRPC's poller in the child, ``close_fds`` closes the poller's epoll descriptor, and
the child can abort before exec with "epoll_wait error: Bad file descriptor" (grpc/grpc#43055).
That killed the e2e suite's launcher children in issue 27 (seen as the device plugin or the
controller aborting at start-up); the cause, a ``preexec_fn`` that made the launcher fork(), is
gone (e2e/sandbox/procs.py). The services start their own children (the MPS control daemon)
with vfork(), which runs no fork handlers; this default keeps a fork() that someone adds later
(``preexec_fn``, ``user=``/``group=``, ``os.fork``) from exposing them again.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
