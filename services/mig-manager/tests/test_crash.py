"""kill -9 of a real mig-manager process in the middle of a MIG change leaks nothing.

The process is made to SIGKILL itself at a failpoint (``failpoints``): right after the GPU
instance is created and before its compute instance, or between destroying the compute instance
and the GPU instance. After a restart the half-done change is settled before the socket opens.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpuslice_core.grpcserver import check_health
from gpuslice_mig_manager.failpoints import ENV as CRASH_ENV
from gpuslice_mig_manager.state import FILE_NAME
from gpuslice_nvml.fake import FakeNvml
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as pb
from gpuslice_protos.gpuslice.v1 import migmanager_pb2_grpc as pbgrpc
from gpuslice_testkit.core import ServiceProcess

pytestmark = pytest.mark.timeout(30)

NODE = """\
name: crash-{name}
statePath: fake-state.json
gpus:
  - model: A100-SXM4-40GB
    count: 2
    migEnabled: true
"""
_SCRUB = (
    "NODE_NAME",
    "GPUSLICE_NODE_NAME",
    "KUBECONFIG",
    "GPUSLICE_CONFIG_FILE",
    "GPUSLICE_CONFIG_MAP",
    "GPUSLICE_DYNAMIC_MIG",
    CRASH_ENV,
)


class Proc(ServiceProcess):
    """A mig-manager process on ``socket``."""

    def __init__(self, argv: list[str], env: dict[str, str], socket: Path, log: Path) -> None:
        self.socket = socket
        super().__init__(
            "gpuslice-mig-manager",
            argv,
            log=log,
            env=env,
            ready=lambda: check_health(socket, timeout=0.5),
        )

    def stub(self) -> tuple[grpc.Channel, pbgrpc.MigManagerStub]:
        channel = grpc.insecure_channel(f"unix://{self.socket}")
        return channel, pbgrpc.MigManagerStub(channel)


class Launcher:
    def __init__(self, config: Path, state_dir: Path, socket: Path) -> None:
        self.config, self.state_dir, self.socket = config, state_dir, socket
        self.procs: list[Proc] = []

    def start(self, crash_at: str | None = None) -> Proc:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        if crash_at:
            env[CRASH_ENV] = crash_at
        argv = [
            sys.executable,
            "-m",
            "gpuslice_mig_manager",
            "--nvml=fake",
            f"--fake-nvml-config={self.config}",
            f"--state-dir={self.state_dir}",
            f"--socket={self.socket}",
            "--metrics-addr=",
            "--health-addr=",
            "--dynamic-mig",
            "--reconcile-interval=0",
        ]
        log = self.state_dir.parent / f"mig-manager-{len(self.procs)}.log"
        proc = Proc(argv, env, self.socket, log)
        self.procs.append(proc)
        return proc.start(timeout=15)

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.stop(grace=10)


@pytest.fixture
def launcher(tmp_path: Path, short_dir: Path) -> Iterator[Launcher]:
    config = tmp_path / "node.yaml"
    config.write_text(NODE.format(name=tmp_path.name))
    launch = Launcher(config, tmp_path / "state", short_dir / "mm.sock")
    yield launch
    launch.stop_all()


def test_kill_between_create_gpu_instance_and_compute_instance(launcher: Launcher) -> None:
    fake = FakeNvml.from_config_file(launcher.config)
    gpu = fake.gpu(0).uuid
    crashing = launcher.start(crash_at="after-create-gpu-instance")
    channel, stub = crashing.stub()
    with channel, pytest.raises(grpc.RpcError) as died:
        stub.CreateInstance(
            pb.CreateInstanceRequest(
                gpu_uuid=gpu, profile_name="3g.20gb", placement_start=4, owner="claim-k"
            ),
            timeout=10,
        )
    assert died.value.code() == grpc.StatusCode.UNAVAILABLE
    assert crashing.wait(10) == -signal.SIGKILL
    # The crash point was reached: a GPU instance without a compute instance exists now.
    assert [gi.placement.start for gi in fake.gpu_instances(0)] == [4]
    assert fake.mig_devices(0) == []
    assert "create:" in (launcher.state_dir / FILE_NAME).read_text()

    restarted = launcher.start()

    assert fake.gpu_instances(0) == []  # rolled back before the socket opened
    channel, stub = restarted.stub()
    with channel:
        listed = stub.ListGpus(pb.ListGpusRequest(), timeout=5)
        assert [len(g.instances) for g in listed.gpus] == [0, 0]
        retry = stub.CreateInstance(
            pb.CreateInstanceRequest(
                gpu_uuid=gpu, profile_name="3g.20gb", placement_start=4, owner="claim-k"
            ),
            timeout=10,
        )
    assert retry.changed and retry.instance.placement.start == 4
    assert [d.profile for d in fake.mig_devices(0)] == ["3g.20gb"]
    assert "create:" not in (launcher.state_dir / FILE_NAME).read_text()
    assert "rolled back" in restarted.log.read_text()


def test_kill_between_destroying_compute_and_gpu_instance(launcher: Launcher) -> None:
    fake = FakeNvml.from_config_file(launcher.config)
    gpu = fake.gpu(1).uuid
    first = launcher.start()
    channel, stub = first.stub()
    with channel:
        made = stub.CreateInstance(
            pb.CreateInstanceRequest(gpu_uuid=gpu, profile_name="2g.10gb", owner="claim-d"),
            timeout=10,
        )
    launcher.stop_all()

    crashing = launcher.start(crash_at="after-destroy-compute-instance")
    channel, stub = crashing.stub()
    request = pb.DestroyInstanceRequest(
        gpu_uuid=gpu, gpu_instance_id=made.instance.gpu_instance_id, owner="claim-d"
    )
    with channel, pytest.raises(grpc.RpcError):
        stub.DestroyInstance(request, timeout=10)
    assert crashing.wait(10) == -signal.SIGKILL
    assert len(fake.gpu_instances(1)) == 1 and fake.mig_devices(1) == []

    restarted = launcher.start()

    assert fake.gpu_instances(1) == []
    channel, stub = restarted.stub()
    with channel:
        assert not stub.DestroyInstance(request, timeout=5).changed
    state = (launcher.state_dir / FILE_NAME).read_text()
    assert "claim-d" not in state and "destroy:" not in state
