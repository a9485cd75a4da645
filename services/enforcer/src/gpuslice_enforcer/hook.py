"""``gpuslice-enforcer-hook``: the CDI hook that hands a new container to the enforcer.

The container runtime runs it on the host as the ``createContainer`` hook of a share's
containers, with the OCI state on stdin (``{"id": …, "pid": …, …}``), after the container's
cgroups exist and before its process runs the workload:

    gpuslice-enforcer-hook attach --socket /var/run/gpuslice/enforcer.sock \\
        --claim-uid <uid> --share-id <id> --timeout 10

It reads ``/proc/<pid>/cgroup`` and asks the enforcer to attach the container (waiting up to
``--timeout`` seconds, for the whole call, if the enforcer is restarting or its backlog is
full); it exits 0 only once the enforcer says
every limit is in force. Any failure exits non-zero with the reason on stderr, which makes the
runtime fail the container instead of starting it unenforced. ``detach`` (the ``poststop`` hook)
forgets the container; its failures only matter for bookkeeping.

Every container start waits for this process, so it is written to start fast (docs/enforcer.md,
"The CDI hook"): at module level it imports only modules built into the interpreter, and it
talks to the enforcer's *attach socket* — ``<socket>.attach`` next to the gRPC socket (after
following the ``--socket`` link) — which carries the same ``AttachContainerRequest`` and
``DetachContainerRequest`` messages as ``gpuslice.v1.EnforcerContainers``, framed without HTTP/2:

    request:  b"GSH1" | method (1 attach, 2 detach) | u32 big-endian length | protobuf message
    reply:    status (0 = OK, else the gRPC status code) | u32 big-endian length | UTF-8 text

Importing grpc alone costs more than the whole fast path (≈ 70 ms against ≈ 8 ms). An enforcer
without an attach socket (one older than this hook) is called through gRPC, as before.

The hosts run the static hook instead (services/enforcer/hook, Go: no Python or libc needed on
the host), which takes the same command line and gives the same output and exit status; the
tests run both. This one stays the reference, and the hook of the sandbox's simulated node.
"""

# os.path, not pathlib: pathlib imports re, fnmatch and urllib, a third of the hook's start-up.
# ruff: noqa: PTH110, PTH115, PTH118, PTH120, PTH123
from __future__ import annotations

import _json
import _socket
import os
import sys
import time

from gpuslice_enforcer.attachwire import (
    ATTACH_SUFFIX,
    MAGIC,
    MAX_REPLY,
    MAX_TEXT,
    METHOD_ATTACH,
    METHOD_DETACH,
    STATUS_NAMES,
    STATUS_OK,
    bounded,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (7 ms); mypy knows the name
if TYPE_CHECKING:
    from gpuslice_protos.gpuslice.v1.enforcer_pb2 import AttachContainerResponse


EXIT_FAILED = 1
EXIT_USAGE = 2

USAGE = (
    "usage: gpuslice-enforcer-hook {attach,detach} --socket PATH --claim-uid UID "
    "[--share-id ID] [--timeout SECONDS]"
)
_OPTIONS = {"--socket": "socket", "--claim-uid": "claim_uid", "--share-id": "share_id"}


class UsageError(Exception):
    pass


class HookError(Exception):
    pass


class Args:
    """The hook's command line (hand-parsed: argparse imports ``re``, 5 ms of start-up)."""

    def __init__(self, argv: list[str]) -> None:
        self.action = ""
        self.socket = ""
        self.claim_uid = ""
        self.share_id = ""
        self.timeout = 10.0
        rest = list(argv)
        while rest:
            arg = rest.pop(0)
            if arg in ("-h", "--help"):
                raise UsageError("")
            if not arg.startswith("--"):
                if self.action:
                    raise UsageError(f"unexpected argument {arg!r}")
                if arg not in ("attach", "detach"):
                    raise UsageError(f"action {arg!r}: choose attach or detach")
                self.action = arg
                continue
            name, equals, value = arg.partition("=")
            if name not in _OPTIONS and name != "--timeout":
                raise UsageError(f"unknown option {name}")
            if not equals:
                if not rest:
                    raise UsageError(f"{name} needs a value")
                value = rest.pop(0)
            if name == "--timeout":
                try:
                    self.timeout = float(value)
                except ValueError:
                    raise UsageError(f"--timeout {value!r}: not a number of seconds") from None
                if not self.timeout > 0:
                    raise UsageError(f"--timeout {value!r}: must be more than 0")
            else:
                setattr(self, _OPTIONS[name], value)
        if not self.action:
            raise UsageError("the action (attach or detach) is required")
        for name, attribute in (("--socket", "socket"), ("--claim-uid", "claim_uid")):
            if not getattr(self, attribute):
                raise UsageError(f"{name} is required")


class _JsonContext:
    """What ``_json.make_scanner`` reads: the defaults of ``json.loads``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo: dict[str, str] = {}  # noqa: RUF012 (the scanner's cache; typing costs 7 ms to import)

    @staticmethod
    def parse_constant(name: str) -> float:
        return float(name)


def _load_json(text: str) -> object:
    # The C scanner behind json.loads, without the json package (whose ``re`` import is 5 ms).
    # On anything unusual, json.loads itself decides and words the error.
    try:
        value, end = _json.make_scanner(_JsonContext())(text, 0)  # type: ignore[arg-type]
        if text[end:].strip():
            raise ValueError
        return value
    except Exception:
        import json

        return json.loads(text)


def read_state(text: str) -> tuple[str, int]:
    """(container id, pid) from the OCI state JSON."""
    try:
        state = _load_json(text)
    except ValueError as exc:
        raise ValueError(f"the OCI state is not JSON: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError("the OCI state is not a JSON object")
    container_id, pid = state.get("id"), state.get("pid", 0)
    if not isinstance(container_id, str) or not container_id:
        raise ValueError("the OCI state has no container id")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise ValueError(f"the OCI state has a bad pid {pid!r}")
    return container_id, pid


# ---- protobuf, by hand (the fields of AttachContainerRequest and DetachContainerRequest) -------
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _string(number: int, text: str) -> bytes:
    data = text.encode()
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def attach_message(
    claim_uid: str, share_id: str, container_id: str, pid: int, cgroup_lines: list[str]
) -> bytes:
    """``AttachContainerRequest`` serialized as protobuf (proto3: default values omitted)."""
    out = b""
    for number, text in ((1, claim_uid), (2, share_id), (3, container_id)):
        if text:
            out += _string(number, text)
    if pid:
        out += _varint(4 << 3) + _varint(pid)
    return out + b"".join(_string(5, line) for line in cgroup_lines)


def detach_message(claim_uid: str, container_id: str) -> bytes:
    """``DetachContainerRequest`` serialized as protobuf."""
    return b"".join(_string(n, t) for n, t in ((1, claim_uid), (2, container_id)) if t)


def frame(method: int, message: bytes) -> bytes:
    return MAGIC + bytes([method]) + len(message).to_bytes(4, "big") + message


# ---- the attach socket ---------------------------------------------------------------------
def attach_socket_path(socket: str) -> str:
    """The attach socket that goes with the gRPC socket ``socket`` (a link is followed once:
    the chart's stable ``enforcer.sock`` points at the serving pod's ``enforcer-<uid>.sock``)."""
    try:
        target = os.readlink(socket)
    except OSError:
        return socket + ATTACH_SUFFIX
    if not target.startswith("/"):
        target = os.path.join(os.path.dirname(socket), target)
    return target + ATTACH_SUFFIX


def _remaining(sock: _socket.socket, deadline: float) -> None:
    """Let the next operation on ``sock`` wait only until ``deadline`` (socket timeouts are per
    operation; the hook's is per call)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def recv_exactly(sock: _socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes from ``sock`` by ``deadline``; EOFError if it closes, TimeoutError."""
    data = bytearray()
    while len(data) < size:
        _remaining(sock, deadline)
        chunk = sock.recv(min(size - len(data), 1 << 16))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def attached_line(container_id: str, reply: AttachContainerResponse) -> str:
    """What the hook prints for the runtime's log once a container is attached (either path)."""
    from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb

    limits = ", ".join(
        f"{pb.Resource.Name(lim.resource)}={pb.Mechanism.Name(lim.mechanism)}"
        for lim in reply.limits
    )
    return f"attached {container_id} ({limits}) cgroups {list(reply.cgroup_paths)}"


def call(socket: str, method: int, message: bytes, deadline: float) -> str:
    """One call on the attach socket by ``deadline``. Connecting is retried with a back-off
    while the enforcer is away (a restart: the socket is missing or refuses) or busy (its
    backlog is full: EAGAIN), like gRPC's ``wait_for_ready``."""
    delay, retried = 0.01, False
    while True:
        path = attach_socket_path(socket)
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            if retried:  # the last try comes even if the back-off overslept the deadline
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
            else:
                _remaining(sock, deadline)
            try:
                sock.connect(path)
            except (FileNotFoundError, ConnectionRefusedError, BlockingIOError) as exc:
                left = deadline - time.monotonic() - 0.005  # one last try at the deadline
                if left <= 0:
                    if isinstance(exc, BlockingIOError):
                        why = f"the enforcer on {path} stayed busy (its backlog full)"
                    else:
                        why = f"no enforcer listened on {path} ({exc.strerror})"
                    raise HookError(f"UNAVAILABLE: {why} until the timeout") from None
                time.sleep(min(delay, left))
                delay, retried = min(delay * 2, 0.25), True
                continue
            _remaining(sock, deadline)
            sock.sendall(frame(method, message))
            head = recv_exactly(sock, 5, deadline)
            status, size = head[0], int.from_bytes(head[1:], "big")
            if size > MAX_REPLY:
                raise HookError(f"the enforcer's reply is too long ({size} bytes)")
            text = bounded(
                recv_exactly(sock, size, deadline).decode(errors="replace"), 2 * MAX_TEXT
            )
        except EOFError:
            raise HookError("the enforcer closed the connection before it answered") from None
        except TimeoutError:
            raise HookError("DEADLINE_EXCEEDED: the enforcer did not answer in time") from None
        except OSError as exc:
            raise HookError(f"{path}: {exc.strerror or exc}") from None
        finally:
            sock.close()
        if status != STATUS_OK:
            name = STATUS_NAMES[status] if status < len(STATUS_NAMES) else f"STATUS_{status}"
            raise HookError(f"{name}: {text}")
        return text


def call_grpc(args: Args, container_id: str, pid: int, lines: list[str], deadline: float) -> str:
    """The same call through ``gpuslice.v1.EnforcerContainers`` (an enforcer that has no attach
    socket). Slow to start: it imports grpc."""
    if sys.flags.no_site:
        import site

        site.main()
    import grpc

    from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
    from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc

    timeout = max(deadline - time.monotonic(), 0.001)
    with grpc.insecure_channel(f"unix://{args.socket}") as channel:
        stub = pb_grpc.EnforcerContainersStub(channel)
        try:
            if args.action == "attach":
                reply = stub.AttachContainer(
                    pb.AttachContainerRequest(
                        claim_uid=args.claim_uid,
                        share_id=args.share_id,
                        container_id=container_id,
                        pid=pid,
                        cgroup_lines=lines,
                    ),
                    timeout=timeout,
                    wait_for_ready=True,
                )
                return attached_line(container_id, reply)
            stub.DetachContainer(
                pb.DetachContainerRequest(claim_uid=args.claim_uid, container_id=container_id),
                timeout=timeout,
                wait_for_ready=True,
            )
            return f"detached {container_id}"
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            raise HookError(f"{code}: {detail}") from None


def _fail(message: str, status: int) -> int:
    sys.stderr.write(f"gpuslice-enforcer-hook: {bounded(message, 4 * MAX_TEXT)}\n")
    return status


def main(argv: list[str] | None = None) -> int:
    try:
        args = Args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        if str(exc):
            return _fail(f"{exc}\n{USAGE}", EXIT_USAGE)
        sys.stdout.write(USAGE + "\n")
        return 0
    deadline = time.monotonic() + args.timeout
    try:
        container_id, pid = read_state(sys.stdin.read())
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    if args.action == "attach" and pid <= 0:
        return _fail("the OCI state has no pid to attach", EXIT_USAGE)
    lines: list[str] = []
    if pid > 0:
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            return _fail(f"/proc/{pid}/cgroup: {exc.strerror}", EXIT_FAILED)
    if args.action == "attach":
        method = METHOD_ATTACH
        message = attach_message(args.claim_uid, args.share_id, container_id, pid, lines)
    else:
        method, message = METHOD_DETACH, detach_message(args.claim_uid, container_id)
    try:
        if os.path.exists(args.socket) and not os.path.exists(attach_socket_path(args.socket)):
            text = call_grpc(args, container_id, pid, lines, deadline)
        else:
            text = call(args.socket, method, message, deadline)
    except HookError as exc:
        return _fail(
            f"{args.action} {container_id} of claim {args.claim_uid} failed: {exc}", EXIT_FAILED
        )
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
