"""The claim's CDI spec: every device carries all of its own edits, the spec none, so a
container gets exactly the devices of the requests it names and several claims compose."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Hook, load_spec, resolve
from gpuslice_core.driverroot import DriverRoot
from gpuslice_kubelet_plugin.cdispecs import CdiWriter, device_env
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord
from gpuslice_testkit.nvml_mock import CAPS_MAJOR, mig_cap_minor, write_driver_root

GIB = 1 << 30
HOOK = Hook(hook_name="createContainer", path="/bin/hook", args=["/bin/hook", "attach"])
ENFORCER = ContainerEdits(env=["CUDA_MPS_PIPE_DIRECTORY=/mps"], hooks=[HOOK])


def writer(tmp_path: Path) -> CdiWriter:
    dev = tmp_path / "driver" / "dev"
    dev.mkdir(parents=True)
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).touch()
    return CdiWriter(ClaimSpecs(tmp_path / "cdi"), driver=DriverRoot(tmp_path / "driver"))


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


def test_a_mig_device_gets_its_capability_nodes_and_every_device_the_drivers_files(
    tmp_path: Path,
) -> None:
    """What a real GPU container needs besides its node: the MIG instance's capability nodes
    (static: its own compute instance; made for the claim: its whole GPU instance), the
    driver's libraries, and NVIDIA_VISIBLE_DEVICES=void so NVIDIA's hook adds no GPU."""
    root = tmp_path / "driver"
    (root / "dev").mkdir(parents=True)
    (root / "dev" / "nvidia0").touch()
    lib = root / "usr/lib64"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.580.1").write_bytes(b"\x7fELF")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    caps = tmp_path / "proc" / "driver" / "nvidia" / "capabilities" / "gpu0" / "mig"
    for path, minor in (
        ("gi3", 30),
        ("gi3/ci0", 31),
        ("gi3/ci1", 32),
        ("gi5", 50),
        ("gi5/ci0", 51),
    ):
        (caps / path).mkdir(parents=True)
        (caps / path / "access").write_text(f"DeviceFileMinor: {minor}\n")
    (tmp_path / "proc" / "devices").write_text("241 nvidia-caps\n")
    root_driver = DriverRoot(root, proc=tmp_path / "proc")
    w = CdiWriter(ClaimSpecs(tmp_path / "cdi"), driver=root_driver)
    static = gpu(0, "small", device="gpu-0-mig-1c-0", kind="mig", uuid="MIG-a", cores=None)
    dynamic = gpu(0, "made", device="gpu-0-mig-3g-4", kind="mig", uuid="MIG-b", cores=None)
    dynamic.gpu_instance_id = 5
    ids = w.write(record("u1", static, dynamic, shared=False), {"GPU-0": 0}, {"MIG-a": (3, 1)})

    mine = resolve(tmp_path / "cdi", ids["u1-gpu-0-mig-1c-0"])
    assert [(n.path, n.major, n.minor) for n in mine.device_nodes] == [
        ("/dev/nvidia0", 0, 0),
        ("/dev/nvidia-caps/nvidia-cap30", 241, 30),
        ("/dev/nvidia-caps/nvidia-cap32", 241, 32),  # compute instance 1, not its sibling 0
    ]
    made = resolve(tmp_path / "cdi", ids["u1-gpu-0-mig-3g-4"])
    assert [n.minor for n in made.device_nodes[1:]] == [50, 51]
    assert "NVIDIA_VISIBLE_DEVICES=void" in mine.env
    assert {m.container_path: m.host_path for m in mine.mounts} == {
        f"{d}/{name}": str(lib / "libcuda.so.580.1")
        for d in root_driver.system_library_dirs()
        for name in ("libcuda.so.1", "libcuda.so.580.1")
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of character devices needs root")
def test_on_a_driver_root_of_files_a_mig_device_gets_nodes_the_runtime_accepts(
    tmp_path: Path,
) -> None:
    """The layout the real-node tier runs the node pods on (gpuslice_testkit.nvml_mock.
    write_driver_root): every node of a MIG device's edits is a character device on the host
    (containerd's CDI stats a node with a host path and refuses a regular file), its capability
    nodes carry the nvidia-caps major from the root's procfs, and the mounts are the root's
    stand-in libraries, libnvidia-ml being the mock."""
    config = tmp_path / "node.yaml"
    config.write_text(
        "gpus:\n  - model: A100-SXM4-40GB\n    migEnabled: true\n"
        "    migInstances: [{profile: 3g.20gb}]\n"
    )
    files = write_driver_root(tmp_path / "root", config, "node-a", tmp_path / "state")
    w = CdiWriter(ClaimSpecs(tmp_path / "cdi"), driver=DriverRoot(files.root, proc=files.proc))
    mig = gpu(0, "slice", device="gpu-0-mig-3g.20gb-0", kind="mig", uuid="MIG-a", cores=None)
    ids = w.write(record("u1", mig, shared=False), {"GPU-0": 0}, {"MIG-a": (1, 0)})

    edits = resolve(tmp_path / "cdi", ids["u1-gpu-0-mig-3g.20gb-0"])
    nodes = {n.path: n for n in edits.device_nodes}
    assert list(nodes) == [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        f"/dev/nvidia-caps/nvidia-cap{mig_cap_minor(0, 1)}",
        f"/dev/nvidia-caps/nvidia-cap{mig_cap_minor(0, 1, 0)}",
    ]
    for node in nodes.values():
        if node.host_path:  # the runtime stats the host's node
            assert stat.S_ISCHR(Path(node.host_path).stat().st_mode), node
        else:  # made by the runtime from the spec's numbers
            assert (node.type, node.major) == ("c", CAPS_MAJOR)
            host = files.root / node.path.lstrip("/")
            assert files.devices[host] == (CAPS_MAJOR, node.minor)
    mounts = {m.container_path: m.host_path for m in edits.mounts}
    lib = "/usr/lib/x86_64-linux-gnu"
    assert mounts[f"{lib}/libnvidia-ml.so.1"] == str(files.library)
    assert mounts[f"{lib}/libcuda.so.1"] == str(
        files.root / lib.lstrip("/") / "libcuda.so.570.158.01"
    )
    assert f"{lib}/gpuslice-nvml-mock-node.json" not in mounts  # the mock's node stays home
    assert mounts["/usr/bin/nvidia-smi"] == str(files.root / "usr/bin/nvidia-smi")
