"""The CDI hook's fast path: its hand-written protobuf, its command line, and the attach socket
(a real unix socket served by ``AttachSocketServer``) with a stand-in servicer. The tests of the
hook against the socket run each hook (``hook_kind``: the static Go binary and the Python hook)
as runc runs it, and expect the same output from both."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_core.errors import NotFoundError
from gpuslice_enforcer import attachwire as wire
from gpuslice_enforcer import hook
from gpuslice_enforcer.server import AttachSocketServer, attach_socket_for
from gpuslice_enforcer.servicer import ContainersServicer
from gpuslice_enforcer.throttledlog import Throttled
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.enforcer import run_hook_command

CGROUP_LINES = [
    "12:freezer:/kubepods/besteffort/pod0b7e/cri-containerd-" + "a" * 64,
    "0::/kubepods.slice/kubepods-pod0b7e_1.slice/cri-containerd-" + "b" * 64 + ".scope",
    "",
]


@pytest.mark.parametrize(
    ("claim_uid", "share_id", "container_id", "pid", "lines"),
    [
        ("c1", "sh-1", "ctr", 42, CGROUP_LINES),
        ("c1", "", "ctr", 4_194_304, []),  # no share id; a pid past two varint bytes
        ("ü-claim", "sh", "ctr-é", 1, ["x" * 300]),  # non-ASCII; a length past one byte
    ],
)
def test_the_hand_written_attach_request_is_the_protobuf_message(
    claim_uid: str, share_id: str, container_id: str, pid: int, lines: list[str]
) -> None:
    expected = pb.AttachContainerRequest(
        claim_uid=claim_uid,
        share_id=share_id,
        container_id=container_id,
        pid=pid,
        cgroup_lines=lines,
    )
    data = hook.attach_message(claim_uid, share_id, container_id, pid, lines)
    assert data == expected.SerializeToString(deterministic=True)
    assert pb.AttachContainerRequest.FromString(data) == expected


def test_the_hand_written_detach_request_is_the_protobuf_message() -> None:
    expected = pb.DetachContainerRequest(claim_uid="c1", container_id="ctr")
    assert hook.detach_message("c1", "ctr") == expected.SerializeToString()


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["attach", "--claim-uid", "u"], "--socket is required"),
        (["attach", "--socket", "/s"], "--claim-uid is required"),
        (["--socket", "/s", "--claim-uid", "u"], "the action"),
        (["start", "--socket", "/s"], "'start': choose attach or detach"),
        (["attach", "--socket", "/s", "--claim-uid", "u", "--pid", "3"], "unknown option --pid"),
        (["attach", "--socket=/s", "--claim-uid=u", "--timeout=soon"], "not a number"),
        (["attach", "--socket", "/s", "--claim-uid", "u", "--timeout", "0"], "more than 0"),
        (["attach", "--socket"], "--socket needs a value"),
    ],
)
def test_a_bad_command_line_is_named(argv: list[str], error: str) -> None:
    with pytest.raises(hook.UsageError, match=error):
        hook.Args(argv)


def test_the_command_line_in_both_spellings() -> None:
    args = hook.Args(["detach", "--socket=/s", "--claim-uid", "u", "--share-id=x", "--timeout=2"])
    assert (args.action, args.socket, args.claim_uid, args.share_id) == ("detach", "/s", "u", "x")
    assert args.timeout == 2.0


@pytest.mark.parametrize(
    "text",
    [
        '{"ociVersion": "1.2.0", "id": "c", "pid": 7, "status": "created", "bundle": "/b",'
        ' "annotations": {"k": "v", "n": [1, 2.5, null, true, -0.0, "\\u00e9"]}}',
        '  {"id": "c", "pid": 7}\n',
    ],
)
def test_the_oci_state_reads_like_json_loads(text: str) -> None:
    assert hook._load_json(text) == json.loads(text)
    assert hook.read_state(text) == ("c", 7)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "not JSON: Expecting value"),
        ('{"id": "c", "pid": 7} trailing', "not JSON: Extra data"),
        ("[]", "not a JSON object"),
        ('{"pid": 3}', "no container id"),
        ('{"id": "c", "pid": true}', "bad pid True"),
        ('{"id": "c", "pid": -1}', "bad pid -1"),
    ],
)
def test_a_bad_oci_state_is_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        hook.read_state(text)


def test_main_exits_2_on_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": "c", "pid": 0}'))
    assert hook.main(["attach", "--socket", "/nope", "--claim-uid", "u"]) == hook.EXIT_USAGE
    assert hook.main(["attach", "--claim-uid", "u"]) == hook.EXIT_USAGE


def test_the_attach_socket_follows_the_link_to_the_serving_enforcer(tmp_path: Path) -> None:
    plain = tmp_path / "enforcer.sock"
    assert hook.attach_socket_path(str(plain)) == f"{plain}.attach"
    own = tmp_path / "enforcer-0b7e.sock"
    plain.symlink_to(own.name)  # the chart's stable link, relative
    assert hook.attach_socket_path(str(plain)) == f"{own}.attach"
    assert hook.attach_socket_path(str(plain)) == str(attach_socket_for(own))
    absolute = tmp_path / "abs.sock"
    absolute.symlink_to(own)
    assert hook.attach_socket_path(str(absolute)) == f"{own}.attach"


# ---- the attach socket, served ------------------------------------------------------------
class StandInServicer(ContainersServicer):
    """Answers like the enforcer's servicer: known claims attach, others are NOT_FOUND."""

    def __init__(self) -> None:
        self.requests: list[pb.AttachContainerRequest] = []

    def attach(self, request: pb.AttachContainerRequest) -> pb.AttachContainerResponse:
        if request.claim_uid != "known":
            raise NotFoundError(f"no share for claim {request.claim_uid}")
        self.requests.append(request)
        return pb.AttachContainerResponse(
            attached=True,
            cgroup_paths=["/sys/fs/cgroup/x"],
            limits=[
                pb.LimitEnforcement(resource=pb.RESOURCE_MEMORY, mechanism=pb.MECHANISM_WATCHDOG)
            ],
        )

    def detach(self, request: pb.DetachContainerRequest) -> pb.DetachContainerResponse:
        return pb.DetachContainerResponse(detached=request.claim_uid == "known")


@pytest.fixture
def grpc_socket() -> Iterator[Path]:
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"gs-hook-{os.getpid()}"
    directory.mkdir(exist_ok=True)  # short: unix socket paths are limited to 107 bytes
    try:
        yield directory / "enforcer.sock"
    finally:
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()


def _call(path: Path, message: bytes, method: int = wire.METHOD_ATTACH, within: float = 5) -> str:
    return hook.call(str(path), method, message, time.monotonic() + within)


def _hook(
    kind: str,
    grpc_socket: Path,
    action: str,
    claim: str,
    state: dict[str, object],
    within: float = 5,
) -> subprocess.CompletedProcess[str]:
    """Hook ``kind`` as runc runs it: the command line of a share's edits, the OCI state."""
    args = [action, "--socket", str(grpc_socket), "--claim-uid", claim, "--share-id", "sh"]
    return run_hook_command(kind, [*args, "--timeout", str(within)], state)


def _attach(kind: str, grpc_socket: Path, container: str = "ctr", within: float = 5) -> str:
    """Attach ``container`` (this process) of claim ``known``: what the hook printed."""
    ran = _hook(kind, grpc_socket, "attach", "known", {"id": container, "pid": os.getpid()}, within)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


def _refused(ran: subprocess.CompletedProcess[str], container: str, claim: str = "known") -> str:
    """The reason a hook gave for failing its call (exit 1)."""
    assert ran.returncode == hook.EXIT_FAILED, (ran.stdout, ran.stderr)
    said = f"gpuslice-enforcer-hook: attach {container} of claim {claim} failed: "
    assert ran.stderr.startswith(said) and ran.stderr.endswith("\n"), ran.stderr
    return ran.stderr[len(said) : -1]


def test_attach_and_detach_through_the_socket(grpc_socket: Path, hook_kind: str) -> None:
    servicer = StandInServicer()
    server = AttachSocketServer(attach_socket_for(grpc_socket), servicer)
    server.start()
    try:
        text = _attach(hook_kind, grpc_socket, "ctr-1")
        limits = "RESOURCE_MEMORY=MECHANISM_WATCHDOG"
        assert text == f"attached ctr-1 ({limits}) cgroups ['/sys/fs/cgroup/x']\n"
        request = servicer.requests[0]
        assert (request.claim_uid, request.share_id, request.container_id) == (
            "known",
            "sh",
            "ctr-1",
        )
        assert request.pid == os.getpid()
        assert list(request.cgroup_lines) == Path("/proc/self/cgroup").read_text().splitlines()
        ran = _hook(hook_kind, grpc_socket, "attach", "other", {"id": "ctr-2", "pid": os.getpid()})
        assert _refused(ran, "ctr-2", "other") == "NOT_FOUND: no share for claim other"
        ran = _hook(hook_kind, grpc_socket, "detach", "known", {"id": "ctr-1"})
        assert (ran.returncode, ran.stdout, ran.stderr) == (0, "detached ctr-1\n", "")
    finally:
        server.stop()
    assert not attach_socket_for(grpc_socket).exists()


def test_what_is_not_a_hook_request_is_refused(grpc_socket: Path) -> None:
    server = AttachSocketServer(attach_socket_for(grpc_socket), StandInServicer())
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:  # not the hook
            raw.connect(str(attach_socket_for(grpc_socket)))
            raw.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            reply = raw.recv(4096)
        assert reply[0] == 3 and b"not a gpuslice hook request" in reply  # INVALID_ARGUMENT
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:  # a hook killed mid-call
            raw.connect(str(attach_socket_for(grpc_socket)))
            raw.sendall(hook.frame(wire.METHOD_ATTACH, b"\x0a\x05known")[:-3])
            raw.shutdown(socket.SHUT_WR)
            reply = raw.recv(4096)
        assert reply[0] == 3 and b"request cut short: connection closed after 4 of 7" in reply
    finally:
        server.stop()


def test_the_in_process_call_returns_the_reply(grpc_socket: Path) -> None:
    servicer = StandInServicer()
    server = AttachSocketServer(attach_socket_for(grpc_socket), servicer)
    server.start()
    try:
        message = hook.attach_message("known", "sh", "ctr-1", 42, CGROUP_LINES)
        assert _call(grpc_socket, message).startswith("attached ctr-1 (")
        assert list(servicer.requests[0].cgroup_lines) == CGROUP_LINES
        with pytest.raises(hook.HookError, match="NOT_FOUND: no share for claim other"):
            _call(grpc_socket, hook.attach_message("other", "", "ctr-2", 42, []))
    finally:
        server.stop()


def test_the_hook_waits_for_an_enforcer_that_is_restarting(
    grpc_socket: Path, hook_kind: str
) -> None:
    server = AttachSocketServer(attach_socket_for(grpc_socket), StandInServicer())
    starter = threading.Timer(0.3, server.start)
    starter.start()
    try:
        assert _attach(hook_kind, grpc_socket).startswith("attached ctr")
    finally:
        starter.join()
        server.stop()


def test_the_hook_gives_up_at_its_deadline(grpc_socket: Path, hook_kind: str) -> None:
    path = attach_socket_for(grpc_socket)
    state = {"id": "ctr", "pid": os.getpid()}
    started = time.monotonic()
    ran = _hook(hook_kind, grpc_socket, "attach", "known", state, within=0.5)
    took = time.monotonic() - started
    why = f"UNAVAILABLE: no enforcer listened on {path} (No such file or directory) until"
    assert _refused(ran, "ctr") == f"{why} the timeout"
    assert 0.45 < took < 2
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:  # bound, never listening
        bound.bind(str(path))
        ran = _hook(hook_kind, grpc_socket, "attach", "known", state, within=0.3)
        path.unlink()
    why = f"UNAVAILABLE: no enforcer listened on {path} (Connection refused) until the timeout"
    assert _refused(ran, "ctr") == why


# ---- hostile and broken clients (issue 27) -------------------------------------------------
def _stuck(path: Path) -> socket.socket:
    """A client that announces a 100-byte request, sends 2 bytes of it and holds."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(path))
    conn.sendall(wire.MAGIC + bytes([wire.METHOD_ATTACH]) + (100).to_bytes(4, "big") + b"\n\x02")
    return conn


def _reply(conn: socket.socket, timeout: float = 5) -> tuple[int, str]:
    conn.settimeout(timeout)
    head = hook.recv_exactly(conn, 5, time.monotonic() + timeout)
    text = hook.recv_exactly(conn, int.from_bytes(head[1:], "big"), time.monotonic() + timeout)
    return head[0], text.decode()


def test_stuck_and_dripping_clients_never_delay_a_valid_call(
    grpc_socket: Path, hook_kind: str
) -> None:
    path = attach_socket_for(grpc_socket)
    server = AttachSocketServer(path, StandInServicer(), request_deadline_s=1.0)
    server.start()
    stuck = [_stuck(path) for _ in range(20)]  # more than the 8 workers
    dripping = _stuck(path)
    stop = threading.Event()

    def drip() -> None:  # a byte every 0.2 s: every read succeeds, the request never completes
        with contextlib.suppress(OSError):
            while not stop.wait(0.2):
                dripping.send(b"x")

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        started = time.monotonic()
        assert _attach(hook_kind, grpc_socket).startswith("attached ctr")
        assert time.monotonic() - started < 2  # was 10 s (a worker per stuck client)
        for conn in [*stuck, dripping]:
            status, text = _reply(conn)
            assert status == 4, text  # DEADLINE_EXCEEDED
            assert text.startswith("the request was not complete within 1 s")
        assert time.monotonic() - started < 4  # the deadline is per request, not per read
    finally:
        stop.set()
        dripper.join()
        for conn in [*stuck, dripping]:
            conn.close()
        server.stop()


def test_past_max_pending_the_connection_waiting_longest_goes(
    grpc_socket: Path, hook_kind: str
) -> None:
    path = attach_socket_for(grpc_socket)
    server = AttachSocketServer(path, StandInServicer(), max_pending=4)
    server.start()
    stuck = []
    try:
        for _ in range(6):
            stuck.append(_stuck(path))
            time.sleep(0.05)  # accepted in this order
        for conn in stuck[:2]:
            status, text = _reply(conn)
            assert status == 8, text  # RESOURCE_EXHAUSTED
            assert "4 connections were still sending their requests" in text
        assert _attach(hook_kind, grpc_socket).startswith("attached ctr")
    finally:
        for conn in stuck:
            conn.close()
        server.stop()


def test_the_hook_waits_out_a_full_backlog_within_its_timeout(
    grpc_socket: Path, hook_kind: str
) -> None:
    path = attach_socket_for(grpc_socket)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    fillers = []
    while True:  # fill the backlog: the next connect is refused with EAGAIN
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        filler.setblocking(False)
        try:
            filler.connect(str(path))
        except BlockingIOError:
            filler.close()
            break
        fillers.append(filler)
    state = {"id": "ctr", "pid": os.getpid()}
    try:
        started = time.monotonic()
        ran = _hook(hook_kind, grpc_socket, "attach", "known", state, within=0.3)
        assert _refused(ran, "ctr") == (
            f"UNAVAILABLE: the enforcer on {path} stayed busy (its backlog full) until the timeout"
        )
        assert 0.25 < time.monotonic() - started < 2

        def serve_after(delay: float) -> None:
            time.sleep(delay)
            for filler in fillers:
                filler.close()
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(5)
                    if not conn.recv(1 << 16):
                        continue  # a filler
                    conn.sendall(b"\x00" + (9).to_bytes(4, "big") + b"attached!")
                    return

        server = threading.Thread(target=serve_after, args=(0.5,))
        server.start()
        assert _attach(hook_kind, grpc_socket) == "attached!\n"  # was EAGAIN at once
        server.join()
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
        path.unlink()


def test_a_planted_file_at_the_attach_path_is_refused(grpc_socket: Path) -> None:
    path = attach_socket_for(grpc_socket)
    path.write_text("precious")
    server = AttachSocketServer(path, StandInServicer())
    with pytest.raises(FileExistsError, match="is not a unix socket; refusing to replace it"):
        server.start()
    server.stop()
    assert path.read_text() == "precious"


def test_modes_are_explicit_whatever_the_umask(grpc_socket: Path) -> None:
    path = attach_socket_for(grpc_socket.parent / "run" / grpc_socket.name)
    server = AttachSocketServer(path, StandInServicer())
    previous = os.umask(0)
    try:
        server.start()
    finally:
        os.umask(previous)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755
    finally:
        server.stop()
        path.parent.rmdir()


class LoudServicer(StandInServicer):
    def attach(self, request: pb.AttachContainerRequest) -> pb.AttachContainerResponse:
        raise NotFoundError(f"no container {request.container_id}")


def test_error_messages_stay_bounded(grpc_socket: Path, hook_kind: str) -> None:
    path = attach_socket_for(grpc_socket)
    server = AttachSocketServer(path, LoudServicer())
    server.start()
    try:
        with pytest.raises(hook.HookError) as loud:
            _call(grpc_socket, hook.attach_message("known", "", "c" * 60_000, 1, []))
        assert len(str(loud.value)) < wire.MAX_TEXT + 100
        assert str(loud.value).endswith(
            f"… ({len('no container ') + 60_000 - 1024} more characters)"
        )
        huge = "c" * 60_000
        ran = _hook(hook_kind, grpc_socket, "attach", "known", {"id": huge, "pid": os.getpid()})
        said = f"attach {huge} of claim known failed: {loud.value}"
        assert ran.returncode == hook.EXIT_FAILED
        assert ran.stderr == f"gpuslice-enforcer-hook: {wire.bounded(said, 4 * wire.MAX_TEXT)}\n"
        assert len(ran.stderr) < 4 * wire.MAX_TEXT + 100
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(str(path))
            raw.sendall(wire.MAGIC + bytes([wire.METHOD_ATTACH]) + (1 << 30).to_bytes(4, "big"))
            assert _reply(raw) == (3, "request of 1073741824 bytes; at most 65536")
    finally:
        server.stop()


def test_a_recurring_complaint_is_logged_once_per_period() -> None:
    now = [0.0]
    complaint = Throttled("accept failed", every=10, clock=lambda: now[0])
    logged = []
    for step in range(100):  # 25 s of one failure every 0.25 s
        now[0] = step * 0.25
        if complaint(error="Too many open files"):
            logged.append(now[0])
    assert logged == [0.0, 10.0, 20.0]
