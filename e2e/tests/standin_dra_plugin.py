"""A stand-in DRA kubelet plugin for the node-agent tests: the real registration and DRA gRPC
protocols, none of gpuslice's logic.

It serves ``<registry>/<driver>-reg.sock`` (Registration: GetInfo, NotifyRegistrationStatus)
and ``<plugins>/<driver>/dra.sock`` (DRAPlugin v1 and v1beta1). NodePrepareResources reads the
claim from the API server (drivers get no allocation in the request) and writes one CDI spec per
claim whose devices set ``GPU_DEVICE`` (the device name), ``GPU_CLAIM`` and, for consumable
capacity, ``GPU_CORES``; NodeUnprepareResources deletes it. Every call is recorded so a test
can assert what the node agent sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Device, Hook
from gpuslice_core.grpcserver import UnixGrpcServer
from gpuslice_kube.raw import RawApi, resource_path
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as v1_pb2
from gpuslice_protos.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2 as v1beta1_pb2
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2 as reg_pb2
from gpuslice_protos.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc

DRIVER = "standin.gpuslice.dev"


@dataclass
class Calls:
    """What the kubelet side did, in order."""

    prepare: list[list[str]] = field(default_factory=list)  # claim names per call
    unprepare: list[list[str]] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the DRA service each call used
    notifications: list[tuple[bool, str]] = field(default_factory=list)
    get_info: int = 0


class StandinDraPlugin:
    def __init__(
        self,
        registry_dir: Path,
        plugins_dir: Path,
        cdi_root: Path,
        kube: RawApi,
        *,
        driver: str = DRIVER,
        supported_versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
        plugin_type: str = "DRAPlugin",
        hooks: list[Hook] | None = None,
    ) -> None:
        self.driver = driver
        self.reg_socket = registry_dir / f"{driver}-reg.sock"
        self.dra_socket = plugins_dir / driver / "dra.sock"
        self.kube = kube
        self.supported_versions = supported_versions
        self.plugin_type = plugin_type
        self.specs = ClaimSpecs(cdi_root, vendor=f"k8s.{driver}", cdi_class="claim")
        self.hooks = hooks or []
        self.calls = Calls()
        self.registered = threading.Event()
        self.fail_prepare: Callable[[str], str] | None = None  # claim name -> error ('' = ok)
        self.fail_unprepare: Callable[[str], str] | None = None
        self.write_specs = True  # False: hand out CDI ids without writing their spec
        self._lock = threading.Lock()
        self._dra: UnixGrpcServer | None = None
        self._reg: UnixGrpcServer | None = None

    @classmethod
    def for_agent(cls, agent: Any, kube: RawApi, **kwargs: Any) -> StandinDraPlugin:
        cfg = agent.config
        return cls(cfg.registry_dir, cfg.plugins_dir, cfg.cdi_dir, kube, **kwargs)

    # ---- lifecycle: DRA socket first, then the registration socket (the kubelet dials it) ---
    def start(self) -> StandinDraPlugin:
        self.start_dra()
        self.start_registration()
        return self

    def start_dra(self) -> None:
        dra = UnixGrpcServer([self.dra_socket], name=f"standin-dra-{self.driver}")
        dra.add(v1_grpc.add_DRAPluginServicer_to_server, _V1(self), "v1.DRAPlugin")
        dra.add(v1beta1_grpc.add_DRAPluginServicer_to_server, _V1beta1(self), "v1beta1.DRAPlugin")
        dra.start()
        self._dra = dra

    def start_registration(self) -> None:
        reg = UnixGrpcServer([self.reg_socket], name=f"standin-reg-{self.driver}")
        reg.add(reg_grpc.add_RegistrationServicer_to_server, _Registration(self), "registration")
        reg.start()
        self._reg = reg

    def stop_registration(self) -> None:
        if self._reg is not None:
            self._reg.stop(grace=0.5)
            self._reg = None
        self.registered.clear()

    def stop_dra(self) -> None:
        if self._dra is not None:
            self._dra.stop(grace=0.5)
            self._dra = None

    def stop(self) -> None:
        self.stop_registration()
        self.stop_dra()

    # ---- DRA -------------------------------------------------------------------------------
    def prepare_claim(self, namespace: str, name: str, uid: str, version: str) -> Any:
        """One claim → (devices as dicts, error)."""
        if self.fail_prepare is not None:
            error = self.fail_prepare(name)
            if error:
                return [], error
        claim = self.kube.get(
            resource_path("resource.k8s.io/v1", "resourceclaims", namespace=namespace, name=name)
        )
        if claim["metadata"]["uid"] != uid:
            return [], f"claim {namespace}/{name} has UID {claim['metadata']['uid']}, not {uid}"
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
            "results"
        ) or []
        devices: list[Device] = []
        out: list[dict[str, Any]] = []
        for r in results:
            if r["driver"] != self.driver:
                continue
            share = r.get("shareID") if version == "v1.DRAPlugin" else None
            env = [f"GPU_DEVICE={r['device']}", f"GPU_CLAIM={name}", f"GPU_POOL={r['pool']}"]
            cores = (r.get("consumedCapacity") or {}).get("cores")
            if cores is not None:
                env.append(f"GPU_CORES={cores}")
            dev_name = self.specs.device_name(uid, r["device"], share or None)
            devices.append(
                Device(name=dev_name, container_edits=ContainerEdits(env=env, hooks=self.hooks))
            )
            out.append(
                {
                    "request_names": [r["request"]],
                    "pool_name": r["pool"],
                    "device_name": r["device"],
                    "share_id": share,
                    "cdi_device_ids": [self.specs.qualified_id(dev_name)],
                }
            )
        if devices and self.write_specs:
            self.specs.write(uid, devices)
        return out, ""

    def prepare(self, claims: Any, version: str, pb: Any) -> Any:
        with self._lock:
            self.calls.prepare.append([c.name for c in claims])
            self.calls.versions.append(version)
        response = pb.NodePrepareResourcesResponse()
        for c in claims:
            devices, error = self.prepare_claim(c.namespace, c.name, c.uid, version)
            entry = response.claims[c.uid]
            if error:
                entry.error = error
                continue
            for d in devices:
                kwargs = {k: v for k, v in d.items() if k != "share_id" or v}
                if version != "v1.DRAPlugin":
                    kwargs.pop("share_id", None)
                entry.devices.append(pb.Device(**kwargs))
        return response

    def unprepare(self, claims: Any, version: str, pb: Any) -> Any:
        with self._lock:
            self.calls.unprepare.append([c.name for c in claims])
            self.calls.versions.append(version)
        response = pb.NodeUnprepareResourcesResponse()
        for c in claims:
            error = self.fail_unprepare(c.name) if self.fail_unprepare else ""
            if not error:
                self.specs.delete(c.uid)
            response.claims[c.uid].error = error
        return response


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: StandinDraPlugin) -> None:
        self.p = plugin

    def GetInfo(self, request: reg_pb2.InfoRequest, context: grpc.ServicerContext) -> Any:
        self.p.calls.get_info += 1
        return reg_pb2.PluginInfo(
            type=self.p.plugin_type,
            name=self.p.driver,
            endpoint=str(self.p.dra_socket),
            supported_versions=list(self.p.supported_versions),
        )

    def NotifyRegistrationStatus(
        self, request: reg_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> Any:
        self.p.calls.notifications.append((request.plugin_registered, request.error))
        if request.plugin_registered:
            self.p.registered.set()
        return reg_pb2.RegistrationStatusResponse()


class _V1(v1_grpc.DRAPluginServicer):
    def __init__(self, plugin: StandinDraPlugin) -> None:
        self.p = plugin

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.p.prepare(request.claims, "v1.DRAPlugin", v1_pb2)

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.p.unprepare(request.claims, "v1.DRAPlugin", v1_pb2)


class _V1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, plugin: StandinDraPlugin) -> None:
        self.p = plugin

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.p.prepare(request.claims, "v1beta1.DRAPlugin", v1beta1_pb2)

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.p.unprepare(request.claims, "v1beta1.DRAPlugin", v1beta1_pb2)
