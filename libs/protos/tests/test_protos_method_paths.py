"""Every generated service answers on the exact gRPC method path its upstream `package` line makes.

Each case starts a real grpc server on a unix socket, registers a servicer through the generated
``add_*Servicer_to_server``, calls every method through the generated stub and records the path
the server saw. The kubelet only talks to us if these strings match upstream byte for byte.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from gpuslice_protos.gpuslice.v1 import (
    enforcer_pb2,
    enforcer_pb2_grpc,
    migmanager_pb2,
    migmanager_pb2_grpc,
)
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as dra_v1_pb2
from gpuslice_protos.kubelet.dra.v1 import api_pb2_grpc as dra_v1_grpc
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2 as dra_v1beta1_pb2
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2 as health_pb2
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2_grpc as health_grpc
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2 as reg_pb2
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpuslice_protos.kubelet.podresources.v1 import api_pb2 as podres_pb2
from gpuslice_protos.kubelet.podresources.v1 import api_pb2_grpc as podres_grpc


@dataclass(frozen=True)
class Service:
    pb2: ModuleType
    grpc_module: ModuleType
    name: str
    full_name: str
    paths: tuple[str, ...]


SERVICES = [
    Service(
        dra_v1_pb2,
        dra_v1_grpc,
        "DRAPlugin",
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
        (
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        ),
    ),
    Service(
        dra_v1beta1_pb2,
        dra_v1beta1_grpc,
        "DRAPlugin",
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
        (
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        ),
    ),
    Service(
        reg_pb2,
        reg_grpc,
        "Registration",
        "pluginregistration.Registration",
        (
            "/pluginregistration.Registration/GetInfo",
            "/pluginregistration.Registration/NotifyRegistrationStatus",
        ),
    ),
    Service(
        health_pb2,
        health_grpc,
        "DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
        ("/v1alpha1.DRAResourceHealth/NodeWatchResources",),
    ),
    Service(
        dp_pb2,
        dp_grpc,
        "Registration",
        "v1beta1.Registration",
        ("/v1beta1.Registration/Register",),
    ),
    Service(
        dp_pb2,
        dp_grpc,
        "DevicePlugin",
        "v1beta1.DevicePlugin",
        (
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            "/v1beta1.DevicePlugin/ListAndWatch",
            "/v1beta1.DevicePlugin/GetPreferredAllocation",
            "/v1beta1.DevicePlugin/Allocate",
            "/v1beta1.DevicePlugin/PreStartContainer",
        ),
    ),
    Service(
        podres_pb2,
        podres_grpc,
        "PodResourcesLister",
        "v1.PodResourcesLister",
        (
            "/v1.PodResourcesLister/List",
            "/v1.PodResourcesLister/GetAllocatableResources",
            "/v1.PodResourcesLister/Get",
        ),
    ),
    Service(
        enforcer_pb2,
        enforcer_pb2_grpc,
        "Enforcer",
        "gpuslice.v1.Enforcer",
        (
            "/gpuslice.v1.Enforcer/CreateShare",
            "/gpuslice.v1.Enforcer/ReleaseShare",
            "/gpuslice.v1.Enforcer/GetUsage",
            "/gpuslice.v1.Enforcer/WatchViolations",
            "/gpuslice.v1.Enforcer/GetCapabilities",
        ),
    ),
    Service(
        enforcer_pb2,
        enforcer_pb2_grpc,
        "EnforcerContainers",
        "gpuslice.v1.EnforcerContainers",
        (
            "/gpuslice.v1.EnforcerContainers/AttachContainer",
            "/gpuslice.v1.EnforcerContainers/DetachContainer",
        ),
    ),
    Service(
        migmanager_pb2,
        migmanager_pb2_grpc,
        "MigManager",
        "gpuslice.v1.MigManager",
        (
            "/gpuslice.v1.MigManager/ListGpus",
            "/gpuslice.v1.MigManager/CreateInstance",
            "/gpuslice.v1.MigManager/DestroyInstance",
            "/gpuslice.v1.MigManager/ApplyLayout",
            "/gpuslice.v1.MigManager/ReleaseInstance",
        ),
    ),
]


class RecordingInterceptor(grpc.ServerInterceptor):
    """Records the method path of every call the server receives."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        self.paths.append(handler_call_details.method)
        return continuation(handler_call_details)


@pytest.fixture
def socket_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory for the socket; unix socket paths are limited to 107 bytes."""
    if len(str(tmp_path / "grpc.sock")) < 100:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="gs-") as short:
        yield Path(short)


def _answering_servicer(service: Service, descriptor: ServiceDescriptor) -> object:
    """An instance of the generated Servicer whose every method returns an empty response."""

    def make(method: MethodDescriptor) -> Callable[..., Any]:
        response_class = message_factory.GetMessageClass(method.output_type)

        if method.server_streaming:

            def stream(self: object, request: Message, context: grpc.ServicerContext) -> Any:
                yield response_class()

            return stream

        def unary(self: object, request: Message, context: grpc.ServicerContext) -> Any:
            return response_class()

        return unary

    base = getattr(service.grpc_module, f"{service.name}Servicer")
    methods = {method.name: make(method) for method in descriptor.methods}
    return type(f"Answering{service.name}", (base,), methods)()


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.full_name)
def test_service_descriptor_full_name(service: Service) -> None:
    descriptor = service.pb2.DESCRIPTOR.services_by_name[service.name]
    assert descriptor.full_name == service.full_name
    assert tuple(f"/{descriptor.full_name}/{m.name}" for m in descriptor.methods) == service.paths


@pytest.mark.timeout(20)
@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.full_name)
def test_generated_server_and_stub_use_upstream_paths(service: Service, socket_dir: Path) -> None:
    descriptor = service.pb2.DESCRIPTOR.services_by_name[service.name]
    recorder = RecordingInterceptor()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[recorder])
    add_servicer = getattr(service.grpc_module, f"add_{service.name}Servicer_to_server")
    add_servicer(_answering_servicer(service, descriptor), server)
    address = f"unix:{socket_dir / 'grpc.sock'}"
    assert server.add_insecure_port(address) == 1
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = getattr(service.grpc_module, f"{service.name}Stub")(channel)
            for method in descriptor.methods:
                request = message_factory.GetMessageClass(method.input_type)()
                call = getattr(stub, method.name)
                if method.server_streaming:
                    replies = list(call(request, timeout=5))
                    assert len(replies) == 1
                else:
                    reply = call(request, timeout=5)
                    assert reply.DESCRIPTOR.full_name == method.output_type.full_name
    finally:
        server.stop(grace=None)
    assert tuple(recorder.paths) == service.paths
