"""Node services with ``--nvml=real`` on the mock libnvidia-ml (issue 33, item 3).

Each service runs twice as a real process on one fake node: once on the fake backend
(``--nvml=fake``), once on the real backend whose libnvidia-ml.so.1 is the mock answering for
the same node and state file (``backend="mock"`` of the sandbox's starters). What a user sees
must be the same:

* the enforcer: equal ``GetCapabilities``; the one on the mock serves a share (no control plane);
  an MPS share on each, with the fake's stand-in control daemon, is the same share: the same
  container edits, namespace limits, compute mode, client listed (by the mock's MPS process
  list on the real backend) and daemon stopped at release;
* the kubelet plugin: the same ResourceSlice devices; a pod's claim on the mock node is
  prepared (CDI spec written) and the container gets the GPU;
* the MIG manager: the same ``ListGpus``; static layouts applied through the one on the mock,
  with and without a MIG mode change (the GPU reset by the stand-in ``nvidia-smi``), are what
  both then list;
* the device plugin: registers with the node agent and lists the same devices.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict

from e2e.sandbox import procs
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.gpunode import (
    RESOURCE,
    GpuNode,
    claim_template,
    gpu_pod,
    on_gpu,
    pod_devices,
    start_gpu_node,
    stop_gpu_node,
)
from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import wait_for, wait_pod_phase
from e2e.sandbox.nodeservices import NodeServices
from e2e.support.device_plugin import MODE, start_plugin
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_nvml.fake import FakeNvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_protos.gpuslice.v1 import enforcer_pb2_grpc as pb_grpc
from gpuslice_protos.gpuslice.v1 import migmanager_pb2 as mig
from gpuslice_testkit.device_plugin import write_node
from gpuslice_testkit.enforcer import (
    Cgroups,
    EnforcerProcess,
    Workload,
    remove_tree,
    run_hook,
    share_request,
    short_tempdir,
)
from gpuslice_testkit.nvml_mock import NvmlBackend, mock_library_dir

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)

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


def test_the_enforcer_on_real_nvml_over_the_mock_answers_as_on_the_fake(node: Path) -> None:
    on_fake = EnforcerProcess(node, node.parent / "fake", ["--mps=off"])
    on_real = EnforcerProcess(node, node.parent / "real", ["--mps=off"], backend="mock")
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
    assert "--nvml=real" in on_real.argv


MPS_NODE = """
name: mps-mock-node
driverVersion: "615.20.01"
statePath: state.json
gpus:
  - model: H100-SXM5-80GB
"""
GIB = 1 << 30


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the MPS client runs in cgroups")
def test_an_mps_share_on_the_mock_is_the_share_on_the_fake() -> None:
    """The enforcer with MPS (protocol 3, driver 615) and the stand-in control daemon, on two
    nodes of one config (same GPUs), one per backend: what a user sees is the same."""
    on_fake = an_mps_share("fake")
    on_mock = an_mps_share("mock")
    assert on_mock == on_fake, "\n".join(differences(on_mock, on_fake))
    [gpu] = on_mock["capabilities"]
    assert gpu["mpsProtocol3"]["available"], gpu["mpsProtocol3"]["reason"]
    assert gpu["level"] == "ENFORCEMENT_LEVEL_HARD"
    created = on_mock["created"]
    assert created["level"] == "ENFORCEMENT_LEVEL_HARD"
    assert [lim["mechanism"] for lim in created["limits"]] == ["MECHANISM_MPS_PROTOCOL3"] * 2
    env = dict(e.split("=", 1) for e in created["containerEdits"]["env"])
    [mount] = created["containerEdits"]["mounts"]
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == mount["containerPath"]
    assert mount["hostPath"] == "<mps>/0/gpuslice/<share>"
    assert on_mock["namespace"] == {
        "active_thread_percentage": 30,
        "pinned_memory_limit": "8192M",
        "client_priority": None,
    }
    assert on_mock["compute mode"] == ["EXCLUSIVE_PROCESS", "DEFAULT"]
    assert on_mock["MPS clients"] == ["the client"]
    # the client's memory, and no bypass: the enforcer on the mock found the client in the
    # MPS process list (nvmlDeviceGetMPSComputeRunningProcesses) and spared it
    assert on_mock["memory used"] == GIB
    assert on_mock["violations, kills"] == [0, 0] and on_mock["client alive"]
    assert on_mock["daemon"] == ["started", "stopped"]


def spared(stub: pb_grpc.EnforcerStub, since: list[float]) -> pb.DeviceUsage | None:
    """The share's device usage half a second of watchdog samples (0.1 s apart) after the
    first that saw memory in use (kept in ``since``), time enough to kill a bypass (two
    periods); None before."""
    share = stub.GetUsage(pb.GetUsageRequest()).shares[0]
    device, at = share.devices[0], share.sampled_at.ToDatetime().timestamp()
    if device.memory_used_bytes and not since:
        since.append(at)
    return device if since and at - since[0] >= 0.5 else None


def an_mps_share(backend: NvmlBackend) -> dict[str, Any]:
    """An MPS share of 30 % and 8 GiB of GPU 0 on a fresh node, its client (a fake CUDA
    process in the claim's container reaching the share's namespace) and its release, through
    the enforcer on ``backend``: what a user sees, with this run's paths and ids replaced."""
    directory = short_tempdir()
    config = directory / "node.yaml"
    config.write_text(MPS_NODE)
    fake = FakeNvml.from_config_file(config)
    proc = EnforcerProcess(config, directory, ["--memory-partitioning=off"], backend=backend)
    pipe = proc.mps_root / "0"
    seen: dict[str, Any] = {"compute mode": [], "daemon": []}
    client: Workload | None = None
    try:
        with Cgroups() as cgroups:
            proc.start()
            with proc.channel() as channel:
                stub = proc.stub(channel)
                caps = stub.GetCapabilities(pb.GetCapabilitiesRequest()).gpus
                seen["capabilities"] = [MessageToDict(g) for g in caps]
                reply = stub.CreateShare(
                    share_request("uid-mps", fake.gpu(0).uuid, cores=30, memory=8 * GIB)
                )
                seen["created"] = MessageToDict(reply)
                seen["daemon"].append("started" if (pipe / "control").is_socket() else "none")
                daemon = json.loads((pipe / ".gpuslice-fake-mps.json").read_text())
                seen["namespace"] = daemon["servers"]["gpuslice"]["namespaces"][reply.share_id]
                seen["compute mode"].append(fake.compute_mode(0).value)

                namespace = Path(reply.container_edits.mounts[0].host_path)
                client = Workload(
                    config, memory=GIB, cgroup_dirs=cgroups.container(), mps_pipe_dir=namespace
                )
                hook = next(
                    h for h in reply.container_edits.hooks if h.hook_name == "createContainer"
                )
                run_hook(hook, "ctr-client", client.pid)
                since: list[float] = []  # when the watchdog first saw the client's memory
                pids = {client.pid: "the client"}
                seen["MPS clients"] = [pids.get(p.pid, p.pid) for p in fake.mps_processes(0)]
                # a process of an MPS share that the GPU does not list as an MPS client bypasses
                # the server: the watchdog would kill it; the client must be seen and spared
                usage = wait_for(
                    lambda: spared(stub, since), 10, "half a second of samples with the client"
                )
                seen["memory used"] = usage.memory_used_bytes
                seen["violations, kills"] = [usage.violations, usage.kills]
                seen["client alive"] = client.alive()
                client.stop()
                assert stub.ReleaseShare(pb.ReleaseShareRequest(claim_uid="uid-mps")).released
            wait_for(lambda: not (pipe / "control").exists(), 15, "the MPS daemon stopped")
            seen["daemon"].append("stopped")
            seen["compute mode"].append(fake.compute_mode(0).value)
    finally:
        if client is not None:
            client.stop()
        proc.stop()
        proc.stop_mps_daemons()
        remove_tree(directory)
    text = json.dumps(seen)
    for path, name in ((proc.mps_root, "<mps>"), (directory, "<dir>"), (reply.share_id, "<share>")):
        text = text.replace(str(path), name)
    normal: dict[str, Any] = json.loads(text)
    return normal


# -- the sandbox's node services, each on the fake and on the mock ----------------------------
# One fake node serves both processes of a service: the one on the mock, under another node
# name, answers for the same GPUs and the same state file.

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
GPUS: list[dict[str, Any]] = [
    {"model": "L4"},
    {
        "model": "H100",
        "migEnabled": True,
        "migInstances": [{"profile": "3g.40gb"}, {"profile": "1g.10gb"}],
    },
    {"model": "A100-SXM4-40GB"},
]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The mock built before any service's start is timed (a cold cache takes seconds)."""
    mock_library_dir()


def test_the_kubelet_plugin_on_the_mock_publishes_the_same_devices_and_prepares_a_claim(
    sandbox: ControlPlane, kube: RawApi, namespace: str, device_classes: list[str]
) -> None:
    on_fake = start_gpu_node(sandbox, GPUS)
    on_mock: GpuNode | None = None
    try:
        on_mock = start_gpu_node(sandbox, [], nvml_config=on_fake.nvml_config, backend="mock")
        assert "--nvml=real" in on_mock.plugin.argv
        fake_devices = wait_for(lambda: on_fake.devices(kube), 20, "the fake node's devices")
        mock_devices = published(on_mock, kube, len(fake_devices))
        # the one difference: the real backend reads the PCIe root from sysfs, which has no
        # fake GPUs (docs/nvml-mock.md), so the mock's devices have no pcieRoot attribute
        roots = [d["attributes"].pop(PCIE_ROOT) for d in fake_devices.values()]
        assert all(roots) and not any(PCIE_ROOT in d["attributes"] for d in mock_devices.values())
        assert mock_devices == fake_devices, "\n".join(differences(mock_devices, fake_devices))

        whole = claim_template(namespace, "whole", "gpu.gpuslice.dev", selector=on_gpu(2))
        kube.create(resource_path(RESOURCE, "resourceclaimtemplates", namespace=namespace), whole)
        kube.create(
            resource_path("v1", "pods", namespace=namespace),
            gpu_pod(namespace, "p", on_mock.name, template="whole"),
        )
        pod = wait_pod_phase(kube, namespace, "p", "Running", timeout=30)
        [got] = pod_devices(on_mock, pod)
        assert got["UUID"] == on_fake.gpu_uuid(2)
        uid = got["CLAIM_UID"]
        assert on_mock.checkpoint_claims()[uid]["state"] == "PrepareCompleted"
        assert list(on_mock.plugin.cdi_root.glob(f"*{uid}*"))
    finally:
        if on_mock is not None:
            stop_gpu_node(on_mock, kube)
        stop_gpu_node(on_fake, kube)


def published(node: GpuNode, kube: RawApi, count: int) -> dict[str, Obj]:
    def devices() -> dict[str, Obj] | None:
        found = node.devices(kube)
        return found if len(found) == count else None

    return wait_for(devices, 20, f"{count} devices of {node.name}")


def differences(got: object, expected: object, at: str = "") -> list[str]:
    """Where two JSON values differ: ``path: got != expected`` per leaf."""
    if isinstance(got, dict) and isinstance(expected, dict):
        return [
            line
            for key in sorted(set(got) | set(expected), key=str)
            for line in differences(got.get(key), expected.get(key), f"{at}.{key}")
        ]
    if isinstance(got, list) and isinstance(expected, list) and len(got) == len(expected):
        return [
            line
            for i, (g, e) in enumerate(zip(got, expected, strict=True))
            for line in differences(g, e, f"{at}[{i}]")
        ]
    return [] if got == expected else [f"{at}: {got!r} != {expected!r}"]


def gpus_json(
    services: NodeServices, layouts: dict[int, str] | None = None
) -> list[dict[str, Any]]:
    """``ListGpus`` as JSON; ``layouts`` (GPU index → layout name) is what the manager that did
    not apply a layout lists in its stead: an instance's layout is the record of the manager that
    applied it (its state directory), not the GPU's."""
    gpus = mig_gpus(services)
    for gpu in gpus:
        for instance in gpu.instances:
            instance.layout = instance.layout or (layouts or {}).get(gpu.index, "")
    return [MessageToDict(m) for m in gpus]


def mig_gpus(services: NodeServices) -> list[mig.MigGpu]:
    with services.mig_manager() as stub:
        return list(stub.ListGpus(mig.ListGpusRequest()).gpus)


LAYOUT = """
version: v1
mig-configs:
  h100-sevenths:
    - devices: [1]
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
  a100-halves:
    - devices: [2]
      mig-enabled: true
      mig-devices:
        "3g.20gb": 2
"""


def test_the_mig_manager_on_the_mock_lists_and_applies_what_the_fake_shows(
    sandbox: ControlPlane,
) -> None:
    on_fake = NodeServices.start(sandbox, GPUS, enforcer=False, mig_manager=True)
    on_mock: NodeServices | None = None
    try:
        on_mock = NodeServices.start(
            sandbox,
            [],
            enforcer=False,
            mig_manager=True,
            backend="mock",
            nvml_config=on_fake.nvml_config,
        )
        assert mig_gpus(on_mock) == mig_gpus(on_fake)

        with on_mock.mig_manager() as stub:
            applied = stub.ApplyLayout(
                mig.ApplyLayoutRequest(layout_name="h100-sevenths", config_yaml=LAYOUT)
            )
        assert applied.state == mig.LAYOUT_STATE_SUCCESS, applied.message
        assert [i.profile_name for i in mig_gpus(on_fake)[1].instances] == ["1g.10gb"] * 7
        assert gpus_json(on_mock) == gpus_json(on_fake, {1: "h100-sevenths"})

        # MIG mode: set through NVML, in effect after a GPU reset, which the real backend asks
        # of nvidia-smi: on the mock's node, the stand-in that resets in the fake node's state
        with on_mock.mig_manager() as stub:
            enabled = stub.ApplyLayout(
                mig.ApplyLayoutRequest(layout_name="a100-halves", config_yaml=LAYOUT)
            )
        assert enabled.state == mig.LAYOUT_STATE_SUCCESS, enabled.message
        [change] = enabled.gpus
        assert (change.previous_mode, change.mode) == (mig.MIG_MODE_DISABLED, mig.MIG_MODE_ENABLED)
        listed = gpus_json(on_fake, {1: "h100-sevenths", 2: "a100-halves"})
        assert gpus_json(on_mock) == listed
        assert listed[2]["currentMode"] == listed[2]["pendingMode"] == "MIG_MODE_ENABLED"
        assert [i["profileName"] for i in listed[2]["instances"]] == ["3g.20gb"] * 2
    finally:
        for services in (on_mock, on_fake):
            if services is not None:
                assert not services.stop(), services.logs()
                shutil.rmtree(services.root, ignore_errors=True)


def test_the_device_plugin_on_the_mock_registers_the_same_devices(
    sandbox: ControlPlane, node_agents: Callable[..., NodeAgent]
) -> None:
    fake_agent = node_agents(labels=MODE)
    mock_agent = node_agents(labels=MODE)
    config = write_node(fake_agent.config.root, {"gpus": GPUS}, fake_agent.name)
    running = [start_plugin(fake_agent, sandbox.kubeconfig, config)]
    try:
        running.append(start_plugin(mock_agent, sandbox.kubeconfig, config, backend="mock"))
        for agent in (fake_agent, mock_agent):
            wait_for(agent.devices.allocatable, 20, f"{agent.name}'s devices")
        assert mock_agent.device_plugin_resources() == fake_agent.device_plugin_resources()
        assert mock_agent.devices.allocatable() == fake_agent.devices.allocatable()
    finally:
        left = procs.stop(running, grace=5)
        assert not left, f"device plugins outlived their stop: {left}"
