"""NodePrepareResources / NodeUnprepareResources over the real DRA socket (both versions), the
plugin in-process against the sandbox's API server: claims live in the real API, allocated
through their status subresource as the scheduler would."""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.sandbox.gpunode import delete_claim
from e2e.support.kubelet_plugin import ClaimMaker, RecordingRawApi
from gpuslice_core.cdi import load_spec
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kubelet_plugin.cdispecs import device_env
from gpuslice_testkit.kubelet_plugin.dra import DraClient, gpu_config, ref, result
from gpuslice_testkit.kubelet_plugin.harness import Harness, Node, Running

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(30)

GIB = 1024**3
SHARE_ID = "0b5e7c1a-2f4d-4e8b-9a6c-3d2f1e0a9b8c"  # the API server wants shareIDs as UUIDs


def spec_devices(plugin: Running, claim: Obj) -> dict[str, dict[str, str]]:
    """The per-device variables of the claim's spec (key → field → value); the spec has no
    edits of its own, since a runtime would apply them to every container of every request."""
    specs = plugin.app.state.cdi.specs
    spec = load_spec(specs.spec_path(claim["metadata"]["uid"]))
    assert spec.container_edits.is_empty()
    entries = [e for device in spec.devices for e in device.container_edits.env]
    env = dict(e.partition("=")[::2] for e in entries)
    assert "CUDA_VISIBLE_DEVICES" not in env
    return device_env(env)


def test_exclusive_gpu_gets_a_cdi_spec_naming_the_gpu(
    plugin: Running, claims: ClaimMaker, fake_node: Node, node_name: str, namespace: str
) -> None:
    claim = claims("c1", results=[result("gpu-0", pool=node_name)])
    uid = claim["metadata"]["uid"]
    answer = plugin.client.prepare([ref(claim)])[uid]
    assert answer.error == ""
    assert answer.devices == [
        {
            "request_names": ["gpu"],
            "pool": node_name,
            "device": "gpu-0",
            "cdi_device_ids": [f"k8s.gpu.gpuslice.dev/claim={uid}-gpu-0"],
        }
    ]
    gpu0 = fake_node.nvml.gpu(0)
    assert spec_devices(plugin, claim) == {
        "GPU_0": {
            "UUID": gpu0.uuid,
            "DEVICE": "gpu-0",
            "CLAIM": f"{namespace}/c1",
            "CLAIM_UID": uid,
            "REQUEST": "gpu",
            "CORES": "100",
            "MEMORY": str(gpu0.memory_total_bytes),
            "ENFORCEMENT": "exclusive",
        }
    }
    record = plugin.app.state.committer.read().claims[uid]
    assert record.state == "PrepareCompleted"


def test_share_takes_its_limits_from_consumed_capacity(
    plugin: Running, claims: ClaimMaker, node_name: str
) -> None:
    claim = claims(
        "s",
        results=[result("gpu-1", pool=node_name, cores="30", memory="20Gi", share_id=SHARE_ID)],
    )
    uid = claim["metadata"]["uid"]
    answer = plugin.client.prepare([ref(claim)])[uid]
    assert answer.error == ""
    assert answer.devices[0]["share_id"] == SHARE_ID
    assert answer.devices[0]["cdi_device_ids"] == [
        f"k8s.gpu.gpuslice.dev/claim={uid}-gpu-1-{SHARE_ID}"
    ]
    # a shared device's variables carry the share ID: two shares of one GPU never collide
    device = spec_devices(plugin, claim)["GPU_1_" + SHARE_ID.upper().replace("-", "_")]
    assert (device["CORES"], device["MEMORY"]) == ("30", str(20 * GIB))
    assert device["ENFORCEMENT"] == "none"  # no enforcer: accounting only


def test_one_bad_claim_never_fails_the_others(
    plugin: Running, claims: ClaimMaker, node_name: str, namespace: str
) -> None:
    good = claims("good", results=[result("gpu-0", pool=node_name)])
    unallocated = claims("unallocated")
    other_driver = claims(
        "other-driver", results=[result("x", pool=node_name, driver="x.example.com")]
    )
    other_pool = claims("other-pool", results=[result("gpu-1", pool="node-b")])
    bad_config = claims(
        "bad-config",
        results=[result("gpu-1", pool=node_name)],
        config=[gpu_config(limits={"cores": 150}, sharing={"strategy": "Fast"})],
    )
    unknown = claims("unknown-device", results=[result("gpu-9", pool=node_name)])
    missing = (namespace, "missing", "0000-missing")
    answers = plugin.client.prepare(
        [ref(c) for c in (good, unallocated, other_driver, other_pool, bad_config, unknown)]
        + [missing]
    )
    assert len(answers) == 7
    assert answers[good["metadata"]["uid"]].error == ""
    assert answers[good["metadata"]["uid"]].devices[0]["device"] == "gpu-0"

    def error(claim: Obj) -> str:
        return answers[claim["metadata"]["uid"]].error

    assert error(unallocated) == f"ResourceClaim {namespace}/unallocated is not allocated"
    assert "no device allocated by driver gpu.gpuslice.dev" in error(other_driver)
    assert "x.example.com" in error(other_driver)
    assert f"allocated from pool node-b, but this plugin serves pool {node_name}" in error(
        other_pool
    )
    assert "limits.cores: 150 is not allowed" in error(bad_config)
    assert "allowed: an integer 1..100" in error(bad_config)
    assert "sharing.strategy: 'Fast'" in error(bad_config)
    assert "gpu-9" in error(unknown) and "not published by this node" in error(unknown)
    assert answers["0000-missing"].error == f"ResourceClaim {namespace}/missing does not exist"
    errors = plugin.app.metrics.claim_errors
    assert errors.labels(op="prepare", reason="NotAllocated")._value.get() == 1
    assert errors.labels(op="prepare", reason="BadConfig")._value.get() == 1


def test_unknown_config_fields_are_named(
    plugin: Running, claims: ClaimMaker, node_name: str
) -> None:
    claim = claims(
        "typo",
        results=[result("gpu-0", pool=node_name)],
        config=[gpu_config(enforcment={"mode": "Hard"})],
    )
    error = plugin.client.prepare([ref(claim)])[claim["metadata"]["uid"]].error
    assert "unknown field 'enforcment'" in error
    assert "GpuConfig #0 (from the claim)" in error


def test_prepare_and_unprepare_are_idempotent(
    harness: Harness, claims: ClaimMaker, node_name: str, kube: RawApi, namespace: str
) -> None:
    raw = RecordingRawApi(harness.raw())
    plugin = harness.start(raw=raw)
    claim = claims("c", results=[result("gpu-0", pool=node_name)])
    uid = claim["metadata"]["uid"]
    first = plugin.client.prepare([ref(claim)])[uid]
    assert first.error == ""

    def reads() -> int:
        return len([p for p in raw.gets if p.endswith(f"/namespaces/{namespace}/resourceclaims/c")])

    before = reads()  # none when the claim cache had it already
    # the repeat is answered from the checkpoint: no API read (the claim is even gone from the
    # API now), no side effect
    delete_claim(kube, namespace, "c")
    spec = plugin.app.state.cdi.specs.spec_path(uid)
    written = spec.stat().st_mtime_ns
    assert plugin.client.prepare([ref(claim)])[uid] == first
    assert reads() == before
    assert spec.stat().st_mtime_ns == written
    assert plugin.client.unprepare([ref(claim)]) == {uid: ""}
    assert not plugin.app.state.cdi.exists(uid)
    assert plugin.client.unprepare([ref(claim)]) == {uid: ""}
    assert plugin.client.unprepare([(namespace, "never", "never-prepared")]) == {
        "never-prepared": ""
    }
    assert plugin.app.state.committer.read().claims == {}


def test_a_device_is_never_handed_out_beyond_its_capacity(
    plugin: Running, claims: ClaimMaker, node_name: str, namespace: str
) -> None:
    def share(cores: str, memory: str) -> list[Obj]:
        return [result("gpu-1", pool=node_name, cores=cores, memory=memory)]

    a = claims("a", results=[result("gpu-0", pool=node_name)])
    b = claims("b", results=[result("gpu-0", pool=node_name)])
    s1 = claims("s1", results=share("60", "40Gi"))
    s2 = claims("s2", results=share("30", "20Gi"))
    s3 = claims("s3", results=share("20", "1Gi"))
    mig1 = claims("m1", results=[result("gpu-2-mig-1g-10gb-0", pool=node_name)])
    mig2 = claims("m2", results=[result("gpu-2-mig-1g-10gb-0", pool=node_name)])
    answers = plugin.client.prepare([ref(c) for c in (a, s1, s2, mig1)])
    assert all(x.error == "" for x in answers.values())
    later = plugin.client.prepare([ref(c) for c in (b, s3, mig2)])
    error = later[b["metadata"]["uid"]].error
    assert f"gpu-0 is already prepared for ResourceClaim {namespace}/a" in error
    error = later[s3["metadata"]["uid"]].error
    assert "with 90 cores and 60Gi; this claim's 20 cores and 1Gi do not fit" in error
    error = later[mig2["metadata"]["uid"]].error
    assert f"already prepared for ResourceClaim {namespace}/m1" in error
    # after a is unprepared, b fits
    plugin.client.unprepare([ref(a)])
    assert plugin.client.prepare([ref(b)])[b["metadata"]["uid"]].error == ""


def test_admin_access_is_exempt_from_the_overlap_check(
    plugin: Running, claims: ClaimMaker, node_name: str, kube: RawApi, namespace: str
) -> None:
    # the API server allows admin access only in namespaces labelled for it
    kube.patch(
        resource_path("v1", "namespaces", name=namespace),
        {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}},
    )
    a = claims("a", results=[result("gpu-0", pool=node_name)])
    admin = claims("admin", results=[result("gpu-0", pool=node_name, admin_access=True)])
    assert admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] is True
    answers = plugin.client.prepare([ref(a), ref(admin)])
    assert [x.error for x in answers.values()] == ["", ""]
    assert spec_devices(plugin, admin)["GPU_0"]["ADMIN_ACCESS"] == "true"


def test_static_mig_device(
    plugin: Running, claims: ClaimMaker, fake_node: Node, node_name: str
) -> None:
    claim = claims("m", results=[result("gpu-2-mig-3g-40gb-4", pool=node_name)])
    answer = plugin.client.prepare([ref(claim)])[claim["metadata"]["uid"]]
    assert answer.error == ""
    mig = next(m for m in fake_node.nvml.mig_devices(2) if m.profile == "3g.40gb")
    device = spec_devices(plugin, claim)["GPU_2_MIG_3G_40GB_4"]
    assert device["UUID"] == mig.uuid
    assert device["ENFORCEMENT"] == "mig"
    assert device["MEMORY"] == str(mig.memory_bytes)


def test_v1beta1_answers_without_share_ids(
    plugin: Running, claims: ClaimMaker, node_name: str
) -> None:
    client = DraClient(plugin.settings.sockets.dra, "v1beta1")
    try:
        claim = claims("b", results=[result("gpu-0", pool=node_name, cores="50", memory="10Gi")])
        answer = client.prepare([ref(claim)])[claim["metadata"]["uid"]]
        assert answer.error == ""
        assert "share_id" not in answer.devices[0]
        assert answer.devices[0]["cdi_device_ids"][0].startswith("k8s.gpu.gpuslice.dev/claim=")
        assert client.unprepare([ref(claim)]) == {claim["metadata"]["uid"]: ""}
    finally:
        client.close()


def test_config_limits_apply_without_consumable_capacity(
    plugin: Running, claims: ClaimMaker, node_name: str
) -> None:
    class_config = gpu_config(source="FromClass", limits={"cores": 10, "memory": "8Gi"})
    claim_config = gpu_config(limits={"cores": 25, "memory": "16Gi"})
    claim = claims(
        "cfg", results=[result("gpu-0", pool=node_name)], config=[claim_config, class_config]
    )
    assert plugin.client.prepare([ref(claim)])[claim["metadata"]["uid"]].error == ""
    device = spec_devices(plugin, claim)["GPU_0"]  # the claim's config wins over the class's
    assert (device["CORES"], device["MEMORY"]) == ("25", str(16 * GIB))

    too_big = claims(
        "big",
        results=[result("gpu-1", pool=node_name)],
        config=[gpu_config(limits={"memory": "100Gi"})],
    )
    error = plugin.client.prepare([ref(too_big)])[too_big["metadata"]["uid"]].error
    assert error == "limits.memory: 100Gi is not allowed for gpu-1; allowed 1Mi..79.6Gi"


def test_strict_enforcement_without_an_enforcer_is_refused(
    plugin: Running, claims: ClaimMaker, node_name: str
) -> None:
    claim = claims(
        "strict",
        results=[result("gpu-0", pool=node_name, cores="30", memory="20Gi")],
        config=[gpu_config(enforcement={"mode": "Hard", "strict": True})],
    )
    uid = claim["metadata"]["uid"]
    error = plugin.client.prepare([ref(claim)])[uid].error
    assert "enforcement mode Hard with strict: true needs the gpuslice enforcer" in error
    assert "--enforcer-socket is not set" in error
    assert uid not in plugin.app.state.committer.read().claims
    assert not plugin.app.state.cdi.exists(uid)


def test_uid_mismatch_is_reported(
    plugin: Running, claims: ClaimMaker, node_name: str, namespace: str
) -> None:
    claim = claims("re", results=[result("gpu-0", pool=node_name)])
    answer = plugin.client.prepare([(namespace, "re", "old-uid")])["old-uid"]
    assert f"has UID {claim['metadata']['uid']}, the kubelet asked for old-uid" in answer.error


def test_checkpoint_file_is_versioned_and_checksummed(
    plugin: Running, claims: ClaimMaker, node_name: str
) -> None:
    first = claims("c", results=[result("gpu-0", pool=node_name)])
    assert plugin.client.prepare([ref(first)])[first["metadata"]["uid"]].error == ""
    second = claims("d", results=[result("gpu-1", pool=node_name)])
    assert plugin.client.prepare([ref(second)])[second["metadata"]["uid"]].error == ""
    state_dir = plugin.settings.state_dir
    doc: dict[str, Any] = json.loads((state_dir / "kubelet-plugin.json").read_text())
    assert doc["kind"] == "kubelet-plugin"
    assert doc["schemaVersion"] == 2
    assert doc["bootId"] == "boot-1"
    assert doc["checksum"].startswith("sha256:")
    assert doc["data"]["claims"][first["metadata"]["uid"]]["state"] == "PrepareCompleted"
    # later commits append to the journal, which names the base it belongs to
    journal = (state_dir / "kubelet-plugin.json.journal").read_bytes().splitlines()
    assert all(x.startswith(b"sha256:") for x in journal)  # each line: checksum, then JSON
    lines = [json.loads(x.partition(b" ")[2]) for x in journal]
    assert lines[0]["base"] == doc["checksum"]
    assert (lines[0]["kind"], lines[0]["schemaVersion"], lines[0]["bootId"]) == (
        "kubelet-plugin",
        2,
        "boot-1",
    )
    put = lines[-1]["ops"][-1]
    assert put["put"] == second["metadata"]["uid"]
    assert put["value"]["state"] == "PrepareCompleted"
