"""ShareManager with the fake NVML and a real checkpoint: idempotence and restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_core.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from gpuslice_enforcer.cgroups import CgroupView
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.mps import MpsManager
from gpuslice_enforcer.server import checkpoint_store
from gpuslice_enforcer.shares import AttachRequest, ShareManager, ShareRequest, share_id_for
from gpuslice_enforcer.state import Mechanism, Mode
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
        checkpoint_store(config.state_dir, boot_id="boot-1"),
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
