"""The CDI section of the GPU stage on a fake node: the spec is the plugin's, a missing host path
is named, and the probe really sees only what the spec gives (nodes, mounts, env)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e.gpustage import cdicheck
from e2e.gpustage.cdicheck import CdiResult, check_cdi
from gpuslice_core.cdi import ClaimSpecs, load_spec
from gpuslice_core.driverroot import DriverRoot
from gpuslice_kubelet_plugin.cdispecs import CdiWriter, device_env
from gpuslice_kubelet_plugin.checkpoint import ClaimRecord, DeviceRecord
from gpuslice_nvml import GpuInfo
from gpuslice_nvml.fake import FakeNvml

pytestmark = pytest.mark.timeout(20)

TWO_GPUS = "gpus:\n  - model: NVIDIA H100 80GB HBM3\n  - model: L4\n"
ONE_GPU = "gpus:\n  - model: L4\n"
MINOR_OFFSET = 4  # the fake's minors are its indexes; shifted, a mix-up of the two shows
NODES = ("nvidia0", "nvidia1", "nvidia4", "nvidia5", "nvidiactl", "nvidia-uvm")
EXTRAS = ["null", "shm", "urandom", "zero"]

#: Stands in for ``python -m e2e.gpustage.workload probe``: "sees" the GPUs whose UUIDs its
#: environment names, and reports what it found in /dev, its environment as exec'd, what the
#: MPS directory holds and whether /dev and that directory take writes.
STANDIN = r"""
import json, os, sys, time
mode = sys.argv[1]
env = dict(e.split("=", 1) for e in open("/proc/self/environ").read().split("\0") if e)
uuids = [v for k, v in env.items() if k.startswith("GPUSLICE_") and k.endswith("_UUID")]

def write_error(path):
    try:
        open(path, "w").close()
    except OSError as exc:
        return exc.strerror
    return None

def read(path):
    try:
        return open(path).read()
    except OSError as exc:
        return exc.strerror

mps = env.get("CUDA_MPS_PIPE_DIRECTORY")
out = {
    "files": {path: read(path) for path in sys.argv[2:]},
    "ok": True,
    "devices": [{"ordinal": i, "uuid": u} for i, u in enumerate(uuids)],
    "dev": sorted(os.listdir("/dev")),
    "env": env,
    "nodes": {n: open(f"/dev/{n}").read() for n in os.listdir("/dev") if n.startswith("nvidia")},
    "dev_write": write_error("/dev/made-by-probe"),
    "mps": sorted(os.listdir(mps)) if mps else None,
    "mps_write": write_error(f"{mps}/made-by-probe") if mps else None,
}
print(json.dumps({"stage": "start"}))
if mode == "two":
    out["devices"].append({"ordinal": 1, "uuid": "GPU-another"})
if mode == "fail":
    print(json.dumps({"ok": False, "stage": "context", "error": "no CUDA here"}))
    sys.exit(3)
if mode == "sleep":
    time.sleep(60)
print(json.dumps(out))
"""

#: Runs check_cdi where the caller's mounts propagate (as on a systemd host, where / is shared):
#: in a mount namespace of its own (so this test's host is never touched) made recursively
#: shared; prints the mounts that appeared in it while the check ran.
SHARED_CALLER = r"""
import ctypes, json, sys
from pathlib import Path
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x20000) == 0
assert libc.mount(None, b"/", None, 0x4000 | 0x40000, None) == 0  # MS_REC | MS_PRIVATE
assert libc.mount(None, b"/", None, 0x4000 | 0x100000, None) == 0  # MS_REC | MS_SHARED
from e2e.gpustage.cdicheck import check_cdi
from gpuslice_nvml import open_nvml
config, dev_root, workdir, probe_cmd = sys.argv[1:]
before = Path("/proc/self/mountinfo").read_text().splitlines()
with open_nvml("fake", config) as nvml:
    results = check_cdi(
        nvml, probe_cmd=json.loads(probe_cmd), workdir=Path(workdir), dev_root=Path(dev_root)
    )
after = Path("/proc/self/mountinfo").read_text().splitlines()
print(json.dumps({
    "shared": sum("shared:" in line for line in before),
    "statuses": [r.status for r in results],
    "appeared": [line for line in after if line not in before],
}))
"""


def probe(mode: str = "ok", *read: Path) -> list[str]:
    """The stand-in probe; it also reports what each file in ``read`` holds, as it sees it."""
    return [sys.executable, "-c", STANDIN, mode, *map(str, read)]


def _can_isolate() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    code = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x20000) != 0)"
    if subprocess.run([sys.executable, "-c", code], check=False).returncode != 0:
        return "unshare(CLONE_NEWNS) is refused here"
    return None


isolation = pytest.mark.skipif(
    (why := _can_isolate()) is not None, reason=f"the isolation tests: {why}"
)


class ShiftedMinors(FakeNvml):
    """The fake node, with minors that differ from the indexes (as on many real boxes)."""

    def gpu(self, index: int) -> GpuInfo:
        return dataclasses.replace(super().gpu(index), minor=index + MINOR_OFFSET)


def fake_nvml(tmp_path: Path, gpus: str) -> FakeNvml:
    config = tmp_path / "node.yaml"
    config.write_text(f"name: cdi-node\n{gpus}statePath: {tmp_path / 'nvml-state.json'}\n")
    return ShiftedMinors.from_config_file(config)


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    """The driver root: ``dev/`` holds regular files named like the nodes, each saying which
    host node it is (nvidia0 and nvidia1 are decoys: the GPUs' minors are 4 and 5)."""
    dev = tmp_path / "driver" / "dev"
    dev.mkdir(parents=True)
    for name in NODES:
        (dev / name).write_text(f"host {name}")
    return tmp_path / "driver"


def run(tmp_path: Path, dev_root: Path, gpus: str = TWO_GPUS, **kw: Any) -> list[CdiResult]:
    kw.setdefault("probe_cmd", probe())
    nvml = fake_nvml(tmp_path, gpus)
    return check_cdi(nvml, workdir=tmp_path / "work", dev_root=dev_root, **kw)


def by_kind(results: list[CdiResult], kind: str) -> list[CdiResult]:
    return [r for r in results if r.kind == kind]


def spec_env(result: CdiResult) -> dict[str, str]:
    return dict(e.split("=", 1) for e in result.env)


def mountinfo() -> list[str]:
    return Path("/proc/self/mountinfo").read_text().splitlines()


def test_the_spec_is_the_one_the_plugins_writer_gives(tmp_path: Path, dev_root: Path) -> None:
    nvml = fake_nvml(tmp_path, TWO_GPUS)
    results = check_cdi(nvml, probe_cmd=probe(), workdir=tmp_path / "work", dev_root=dev_root)
    gpus = nvml.gpus()
    assert [(r.gpu, r.kind) for r in results] == [
        (0, "whole"),
        (0, "shared"),
        (1, "whole"),
        (1, "shared"),
    ]
    driver = DriverRoot(dev_root, host=dev_root)
    ours = CdiWriter(ClaimSpecs(tmp_path / "ours"), driver=driver)
    for gpu, whole in zip(gpus, by_kind(results, "whole"), strict=True):
        spec = load_spec(whole.spec_path)
        [device] = spec.devices
        assert device.name == f"{whole.claim_uid}-gpu-{gpu.index}"
        fields = device_env(spec_env(whole))[f"GPU_{gpu.index}"]
        assert fields["UUID"] == gpu.uuid and fields["ENFORCEMENT"] == "exclusive"
        record = ClaimRecord(
            uid=whole.claim_uid,
            namespace="gpustage",
            name=f"whole-gpu-{gpu.index}",
            state="PrepareCompleted",
            owner="test",
            devices=[
                DeviceRecord(
                    request="whole",
                    pool="gpustage",
                    device=f"gpu-{gpu.index}",
                    gpu_uuid=gpu.uuid,
                    uuid=gpu.uuid,
                    cores=100,
                    memory_bytes=int(fields["MEMORY"]),
                )
            ],
            enforcement="exclusive",
        )
        [expected] = ours.render(record, {gpu.uuid: gpu.minor})
        assert device == expected
        host = dev_root / "dev"
        assert whole.device_nodes == [
            {
                "path": f"/dev/nvidia{gpu.index + MINOR_OFFSET}",
                "hostPath": str(host / f"nvidia{gpu.index + MINOR_OFFSET}"),
            },
            {"path": "/dev/nvidiactl", "hostPath": str(host / "nvidiactl")},
            {"path": "/dev/nvidia-uvm", "hostPath": str(host / "nvidia-uvm")},
        ]
        assert whole.omitted_nodes == ["/dev/nvidia-uvm-tools"]
        assert whole.missing_host_paths == []
    for shared in by_kind(results, "shared"):
        assert shared.status == "skipped" and not shared.ok
        assert shared.reason.startswith("skipped: no enforcer share edits")


@isolation
def test_the_probe_sees_only_the_specs_nodes_and_env(tmp_path: Path, dev_root: Path) -> None:
    before = mountinfo()
    results = by_kind(run(tmp_path, dev_root), "whole")
    assert mountinfo() == before  # the parent's mounts are untouched
    for result in results:
        assert result.status == "pass", result.reason
        assert result.probe is not None
        minor = f"nvidia{result.gpu + MINOR_OFFSET}"
        spec_nodes = [minor, "nvidiactl", "nvidia-uvm"]
        assert result.probe["dev"] == sorted([*spec_nodes, *EXTRAS]) == result.dev
        assert result.added_for_process == ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/shm"]
        # each node is the host's own file bound in, not an empty stand-in
        assert result.probe["nodes"] == {n: f"host {n}" for n in spec_nodes}
        assert result.probe["dev_write"] == "Read-only file system"
        assert result.probe["env"] == {**result.process_env, **spec_env(result)}
        assert set(result.process_env) <= {"PATH", "HOME", "PYTHONPATH", "LD_LIBRARY_PATH"}
        assert not set(result.process_env) & set(spec_env(result))
    assert not (dev_root / "dev" / "made-by-probe").exists()


@isolation
def test_the_driver_comes_from_the_spec_and_its_other_files_are_masked(
    tmp_path: Path, dev_root: Path
) -> None:
    lib = dev_root / "usr" / "lib64"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.580.1").write_text("libcuda")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    (lib / "libnvidia-ml.so.580.1").write_text("nvml")
    (lib / "libnvidia-glcore.so.580.1").write_text("glcore")  # a driver file the spec leaves out
    (lib / "libz.so.1").write_text("zlib")  # not the driver's
    read = [lib / name for name in ("libcuda.so.1", "libnvidia-ml.so.580.1")]
    read += [lib / "libnvidia-glcore.so.580.1", lib / "libz.so.1"]
    [whole, _] = run(tmp_path, dev_root, gpus=ONE_GPU, probe_cmd=probe("ok", *read))
    assert whole.status == "pass", whole.reason
    assert whole.reason.endswith("the driver's other 1 file(s) masked")
    sources = {m["hostPath"] for m in whole.mounts}
    assert sources == {str(lib / "libcuda.so.580.1"), str(lib / "libnvidia-ml.so.580.1")}
    assert whole.masked_driver_files == [str(lib / "libnvidia-glcore.so.580.1")]
    assert whole.probe is not None
    assert whole.probe["files"] == dict(
        zip(map(str, read), ["libcuda", "nvml", "", "zlib"], strict=True)
    )
    # the copies at the container's own paths: the host's root lacks them, so not placed, said
    targets = [m["containerPath"] for m in whole.mounts if not Path(m["containerPath"]).exists()]
    assert targets and whole.unplaced_mounts == targets
    assert any("driver mount(s) not placed" in note for note in whole.notes)
    assert (lib / "libnvidia-glcore.so.580.1").read_text() == "glcore"  # only in the probe's view


@isolation
def test_nothing_leaks_to_a_caller_whose_mounts_propagate(tmp_path: Path, dev_root: Path) -> None:
    fake_nvml(tmp_path, ONE_GPU)  # writes the config; the caller opens it (minor 0: nvidia0)
    args = [str(tmp_path / "node.yaml"), str(dev_root), str(tmp_path / "work"), json.dumps(probe())]
    done = subprocess.run(
        [sys.executable, "-c", SHARED_CALLER, *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cdicheck.REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(cdicheck.REPO_ROOT)},
        timeout=15,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["shared"] > 0  # the caller's mounts do propagate
    assert seen["statuses"] == ["pass", "skipped"]
    assert seen["appeared"] == []


@isolation
def test_a_shared_claim_gets_the_enforcers_env_and_mounts(tmp_path: Path, dev_root: Path) -> None:
    pipe, target = tmp_path / "mps-host", tmp_path / "mps-container"
    pipe.mkdir()
    (pipe / "control").touch()
    target.mkdir()
    edits = {
        "env": [f"CUDA_MPS_PIPE_DIRECTORY={target}"],
        "mounts": [
            {
                "hostPath": str(pipe),
                "containerPath": str(target),
                "options": ["rbind", "ro", "nosuid", "nodev"],
            }
        ],
        "hooks": [{"hookName": "createContainer", "path": sys.executable, "args": ["hook"]}],
    }
    results = run(tmp_path, dev_root, shared_edits={0: edits})
    [shared, skipped] = by_kind(results, "shared")
    assert shared.status == "pass", shared.reason
    assert skipped.gpu == 1 and skipped.status == "skipped"
    env = spec_env(shared)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(target)
    [fields] = device_env(env).values()
    assert fields["SHARE_ID"] and fields["CORES"] == "50" and fields["DEVICE"] == "gpu-0"
    assert shared.hooks == [
        {"hookName": "createContainer", "path": sys.executable, "args": ["hook"], "exists": True}
    ]
    assert shared.notes == ["1 hook(s) checked, not run: they need an OCI state"]
    assert shared.probe is not None
    assert shared.probe["mps"] == ["control"]  # the host's directory, bound in
    assert shared.probe["mps_write"] == "Read-only file system"  # with its options
    assert list(target.iterdir()) == []  # and only in the probe's namespace


def test_a_missing_host_path_is_named_and_nothing_runs(tmp_path: Path, dev_root: Path) -> None:
    gone = tmp_path / "gone"
    edits = {
        "deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap1", "hostPath": f"{gone}/cap1"}],
        "mounts": [{"hostPath": f"{gone}/mps", "containerPath": "/var/run/mps"}],
        "hooks": [{"hookName": "createContainer", "path": f"{gone}/hook"}],
    }
    (dev_root / "dev" / "nvidia-uvm").unlink()
    results = run(tmp_path, dev_root, gpus=ONE_GPU, shared_edits={0: edits})
    [whole, shared] = results
    assert whole.omitted_nodes == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert shared.missing_host_paths == [f"{gone}/cap1", f"{gone}/mps", f"{gone}/hook"]
    assert shared.status == "fail" and shared.probe is None and shared.dev == []
    assert f"{gone}/cap1" in shared.reason
    assert shared.hooks[0]["exists"] is False


@isolation
@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("two", "CUDA saw 2 device(s)"),
        ("fail", "CUDA did not start with only the spec's edits (exit 3, stage context): no CUDA"),
        ("sleep", "the probe did not finish within 1 s"),
    ],
)
def test_the_judge(tmp_path: Path, dev_root: Path, mode: str, reason: str) -> None:
    [whole, _] = run(tmp_path, dev_root, gpus=ONE_GPU, probe_cmd=probe(mode), timeout_s=1)
    assert whole.status == "fail" and not whole.ok
    assert whole.reason.startswith(reason), whole.reason


def test_without_root_the_probe_is_skipped_not_passed(
    tmp_path: Path, dev_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    [whole, _] = run(tmp_path, dev_root, gpus=ONE_GPU)
    assert whole.status == "skipped" and not whole.ok and whole.probe is None
    assert whole.reason.startswith("skipped: not root")
    assert whole.device_nodes and whole.missing_host_paths == []  # the spec is still checked
    assert whole.to_json()["ok"] is False
