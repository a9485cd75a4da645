"""ShareManager with the fake NVML and a real checkpoint: idempotence and restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_core.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from gpuslice_enforcer.cgroups import CgroupView, Mount
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.mps import MpsManager
from gpuslice_enforcer.shares import AttachRequest, ShareManager, ShareRequest, share_id_for
from gpuslice_enforcer.state import Mechanism, Mode, open_store
from gpuslice_nvml.fake import FakeNvml

GIB = 1 << 30


@pytest.fixture
def node(tmp_path: Path) -> Path:
    config = tmp_path / "node.yaml"
    config.write_text('name: n\ndriverVersion: "570.1"\nstatePath: s.json\ngpus:\n  - model: L4\n')
    return config


def manager(node: Path, tmp_path: Path) -> ShareManager:
    config = EnforcerConfig(socket=tmp_path / "s", state_dir=tmp_path / "state", mps=False)
    m = ShareManager(
        FakeNvml.from_config_file(node),
        config,
        open_store(config.state_dir, boot_id="boot-1"),
        CgroupView(mounts=()),
        MpsManager(config),
    )
    m.start()
    return m


def request(node: Path, **kw: object) -> ShareRequest:
    values: dict[str, object] = {
        "claim_uid": "c1",
        "claim_namespace": "ns",
        "claim_name": "c",
        "device_uuids": [FakeNvml.from_config_file(node).gpu(0).uuid],
        "cores_percent": 30,
        "memory_bytes": GIB,
    }
    values.update(kw)
    return ShareRequest(**values)  # type: ignore[arg-type]


def test_create_is_idempotent_and_survives_a_restart(node: Path, tmp_path: Path) -> None:
    first = manager(node, tmp_path)
    created = first.create(request(node))
    assert created.created and created.share.share_id == share_id_for("c1")
    assert created.share.memory_mechanism is Mechanism.WATCHDOG
    assert not first.create(request(node)).created
    with pytest.raises(FailedPreconditionError, match="other parameters"):
        first.create(request(node, cores_percent=31))

    second = manager(node, tmp_path)  # a restarted enforcer
    again = second.create(request(node))
    assert not again.created and again.share == created.share
    assert second.release("c1") is not None
    assert second.release("c1") is None


def test_validation_names_the_field(node: Path, tmp_path: Path) -> None:
    m = manager(node, tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"cores_percent: 101 .* 1\.\.100"):
        m.create(request(node, cores_percent=101))
    with pytest.raises(InvalidArgumentError, match=r"memory_bytes: .* more than GPU"):
        m.create(request(node, memory_bytes=1000 * GIB))
    with pytest.raises(InvalidArgumentError, match="device_uuids"):
        m.create(request(node, device_uuids=[]))
    with pytest.raises(NotFoundError, match="no GPU GPU-0000"):
        m.create(request(node, device_uuids=["GPU-0000"]))


def test_attach_needs_a_share_and_a_live_process(node: Path, tmp_path: Path) -> None:
    m = manager(node, tmp_path)
    with pytest.raises(NotFoundError, match="has no share"):
        m.attach(AttachRequest(claim_uid="c1", container_id="x", pid=1))
    m.create(request(node, mode=Mode.SOFT))
    with pytest.raises(FailedPreconditionError, match="stale CDI spec"):
        m.attach(AttachRequest(claim_uid="c1", container_id="x", pid=1, share_id="sh-other"))
    attached = m.attach(
        AttachRequest(claim_uid="c1", container_id="x", pid=1, cgroup_lines=["0::/pod/x"])
    )
    assert attached.attached
    assert not m.attach(
        AttachRequest(claim_uid="c1", container_id="x", pid=1, cgroup_lines=["0::/pod/x"])
    ).attached
    assert m.detach("c1", "x") and not m.detach("c1", "x")


@pytest.fixture
def cgroup_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup2"  # stands in for the cgroup v2 mount
    root.mkdir()
    return root


def hooked(node: Path, tmp_path: Path, root: Path) -> ShareManager:
    """A manager whose cgroup v2 hierarchy is ``root``, with a share for claim c1."""
    config = EnforcerConfig(socket=tmp_path / "s", state_dir=tmp_path / "state", mps=False)
    m = ShareManager(
        FakeNvml.from_config_file(node),
        config,
        open_store(config.state_dir, boot_id="boot-1"),
        CgroupView(mounts=(Mount(root, "/", 2),), proc=tmp_path),
        MpsManager(config),
    )
    m.start()
    m.create(request(node, mode=Mode.SOFT))
    return m


def attach(m: ShareManager, container_id: str, *lines: str) -> None:
    m.attach(AttachRequest(claim_uid="c1", container_id=container_id, pid=1, cgroup_lines=[*lines]))


def containers(m: ShareManager) -> list[str]:
    share = m.get("c1")
    assert share is not None
    return sorted(share.containers)


def test_cgroup_lines_that_climb_out_or_do_not_exist_are_refused(
    node: Path, tmp_path: Path, cgroup_root: Path
) -> None:
    m = hooked(node, tmp_path, cgroup_root)
    (cgroup_root / "pod" / "ctr").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (cgroup_root / "pod" / "link").symlink_to(outside)
    for line in ("0::/pod/../../outside", "0::/pod/./ctr", "0::pod/ctr", "7:freezer:/../x"):
        with pytest.raises(InvalidArgumentError, match="is not a cgroup path"):
            attach(m, "x", line)
    with pytest.raises(InvalidArgumentError, match="leads out of the cgroup root"):
        attach(m, "x", "0::/pod/link")
    with pytest.raises(NotFoundError, match=r"cgroup .*/pod/gone does not exist"):
        attach(m, "x", "0::/pod/gone")
    assert containers(m) == []
    attach(m, "x", "0::/pod/ctr")
    share = m.get("c1")
    assert share is not None and share.containers["x"].v2_dir == str(cgroup_root / "pod/ctr")


def test_containers_that_are_gone_are_forgotten(
    node: Path, tmp_path: Path, cgroup_root: Path
) -> None:
    m = hooked(node, tmp_path, cgroup_root)
    for index in range(50):  # containers come and go; no poststop hook detaches them
        (cgroup_root / f"c{index}").mkdir()
        attach(m, f"c{index}", f"0::/c{index}")
        (cgroup_root / f"c{index}").rmdir()
    assert containers(m) == ["c49"]  # attach forgets its share's gone containers (was 50)
    (cgroup_root / "live").mkdir()
    attach(m, "live", "0::/live")
    assert containers(m) == ["live"]
    assert m.prune() == 0
    (cgroup_root / "live").rmdir()
    assert m.prune() == 1  # the supervisor's periodic sweep
    assert containers(m) == []
    assert m.store.load().state.shares["c1"].containers == {}


def test_attach_refuses_oversized_fields_with_a_short_message(node: Path, tmp_path: Path) -> None:
    m = manager(node, tmp_path)
    m.create(request(node, mode=Mode.SOFT))
    for kw in (
        {"container_id": "c" * 100_000},
        {"share_id": "s" * 1000},
        {"cgroup_lines": ["0::/" + "p" * 100_000]},
        {"cgroup_lines": ["0::/p"] * 1000},
    ):
        values: dict[str, object] = {"claim_uid": "c1", "container_id": "x", "pid": 1, **kw}
        with pytest.raises(InvalidArgumentError) as refused:
            m.attach(AttachRequest(**values))  # type: ignore[arg-type]
        assert len(str(refused.value)) < 200
