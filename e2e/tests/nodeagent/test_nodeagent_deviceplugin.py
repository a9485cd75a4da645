"""The node agent's device manager against the real control plane with a fake device plugin:
registration on kubelet.sock, node capacity/allocatable following ListAndWatch, allocation at
admission (GetPreferredAllocation, Allocate, PreStartContainer) and admission rejection."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import get_pod, wait_event, wait_for, wait_pod_phase
from gpuslice_core.errors import ResourceExhaustedError
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(60)

RESOURCE = "example.com/gpu"


class FakeDevicePlugin(pb_grpc.DevicePluginServicer):
    def __init__(self, directory: Path, devices: list[str], resource: str = RESOURCE) -> None:
        self.dir = directory
        self.resource = resource
        self.socket = directory / f"fake-{resource.replace('/', '-')}.sock"
        self.health = dict.fromkeys(devices, "Healthy")
        self.updates: queue.Queue[bool] = queue.Queue()
        self.allocated: list[list[str]] = []
        self.preferred_asked: list[list[str]] = []
        self.pre_started: list[list[str]] = []
        self.allocate_error = ""
        self._server: UnixGrpcServer | None = None
        self._stopped = threading.Event()

    def start(self) -> FakeDevicePlugin:
        server = UnixGrpcServer([self.socket], name="fake-device-plugin")
        server.add(pb_grpc.add_DevicePluginServicer_to_server, self, "v1beta1.DevicePlugin")
        server.start()
        self._server = server
        return self

    def register(self, version: str = "v1beta1", resource: str | None = None) -> None:
        with grpc.insecure_channel(f"unix://{self.dir / 'kubelet.sock'}") as channel:
            pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(
                    version=version,
                    endpoint=self.socket.name,
                    resource_name=resource or self.resource,
                ),
                timeout=15,
            )

    def set_health(self, device: str, health: str) -> None:
        self.health[device] = health
        self.updates.put(True)

    def stop(self) -> None:
        self._stopped.set()
        self.updates.put(False)
        if self._server is not None:
            self._server.stop(grace=0.2)
            self._server = None

    # ---- DevicePlugin ----------------------------------------------------------------------
    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        )

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        while not self._stopped.is_set():
            yield pb.ListAndWatchResponse(
                devices=[pb.Device(ID=d, health=h) for d, h in sorted(self.health.items())]
            )
            if not self.updates.get():
                return

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        req = request.container_requests[0]
        self.preferred_asked.append(list(req.available_deviceIDs))
        best = sorted(req.available_deviceIDs, reverse=True)[: req.allocation_size]
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=best)]
        )

    def Allocate(self, request: Any, context: Any) -> Any:
        if self.allocate_error:  # servicers raise domain errors (ErrorInterceptor maps them)
            raise ResourceExhaustedError(self.allocate_error)
        ids = list(request.container_requests[0].devices_ids)
        self.allocated.append(ids)
        return pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(
                    envs={"FAKE_DEVICES": ",".join(ids)},
                    mounts=[
                        pb.Mount(container_path="/dev/shm/fake", host_path="/tmp", read_only=True)
                    ],
                    devices=[
                        pb.DeviceSpec(
                            container_path="/dev/fake0", host_path="/dev/null", permissions="rw"
                        )
                    ],
                )
            ]
        )

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        self.pre_started.append(list(request.devices_ids))
        return pb.PreStartContainerResponse()


@pytest.fixture
def plugin(node_agent: NodeAgent) -> Iterator[FakeDevicePlugin]:
    fake = FakeDevicePlugin(node_agent.config.device_plugins_dir, ["dev-a", "dev-b"]).start()
    fake.register()
    yield fake
    fake.stop()


def node_resources(kube: RawApi, node: str) -> tuple[str | None, str | None]:
    status = kube.get(resource_path("v1", "nodes", name=node))["status"]
    return status["capacity"].get(RESOURCE), status["allocatable"].get(RESOURCE)


def dp_pod(namespace: str, node: str, name: str, count: int) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "command": ["sh", "-c", "echo FAKE_DEVICES=$FAKE_DEVICES; sleep 60"],
                    "resources": {"limits": {RESOURCE: str(count)}},
                }
            ],
        },
    }


def test_capacity_and_allocatable_follow_list_and_watch(
    kube: RawApi, node_agent: NodeAgent, plugin: FakeDevicePlugin
) -> None:
    node = node_agent.name

    def resources_are(expected: tuple[str, str]) -> Callable[[], bool]:
        return lambda: node_resources(kube, node) == expected

    wait_for(resources_are(("2", "2")), 10, "capacity 2 / allocatable 2")
    plugin.set_health("dev-b", "Unhealthy")
    wait_for(resources_are(("2", "1")), 10, "allocatable 1 after dev-b turned unhealthy")
    plugin.stop()  # the stream ends: every device unhealthy, capacity kept
    wait_for(resources_are(("2", "0")), 10, "allocatable 0 after the stream ended")


def test_register_refuses_bad_version_and_resource_name(
    node_agent: NodeAgent, plugin: FakeDevicePlugin
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        plugin.register(version="v1alpha1")
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert "not supported by kubelet" in str(err.value.details())
    with pytest.raises(grpc.RpcError) as err:
        plugin.register(resource="gpu")
    assert "is invalid" in str(err.value.details())


def test_allocation_at_admission_applies_the_plugin_edits(
    kube: RawApi, namespace: str, node_agent: NodeAgent, plugin: FakeDevicePlugin
) -> None:
    node = node_agent.name
    wait_for(lambda: node_resources(kube, node) == ("2", "2"), 10, "the resource on the node")
    kube.create(resource_path("v1", "pods", namespace=namespace), dp_pod(namespace, node, "p", 1))
    pod = wait_pod_phase(kube, namespace, "p", "Running", timeout=20)
    assert plugin.preferred_asked == [["dev-a", "dev-b"]]
    assert plugin.allocated == [["dev-b"]]  # the plugin preferred the last one
    assert plugin.pre_started == [["dev-b"]]
    uid = pod["metadata"]["uid"]
    log = wait_for(lambda: node_agent.pod_log(uid, "main"), 10, "the container log")
    assert "FAKE_DEVICES=dev-b" in log
    edits = node_agent.container_edits(uid, "main")
    assert edits["deviceNodes"] == [
        {"path": "/dev/fake0", "hostPath": "/dev/null", "permissions": "rw"}
    ]

    # the other device goes to the second pod
    kube.create(resource_path("v1", "pods", namespace=namespace), dp_pod(namespace, node, "q", 1))
    wait_pod_phase(kube, namespace, "q", "Running", timeout=20)
    assert plugin.allocated[1] == ["dev-a"]


def test_allocate_failure_rejects_the_pod(
    kube: RawApi, namespace: str, node_agent: NodeAgent, plugin: FakeDevicePlugin
) -> None:
    node = node_agent.name
    plugin.allocate_error = "device melted"
    wait_for(lambda: node_resources(kube, node) == ("2", "2"), 10, "the resource on the node")
    kube.create(resource_path("v1", "pods", namespace=namespace), dp_pod(namespace, node, "p", 1))
    pod = wait_pod_phase(kube, namespace, "p", "Failed", timeout=20)
    assert pod["status"]["reason"] == "UnexpectedAdmissionError"
    assert pod["status"]["message"].startswith("Pod was rejected: Allocate failed due to ")
    assert "device melted" in pod["status"]["message"]
    event = wait_event(kube, namespace, "p", "UnexpectedAdmissionError")
    assert event["type"] == "Warning"
    assert get_pod(kube, namespace, "p") is not None  # a rejected pod is left in place
