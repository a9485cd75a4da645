"""Packages, field numbers and field types of the kubelet APIs match upstream.

The expected values are copied from the upstream .proto files (k8s.io/kubelet pkg/apis/...); a
change here means a wire break with the kubelet, not a test to update.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from gpuslice_protos.gpuslice.v1 import enforcer_pb2, migmanager_pb2
from gpuslice_protos.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as dra_v1
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2 as dra_v1beta1
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2 as health
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2 as reg
from gpuslice_protos.kubelet.podresources.v1 import api_pb2 as podres

STRING = FieldDescriptor.TYPE_STRING
MESSAGE = FieldDescriptor.TYPE_MESSAGE
INT64 = FieldDescriptor.TYPE_INT64
INT32 = FieldDescriptor.TYPE_INT32
UINT64 = FieldDescriptor.TYPE_UINT64
BOOL = FieldDescriptor.TYPE_BOOL
ENUM = FieldDescriptor.TYPE_ENUM


@pytest.mark.parametrize(
    ("module", "package"),
    [
        (dra_v1, "k8s.io.kubelet.pkg.apis.dra.v1"),
        (dra_v1beta1, "k8s.io.kubelet.pkg.apis.dra.v1beta1"),
        (reg, "pluginregistration"),
        (health, "v1alpha1"),
        (dp, "v1beta1"),
        (podres, "v1"),
        (enforcer_pb2, "gpuslice.v1"),
        (migmanager_pb2, "gpuslice.v1"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_package_line(module: ModuleType, package: str) -> None:
    assert module.DESCRIPTOR.package == package


# (message descriptor, field name, number, type, repeated)
FIELDS: list[tuple[Descriptor, str, int, int, bool]] = [
    (dra_v1.Device.DESCRIPTOR, "request_names", 1, STRING, True),
    (dra_v1.Device.DESCRIPTOR, "pool_name", 2, STRING, False),
    (dra_v1.Device.DESCRIPTOR, "device_name", 3, STRING, False),
    (dra_v1.Device.DESCRIPTOR, "cdi_device_ids", 4, STRING, True),
    (dra_v1.Device.DESCRIPTOR, "share_id", 5, STRING, False),
    (dra_v1.NodePrepareResourceResponse.DESCRIPTOR, "error", 2, STRING, False),
    (dra_v1.Claim.DESCRIPTOR, "namespace", 1, STRING, False),
    (dra_v1.Claim.DESCRIPTOR, "uid", 2, STRING, False),
    (dra_v1.Claim.DESCRIPTOR, "name", 3, STRING, False),
    (dra_v1beta1.Device.DESCRIPTOR, "cdi_device_ids", 4, STRING, True),
    (reg.PluginInfo.DESCRIPTOR, "endpoint", 3, STRING, False),
    (reg.PluginInfo.DESCRIPTOR, "supported_versions", 4, STRING, True),
    (reg.RegistrationStatus.DESCRIPTOR, "plugin_registered", 1, BOOL, False),
    (health.DeviceHealth.DESCRIPTOR, "device", 1, MESSAGE, False),
    (health.DeviceHealth.DESCRIPTOR, "health", 2, ENUM, False),
    (health.DeviceHealth.DESCRIPTOR, "last_updated_time", 3, INT64, False),
    (health.DeviceHealth.DESCRIPTOR, "health_check_timeout_seconds", 4, INT64, False),
    (health.DeviceHealth.DESCRIPTOR, "message", 5, STRING, False),
    (dp.Device.DESCRIPTOR, "ID", 1, STRING, False),
    (dp.NUMANode.DESCRIPTOR, "ID", 1, INT64, False),
    (dp.DevicePluginOptions.DESCRIPTOR, "get_preferred_allocation_available", 2, BOOL, False),
    (dp.RegisterRequest.DESCRIPTOR, "resource_name", 3, STRING, False),
    (dp.ContainerPreferredAllocationRequest.DESCRIPTOR, "available_deviceIDs", 1, STRING, True),
    (dp.ContainerPreferredAllocationRequest.DESCRIPTOR, "must_include_deviceIDs", 2, STRING, True),
    (dp.ContainerPreferredAllocationRequest.DESCRIPTOR, "allocation_size", 3, INT32, False),
    (dp.ContainerPreferredAllocationResponse.DESCRIPTOR, "deviceIDs", 1, STRING, True),
    (dp.ContainerAllocateRequest.DESCRIPTOR, "devices_ids", 1, STRING, True),
    (dp.ContainerAllocateResponse.DESCRIPTOR, "annotations", 4, MESSAGE, True),
    (dp.ContainerAllocateResponse.DESCRIPTOR, "cdi_devices", 5, MESSAGE, True),
    (dp.DeviceSpec.DESCRIPTOR, "permissions", 3, STRING, False),
    (podres.ContainerResources.DESCRIPTOR, "dynamic_resources", 5, MESSAGE, True),
    (podres.ContainerMemory.DESCRIPTOR, "size", 2, UINT64, False),
    (podres.DynamicResource.DESCRIPTOR, "claim_name", 2, STRING, False),
    (podres.DynamicResource.DESCRIPTOR, "claim_resources", 4, MESSAGE, True),
    (podres.ClaimResource.DESCRIPTOR, "driver_name", 2, STRING, False),
    (podres.ClaimResource.DESCRIPTOR, "share_id", 5, STRING, False),
    (podres.GetPodResourcesRequest.DESCRIPTOR, "pod_namespace", 2, STRING, False),
]


@pytest.mark.parametrize(
    ("message", "name", "number", "type_", "repeated"),
    FIELDS,
    ids=[f"{m.full_name}.{n}" for m, n, *_ in FIELDS],
)
def test_field_matches_upstream(
    message: Descriptor, name: str, number: int, type_: int, repeated: bool
) -> None:
    field = message.fields_by_name[name]
    assert (field.number, field.type, field.is_repeated) == (number, type_, repeated)


def test_share_id_is_optional_in_v1_and_absent_in_v1beta1() -> None:
    assert dra_v1.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence
    assert podres.ClaimResource.DESCRIPTOR.fields_by_name["share_id"].has_presence
    assert "share_id" not in dra_v1beta1.Device.DESCRIPTOR.fields_by_name


def test_dynamic_resource_keeps_field_1_reserved() -> None:
    proto = descriptor_pb2.DescriptorProto()
    podres.DynamicResource.DESCRIPTOR.CopyToProto(proto)
    assert [(r.start, r.end) for r in proto.reserved_range] == [(1, 2)]
    assert 1 not in podres.DynamicResource.DESCRIPTOR.fields_by_number


def test_health_status_enum_values() -> None:
    assert dict(health.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_gpuslice_files_import_only_well_known_types() -> None:
    for module in (enforcer_pb2, migmanager_pb2):
        deps = [d.name for d in module.DESCRIPTOR.dependencies]
        assert all(name.startswith("google/protobuf/") for name in deps), deps
