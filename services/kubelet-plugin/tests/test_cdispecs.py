"""The claim's CDI spec: every device carries all of its own edits, the spec none, so a
container gets exactly the devices of the requests it names and several claims compose."""

from __future__ import annotations

from pathlib import Path

from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Hook, load_spec, resolve
from gpuslice_kubelet_plugin.cdispecs import CdiWriter, device_env
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord

GIB = 1 << 30
HOOK = Hook(hook_name="createContainer", path="/bin/hook", args=["/bin/hook", "attach"])
ENFORCER = ContainerEdits(env=["CUDA_MPS_PIPE_DIRECTORY=/mps"], hooks=[HOOK])


def writer(tmp_path: Path) -> CdiWriter:
    dev = tmp_path / "driver" / "dev"
    dev.mkdir(parents=True)
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).touch()
    return CdiWriter(ClaimSpecs(tmp_path / "cdi"), dev_root=tmp_path / "driver")


def record(uid: str, *devices: DeviceRecord, shared: bool = True) -> ClaimRecord:
    return ClaimRecord(
        uid=uid,
        namespace="ns",
        name=f"claim-{uid}",
        state="PrepareCompleted",
        owner="me",
        devices=list(devices),
        enforcement="soft",
        enforcer_share_id="sh-1" if shared else "",
        enforcer_edits=ENFORCER.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        if shared
        else {},
        memory_mechanism="watchdog" if shared else "",
        cores_mechanism="watchdog" if shared else "",
    )


def gpu(index: int, request: str, **kw: object) -> DeviceRecord:
    values: dict[str, object] = {
        "request": request,
        "pool": "node-a",
        "device": f"gpu-{index}",
        "gpu_uuid": f"GPU-{index}",
        "uuid": f"GPU-{index}",
        "cores": 100,
        "memory_bytes": 40 * GIB,
    }
    values.update(kw)
    return DeviceRecord.model_validate(values)


def test_each_device_carries_its_own_node_variables_and_enforcement(tmp_path: Path) -> None:
    w = writer(tmp_path)
    claim = record(
        "u1",
        gpu(0, "whole"),
        gpu(1, "share", cores=30, memory_bytes=4 * GIB, share_id="s-1", shared=True),
    )
    ids = w.write(claim, {"GPU-0": 0, "GPU-1": 1})
    spec = load_spec(w.specs.spec_path("u1"))
    assert spec.container_edits.is_empty()

    whole = resolve(tmp_path / "cdi", ids["u1-gpu-0"])
    assert [n.path for n in whole.device_nodes] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert whole.hooks == [] and "CUDA_MPS_PIPE_DIRECTORY=/mps" not in whole.env
    env = dict(e.split("=", 1) for e in whole.env)
    assert device_env(env) == {
        "GPU_0": {
            "UUID": "GPU-0",
            "DEVICE": "gpu-0",
            "CLAIM": "ns/claim-u1",
            "CLAIM_UID": "u1",
            "REQUEST": "whole",
            "CORES": "100",
            "MEMORY": str(40 * GIB),
            "ENFORCEMENT": "exclusive",
        }
    }

    share = resolve(tmp_path / "cdi", ids["u1-gpu-1-s-1"])
    assert [n.path for n in share.device_nodes] == ["/dev/nvidia1", "/dev/nvidiactl"]
    assert share.hooks == [HOOK] and "CUDA_MPS_PIPE_DIRECTORY=/mps" in share.env
    fields = device_env(dict(e.split("=", 1) for e in share.env))["GPU_1_S_1"]
    assert (fields["CORES"], fields["ENFORCEMENT"], fields["SHARE_ID"]) == ("30", "soft", "sh-1")


def test_two_claims_in_one_container_keep_every_value(tmp_path: Path) -> None:
    w = writer(tmp_path)
    a = w.write(record("a", gpu(0, "gpu"), shared=False), {"GPU-0": 0})
    b = w.write(record("b", gpu(1, "gpu"), shared=False), {"GPU-1": 1})
    # strict: a variable two devices set to different values would raise
    edits = resolve(tmp_path / "cdi", [*a["a-gpu-0"], *b["b-gpu-1"]], strict=True)
    got = device_env(dict(e.split("=", 1) for e in edits.env))
    assert {k: (v["UUID"], v["CLAIM"]) for k, v in got.items()} == {
        "GPU_0": ("GPU-0", "ns/claim-a"),
        "GPU_1": ("GPU-1", "ns/claim-b"),
    }
    assert [n.path for n in edits.device_nodes] == [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia1",
    ]


def test_records_from_before_devices_were_marked_shared_keep_their_hooks(
    tmp_path: Path,
) -> None:
    """A checkpoint written by an older plugin has no ``shared`` flags; a lost spec rewritten
    from it still puts the enforcer's hook on the claim's GPUs."""
    w = writer(tmp_path)
    legacy = record("old", gpu(0, "gpu", cores=30))
    ids = w.write(legacy, {"GPU-0": 0})
    assert resolve(tmp_path / "cdi", ids["old-gpu-0"]).hooks == [HOOK]
