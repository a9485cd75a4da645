"""``gpuslice-enforcer-hook``: the CDI hook that hands a new container to the enforcer.

The container runtime runs it on the host as the ``createContainer`` hook of a share's
containers, with the OCI state on stdin (``{"id": …, "pid": …, …}``), after the container's
cgroups exist and before its process runs the workload:

    gpuslice-enforcer-hook attach --socket /var/run/gpuslice/enforcer.sock \\
        --claim-uid <uid> --share-id <id> --timeout 10

It reads ``/proc/<pid>/cgroup``, calls ``EnforcerContainers.AttachContainer`` (waiting for the
enforcer up to ``--timeout`` seconds if it is restarting) and exits 0 only once the enforcer
says every limit is in force; any failure exits non-zero with the reason on stderr, which makes
the runtime fail the container instead of starting it unenforced. ``detach`` (the ``poststop``
hook) forgets the container; its failures only matter for bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc

EXIT_FAILED = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuslice-enforcer-hook",
        description="CDI hook: attach a container to its gpuslice share (reads the OCI state).",
    )
    parser.add_argument("action", choices=("attach", "detach"), help="createContainer or poststop")
    parser.add_argument("--socket", required=True, help="The enforcer's unix socket (host path).")
    parser.add_argument("--claim-uid", required=True, help="UID of the claim whose share it is.")
    parser.add_argument("--share-id", default="", help="The share's ID, checked by the enforcer.")
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="Seconds to wait for the limits to be set."
    )
    return parser


def read_state(text: str) -> tuple[str, int]:
    """(container id, pid) from the OCI state JSON."""
    state = json.loads(text)
    if not isinstance(state, dict):
        raise ValueError("the OCI state is not a JSON object")
    container_id, pid = state.get("id"), state.get("pid", 0)
    if not isinstance(container_id, str) or not container_id:
        raise ValueError("the OCI state has no container id")
    if not isinstance(pid, int) or pid < 0:
        raise ValueError(f"the OCI state has a bad pid {pid!r}")
    return container_id, pid


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        container_id, pid = read_state(sys.stdin.read())
    except ValueError as exc:
        print(f"gpuslice-enforcer-hook: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.action == "attach" and pid <= 0:
        print("gpuslice-enforcer-hook: the OCI state has no pid to attach", file=sys.stderr)
        return EXIT_USAGE
    lines: list[str] = []
    if pid > 0:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError as exc:
            print(f"gpuslice-enforcer-hook: /proc/{pid}/cgroup: {exc.strerror}", file=sys.stderr)
            return EXIT_FAILED
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
                    timeout=args.timeout,
                    wait_for_ready=True,
                )
                limits = ", ".join(
                    f"{pb.Resource.Name(lim.resource)}={pb.Mechanism.Name(lim.mechanism)}"
                    for lim in reply.limits
                )
                print(f"attached {container_id} ({limits}) cgroups {list(reply.cgroup_paths)}")
            else:
                stub.DetachContainer(
                    pb.DetachContainerRequest(claim_uid=args.claim_uid, container_id=container_id),
                    timeout=args.timeout,
                    wait_for_ready=True,
                )
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            print(
                f"gpuslice-enforcer-hook: {args.action} {container_id} of claim "
                f"{args.claim_uid} failed: {code}: {detail}",
                file=sys.stderr,
            )
            return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
