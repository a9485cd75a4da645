"""Tests for gpuslice_core.cdi: models, naming, version selection, atomic files, resolve."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpuslice_core import cdi
from gpuslice_core.cdi import (
    ClaimSpecs,
    ContainerEdits,
    Device,
    DeviceNode,
    Hook,
    IntelRdt,
    Mount,
    NetDevice,
    Spec,
    load_spec,
    minimum_version,
    resolve,
)
from gpuslice_core.errors import (
    CorruptStateError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from gpuslice_core.files import temp_files_for

UID = "8c2f0a4e-5b1d-4c7a-9e3f-0123456789ab"
UID2 = "1f9e8d7c-6b5a-4f3e-8d2c-ba9876543210"
KIND = "k8s.gpu.gpuslice.dev/claim"


def gpu_edits(index: int = 0) -> ContainerEdits:
    return ContainerEdits(
        env=[f"CUDA_VISIBLE_DEVICES={index}", f"GPUSLICE_DEVICE_UUIDS=GPU-{index}"],
        device_nodes=[
            DeviceNode(path=f"/dev/nvidia{index}", host_path=f"/dev/nvidia{index}", type="c"),
        ],
    )


def write_claim(specs: ClaimSpecs, uid: str = UID, index: int = 0) -> list[str]:
    return specs.write(
        uid,
        [Device(name=specs.device_name(uid, f"gpu-{index}"), container_edits=gpu_edits(index))],
        container_edits=ContainerEdits(
            env=[f"GPUSLICE_CLAIM_UID={uid}"],
            device_nodes=[DeviceNode(path="/dev/nvidiactl", permissions="rw")],
        ),
    )


def test_names_and_qualified_ids(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path)
    assert specs.kind == KIND
    assert specs.device_name(UID, "gpu-0") == f"{UID}-gpu-0"
    assert specs.device_name(UID, "gpu-1", share_id="2") == f"{UID}-gpu-1-2"
    assert specs.qualified_id(f"{UID}-gpu-0") == f"{KIND}={UID}-gpu-0"
    assert specs.spec_path(UID) == tmp_path / f"k8s.gpu.gpuslice.dev-claim_{UID}.json"
    assert cdi.parse_qualified_name(f"{KIND}={UID}-gpu-0") == (
        "k8s.gpu.gpuslice.dev",
        "claim",
        f"{UID}-gpu-0",
    )
    other = ClaimSpecs(tmp_path, vendor="example.com", cdi_class="gpu-share")
    assert other.qualified_id("a") == "example.com/gpu-share=a"


def test_write_read_round_trip(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path / "cdi")
    ids = write_claim(specs)
    assert ids == [f"{KIND}={UID}-gpu-0"]
    spec = load_spec(specs.spec_path(UID))
    assert spec.kind == KIND
    assert spec.cdi_version == "0.5.0"  # claim UIDs start with digits; hostPath is used
    assert spec.devices[0].container_edits == gpu_edits(0)
    assert spec.container_edits.env == [f"GPUSLICE_CLAIM_UID={UID}"]
    assert specs.spec_path(UID).stat().st_mode & 0o777 == 0o644


def test_json_uses_the_cdi_field_names_and_omits_empty_fields(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path)
    edits = ContainerEdits(
        env=["A=1"],
        device_nodes=[
            DeviceNode(path="/dev/nvidia0", host_path="/dev/nvidia0", type="c", major=195)
        ],
        mounts=[Mount(host_path="/usr/lib/libcuda.so", container_path="/usr/lib/libcuda.so")],
        hooks=[Hook(hook_name="createContainer", path="/usr/bin/nvidia-cdi-hook", timeout=5)],
        additional_gids=[44],
    )
    specs.write(UID, [Device(name=f"{UID}-gpu-0", container_edits=edits)])
    doc = json.loads(specs.spec_path(UID).read_text())
    assert set(doc) == {"cdiVersion", "kind", "devices"}
    assert doc["cdiVersion"] == "0.7.0"
    device = doc["devices"][0]
    assert set(device) == {"name", "containerEdits"}
    edits_doc: dict[str, Any] = device["containerEdits"]
    assert set(edits_doc) == {"env", "deviceNodes", "mounts", "hooks", "additionalGids"}
    assert edits_doc["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "type": "c", "major": 195}
    ]
    assert edits_doc["mounts"] == [
        {"hostPath": "/usr/lib/libcuda.so", "containerPath": "/usr/lib/libcuda.so"}
    ]
    assert edits_doc["hooks"] == [
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook", "timeout": 5}
    ]
    assert edits_doc["additionalGids"] == [44]


def spec_with(name: str = "gpu0", kind: str = "example.com/gpu", **edits: Any) -> Spec:
    edits.setdefault("env", ["A=1"])
    return Spec(
        cdi_version="1.1.0",
        kind=kind,
        devices=[Device(name=name, container_edits=ContainerEdits(**edits))],
    )


@pytest.mark.parametrize(
    ("spec", "version"),
    [
        (spec_with(), "0.3.0"),
        (spec_with(mounts=[Mount(host_path="tmpfs", container_path="/x", type="tmpfs")]), "0.4.0"),
        (spec_with(name="0gpu"), "0.5.0"),
        (spec_with(device_nodes=[DeviceNode(path="/dev/a", host_path="/dev/b")]), "0.5.0"),
        (spec_with(kind="example.com/gpu.share"), "0.6.0"),
        (spec_with().model_copy(update={"annotations": {"a": "b"}}), "0.6.0"),
        (spec_with(additional_gids=[5]), "0.7.0"),
        (spec_with(intel_rdt=IntelRdt(clos_id="c")), "0.7.0"),
        (spec_with(intel_rdt=IntelRdt(enable_monitoring=True)), "1.1.0"),
        (spec_with(net_devices=[NetDevice(host_interface_name="eth1", name="net1")]), "1.1.0"),
    ],
)
def test_minimum_version(spec: Spec, version: str) -> None:
    assert minimum_version(spec) == version
    cdi.validate_spec(spec.model_copy(update={"cdi_version": version}))


def test_declared_version_below_the_features_used_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    doc = json.loads(spec_with(name="0gpu").to_json())
    doc["cdiVersion"] = "0.4.0"
    path.write_text(json.dumps(doc))
    with pytest.raises(
        CorruptStateError, match=r"0\.4\.0 is too low: the features used need 0\.5\.0"
    ):
        load_spec(path)
    doc["cdiVersion"] = "0.9.0"
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptStateError, match=r"'0\.9\.0' is not one of"):
        load_spec(path)


@pytest.mark.parametrize("name", ["-gpu", "gpu-", "gpu 0", "gpu/0", "gpu=0", "", "gpü"])
def test_invalid_device_names_are_refused(tmp_path: Path, name: str) -> None:
    specs = ClaimSpecs(tmp_path)
    with pytest.raises(InvalidArgumentError, match="CDI device name") as err:
        specs.qualified_id(name)
    assert repr(name) in str(err.value)


def test_invalid_kind_claim_uid_and_foreign_device_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"CDI vendor '1vendor\.com' is invalid"):
        ClaimSpecs(tmp_path, vendor="1vendor.com")
    with pytest.raises(InvalidArgumentError, match="CDI class 'claim-' is invalid"):
        ClaimSpecs(tmp_path, cdi_class="claim-")
    specs = ClaimSpecs(tmp_path)
    with pytest.raises(InvalidArgumentError, match=re.escape("claim UID '../etc'")):
        specs.spec_path("../etc")
    with pytest.raises(InvalidArgumentError, match="must be named <claimUID>-<device>"):
        specs.write(UID, [Device(name=f"{UID2}-gpu-0", container_edits=gpu_edits())])
    with pytest.raises(InvalidArgumentError, match="not <vendor>/<class>=<name>"):
        cdi.parse_qualified_name("gpu0")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        (ContainerEdits(env=["NOVALUE"]), "env entries must be KEY=VALUE"),
        (ContainerEdits(env=["=x"]), "env entries must be KEY=VALUE"),
        (ContainerEdits(device_nodes=[DeviceNode(path="dev/nvidia0")]), "path must be absolute"),
        (ContainerEdits(device_nodes=[DeviceNode(path="/dev/a", type="x")]), "type 'x'"),
        (ContainerEdits(device_nodes=[DeviceNode(path="/d", permissions="rwx")]), "permissions"),
        (ContainerEdits(mounts=[Mount(host_path="/a", container_path="b")]), "containerPath 'b'"),
        (ContainerEdits(hooks=[Hook(hook_name="prestop", path="/bin/x")]), "hookName 'prestop'"),
        (ContainerEdits(hooks=[Hook(hook_name="poststop", path="x")]), "path 'x' must be abs"),
        (ContainerEdits(), "containerEdits must not be empty"),
    ],
)
def test_invalid_edits_are_refused(tmp_path: Path, edits: ContainerEdits, message: str) -> None:
    specs = ClaimSpecs(tmp_path)
    with pytest.raises(InvalidArgumentError, match=message) as err:
        specs.write(UID, [Device(name=f"{UID}-gpu-0", container_edits=edits)])
    assert f"device '{UID}-gpu-0'" in str(err.value)
    assert not specs.spec_path(UID).exists()


def test_strict_reader_refuses_unknown_fields_and_wrong_types(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path)
    write_claim(specs)
    path = specs.spec_path(UID)
    doc = json.loads(path.read_text())
    doc["devices"][0]["containerEdits"]["deviceNodes"][0]["host_path"] = "/dev/x"
    path.write_text(json.dumps(doc))
    unknown = r"host_path: unknown key; allowed keys here: .*hostPath"
    with pytest.raises(CorruptStateError, match=unknown) as err:
        load_spec(path)
    assert str(path) in str(err.value)
    write_claim(specs)
    doc = json.loads(path.read_text())
    doc["devices"][0]["containerEdits"]["deviceNodes"][0]["major"] = "195"
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptStateError, match="major"):
        load_spec(path)
    path.write_text("{not json")
    with pytest.raises(CorruptStateError, match="Invalid JSON"):
        load_spec(path)
    with pytest.raises(NotFoundError):
        load_spec(tmp_path / "missing.json")


def test_write_replaces_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = ClaimSpecs(tmp_path)
    write_claim(specs, index=0)
    write_claim(specs, index=1)  # a re-prepare with other content replaces the file
    path = specs.spec_path(UID)
    assert load_spec(path).devices[0].name == f"{UID}-gpu-1"
    before = path.read_bytes()

    def crash(self: Path, target: Any) -> Path:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(Path, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        write_claim(specs, index=2)
    monkeypatch.undo()
    assert path.read_bytes() == before  # old spec intact, no partial file
    assert temp_files_for(path) == []
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_delete_is_idempotent_and_lists_claims(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path / "cdi")
    assert specs.claim_uids() == []  # the root does not exist yet
    write_claim(specs, UID)
    write_claim(specs, UID2, index=1)
    (tmp_path / "cdi" / "nvidia.com-gpu.json").write_text("{}")  # another vendor's spec
    (tmp_path / "cdi" / f".k8s.gpu.gpuslice.dev-claim_{UID}.json.x.tmp").write_text("")
    assert specs.claim_uids() == sorted([UID, UID2])
    assert specs.delete(UID) is True
    assert specs.delete(UID) is False
    assert specs.claim_uids() == [UID2]


def test_resolve_merges_spec_and_device_edits(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path)
    ids = write_claim(specs, UID)
    edits = resolve(tmp_path, ids)
    assert edits.env == [
        f"GPUSLICE_CLAIM_UID={UID}",
        "CUDA_VISIBLE_DEVICES=0",
        "GPUSLICE_DEVICE_UUIDS=GPU-0",
    ]
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidiactl", "/dev/nvidia0"]


def test_resolve_applies_spec_edits_once_and_later_values_win(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path)
    devices = [
        Device(name=specs.device_name(UID, f"gpu-{i}"), container_edits=gpu_edits(i))
        for i in range(2)
    ]
    shared = ContainerEdits(hooks=[Hook(hook_name="createContainer", path="/bin/ldconfig")])
    ids = specs.write(UID, devices, container_edits=shared)
    edits = resolve(tmp_path, [*ids, ids[0]])  # a repeated id counts once
    assert len(edits.hooks) == 1
    assert "CUDA_VISIBLE_DEVICES=1" in edits.env and "CUDA_VISIBLE_DEVICES=0" not in edits.env
    with pytest.raises(FailedPreconditionError, match="CUDA_VISIBLE_DEVICES"):
        resolve(tmp_path, ids, strict=True)


def test_resolve_fails_on_unknown_or_conflicting_devices(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path)
    ids = write_claim(specs, UID)
    unknown = f"{KIND}={UID}-gpu-7"
    with pytest.raises(NotFoundError, match=f"unresolvable CDI devices.*{re.escape(unknown)}"):
        resolve(tmp_path, [*ids, unknown])
    with pytest.raises(InvalidArgumentError):
        resolve(tmp_path, ["not-qualified"])

    copy = tmp_path / "copy-of-claim.json"
    copy.write_bytes(specs.spec_path(UID).read_bytes())
    with pytest.raises(FailedPreconditionError, match="defined in several specs"):
        resolve(tmp_path, ids)

    later = tmp_path / "later"
    later.mkdir()
    (later / "override.json").write_bytes(copy.read_bytes())
    assert resolve([tmp_path, later], ids).env  # a later root wins over a conflict before it


def test_resolve_skips_broken_specs_but_names_them(tmp_path: Path) -> None:
    specs = ClaimSpecs(tmp_path)
    ids = write_claim(specs, UID)
    (tmp_path / "broken.json").write_text("{")
    assert resolve(tmp_path, ids).env
    with pytest.raises(NotFoundError, match=r"broken\.json"):
        resolve(tmp_path, [f"{KIND}={UID2}-gpu-0"])
