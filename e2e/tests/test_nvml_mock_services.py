"""Node services with ``--nvml=real`` on the mock libnvidia-ml (issue 33, item 3, in part).

The enforcer runs as a real process on the real NVML backend, whose libnvidia-ml.so.1 is the
mock answering for a fake node, next to an enforcer with ``--nvml=fake`` on the same node: both
must describe the GPUs alike and serve shares alike. No control plane is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_nvml.fake import FakeNvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.enforcer import EnforcerProcess, remove_tree, share_request, short_tempdir
from gpuslice_testkit.nvml_mock import mock_nvml_env

NODE = """
name: mock-services-node
driverVersion: "615.20.01"
statePath: state.json
gpus:
  - model: L4
  - model: A100-SXM4-40GB
"""

pytestmark = pytest.mark.timeout(300)  # a cold cache builds the mock first


@pytest.fixture
def node() -> Iterator[Path]:
    directory = short_tempdir()
    config = directory / "node.yaml"
    config.write_text(NODE)
    yield config
    remove_tree(directory)


def capabilities(proc: EnforcerProcess) -> list[pb.GpuCapabilities]:
    with proc.channel() as channel:
        return list(proc.stub(channel).GetCapabilities(pb.GetCapabilitiesRequest()).gpus)


def test_the_enforcer_on_real_nvml_over_the_mock_answers_as_on_the_fake(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_fake = EnforcerProcess(node, node.parent / "fake", ["--mps=off"])
    for key, value in mock_nvml_env(node).items():
        monkeypatch.setenv(key, value)
    on_real = EnforcerProcess(node, node.parent / "real", ["--mps=off", "--nvml=real"])
    try:
        on_fake.start()
        on_real.start()
        assert capabilities(on_real) == capabilities(on_fake)
        uuid = FakeNvml.from_config_file(node).gpu(1).uuid
        with on_real.channel() as channel:
            stub = on_real.stub(channel)
            created = stub.CreateShare(share_request("uid-mock", uuid, cores=40))
            assert created.created
            assert [s.claim_uid for s in stub.GetUsage(pb.GetUsageRequest()).shares] == ["uid-mock"]
            assert stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-mock")).released
    finally:
        on_real.stop()
        on_fake.stop()
    assert "nvml=real" in " ".join(on_real.argv)
