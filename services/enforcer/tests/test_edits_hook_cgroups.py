"""Container edits, cgroup parsing and process-to-share mapping (the hook: test_hook.py)."""

from __future__ import annotations

from pathlib import Path

from gpuslice_enforcer.cgroups import CgroupView, Mount, read_mounts, within
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.edits import container_edits
from gpuslice_enforcer.state import ContainerRecord, Mechanism, PodRef, ShareRecord
from gpuslice_enforcer.watchdog import match_share

GIB = 1 << 30
CONFIG = EnforcerConfig(socket=Path("/run/e.sock"), state_dir=Path("/tmp"))


def share(**kw: object) -> ShareRecord:
    values: dict[str, object] = {
        "claim_uid": "c1",
        "share_id": "sh-1",
        "device_uuids": ["GPU-a"],
        "gpu_indices": [0],
        "cores_percent": 30,
        "memory_bytes": 4 * GIB,
    }
    values.update(kw)
    return ShareRecord.model_validate(values)


def test_edits_attach_hooks_and_name_no_claim_wide_variable() -> None:
    edits = container_edits(CONFIG, share())
    # a container may hold shares of several claims: a variable per share would keep only the
    # last share's value, so the plugin states the limits in per-device variables instead
    assert edits.env == [] and edits.mounts == []
    attach, detach = edits.hooks
    assert (attach.hook_name, detach.hook_name) == ("createContainer", "poststop")
    assert attach.args[1:3] == ["attach", "--socket"] and "/run/e.sock" in attach.args


def test_edits_for_mps_and_no_hooks_without_enforcement() -> None:
    legacy = container_edits(
        CONFIG,
        share(
            memory_mechanism=Mechanism.MPS_LEGACY,
            cores_mechanism=Mechanism.MPS_LEGACY,
            mps_pipe_dir="/run/mps/0",
        ),
    )
    env = dict(e.split("=", 1) for e in legacy.env)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert legacy.mounts[0].host_path == "/run/mps/0"
    off = container_edits(
        CONFIG, share(memory_mechanism=Mechanism.NONE, cores_mechanism=Mechanism.NONE)
    )
    assert off.hooks == []


def test_read_mounts(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "30 25 0:26 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer\n"
        "31 25 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
        "32 25 0:28 / /proc rw - proc proc rw\n"
    )
    freezer, v2 = read_mounts(info)
    assert (freezer.version, freezer.controllers) == (1, frozenset({"freezer"}))
    assert (v2.version, v2.path) == (2, Path("/sys/fs/cgroup/unified"))


def test_parse_and_freeze_targets() -> None:
    view = CgroupView(
        mounts=(
            Mount(Path("/cg/freezer"), "/", 1, frozenset({"freezer"})),
            Mount(Path("/cg/unified"), "/", 2),
        ),
        proc=Path("/nonexistent"),
    )
    groups = view.parse(["7:freezer:/kubepods/pod1/c1", "0::/kubepods/pod1/c1"])
    assert groups.freezer_dir == Path("/cg/freezer/kubepods/pod1/c1")
    assert groups.v2_dir == Path("/cg/unified/kubepods/pod1/c1")
    assert view.freeze_target(groups) == Path("/cg/freezer/kubepods/pod1/c1")
    assert view.freeze_target(view.parse(["7:freezer:/", "0::/"])) is None  # never the root
    assert within("/a/b/c", "/a/b") and not within("/a/bc", "/a/b")


def test_processes_map_to_shares_by_container_cgroup_or_pod_uid() -> None:
    view = CgroupView(mounts=(), proc=Path("/nonexistent"))
    attached = share(
        claim_uid="c1",
        containers={"x": ContainerRecord(container_id="x", v2_path="/kubepods/podA/x")},
    )
    by_pod = share(claim_uid="c2", pods=[PodRef(uid="1234-56")])
    same_pod = share(claim_uid="c3", pods=[PodRef(uid="9999")])
    shares = [attached, by_pod, same_pod]
    assert match_share(view.parse(["0::/kubepods/podA/x/child"]), shares) is attached
    systemd = "0::/kubepods.slice/kubepods-pod1234_56.slice/cri-containerd-y.scope"
    assert match_share(view.parse([systemd]), shares) is by_pod
    assert match_share(view.parse(["0::/kubepods/pod1234-56/y"]), shares) is by_pod
    assert match_share(view.parse(["0::/system.slice/sshd.service"]), shares) is None
    twice = [by_pod, share(claim_uid="c4", pods=[PodRef(uid="1234-56")])]
    assert match_share(view.parse(["0::/kubepods/pod1234-56/y"]), twice) is None  # ambiguous
