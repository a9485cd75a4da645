"""gpuslice shared library.

Importing it turns gRPC's fork support off unless the environment says otherwise: every service
imports this package before grpc. With fork support on, a process that forks while gRPC threads
run (``subprocess`` does, to run the MPS control command and others) logs "Other threads are
currently calling into gRPC, skipping fork() handlers", and the child, whose descriptors
``close_fds`` closes before ``exec``, can abort in gRPC's poller with ``epoll_wait error: Bad
file descriptor`` (grpc/grpc#43157); the device plugin and the controller died that way at
start-up (issue 27). gpuslice never forks to keep using gRPC in a child, so it needs no fork
support.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
