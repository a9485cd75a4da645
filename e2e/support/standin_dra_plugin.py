"""A stand-in DRA kubelet plugin for the node-agent tests: gpuslice's DRA helper
(``gpuslice_draplugin``) serves the real registration and DRA gRPC protocols; this file holds
only the stand-in's own logic, none of gpuslice's.

It serves ``<registry>/<driver>-reg.sock`` and ``<plugins>/<driver>/dra.sock`` (DRAPlugin v1
and v1beta1, or whatever ``supported_versions`` advertises). Prepare reads the claim from the
API server (drivers get no allocation in the request) and writes one CDI spec per claim whose
devices set ``GPU_DEVICE`` (the device name), ``GPU_CLAIM``, ``GPU_POOL`` and, for consumable
capacity, ``GPU_CORES``; unprepare deletes it. Every call is recorded (by an interceptor, the
helper's option for seeing calls) so a test can assert what the node agent sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuslice_core.cdi import ClaimSpecs, ContainerEdits, Device, Hook
from gpuslice_draplugin import ClaimRef, Helper, PreparedDevice, PrepareResult, Sockets, start
from gpuslice_kube.raw import RawApi

DRIVER = "standin.gpuslice.dev"


@dataclass
class Calls:
    """What the kubelet side did, in order."""

    prepare: list[list[str]] = field(default_factory=list)  # claim names per call
    unprepare: list[list[str]] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the DRA service each call used
    notifications: list[tuple[bool, str]] = field(default_factory=list)
    get_info: int = 0


class _Recorder(grpc.ServerInterceptor):
    """Hands every unary call's method and request to ``seen`` before the helper answers."""

    def __init__(self, seen: Callable[[str, Any], None]) -> None:
        self.seen = seen

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner, method = handler.unary_unary, handler_call_details.method

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            self.seen(method, request)
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            call,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class StandinDraPlugin:
    def __init__(
        self,
        registry_dir: Path,
        plugins_dir: Path,
        cdi_root: Path,
        kube: RawApi | None,
        *,
        driver: str = DRIVER,
        supported_versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
        plugin_type: str = "DRAPlugin",
        hooks: list[Hook] | None = None,
    ) -> None:
        self.driver = driver
        self.reg_socket = registry_dir / f"{driver}-reg.sock"
        self.dra_socket = plugins_dir / driver / "dra.sock"
        self.kube = kube  # None: registration only (no claims to read)
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
        self._helper: Helper | None = None

    @classmethod
    def for_agent(cls, agent: Any, kube: RawApi, **kwargs: Any) -> StandinDraPlugin:
        cfg = agent.config
        return cls(cfg.registry_dir, cfg.plugins_dir, cfg.cdi_dir, kube, **kwargs)

    # ---- lifecycle: the helper's (DRA socket first, then the registration socket) ----------
    def start(self) -> StandinDraPlugin:
        self._helper = start(
            self,
            driver=self.driver,
            node="",
            raw=self.kube,
            sockets=Sockets(registration=self.reg_socket, dra=self.dra_socket),
            claim_cache=False,
            versions=self.supported_versions,
            plugin_type=self.plugin_type,
            interceptors=[_Recorder(self._seen)],
        )
        return self

    @property
    def helper(self) -> Helper:
        assert self._helper is not None, "start() the stand-in first"
        return self._helper

    def stop_registration(self) -> None:
        self.helper.server.stop_registration()
        self.registered.clear()

    def start_registration(self) -> None:
        self.helper.server.start_registration()

    def stop(self) -> None:
        if self._helper is not None:
            self._helper.stop(grace=0.5)
        self.registered.clear()

    def _seen(self, method: str, request: Any) -> None:
        service, _, name = method.lstrip("/").partition("/")
        with self._lock:
            if name == "GetInfo":
                self.calls.get_info += 1
            elif name == "NotifyRegistrationStatus":
                self.calls.notifications.append((request.plugin_registered, request.error))
                if request.plugin_registered:
                    self.registered.set()
            elif name in ("NodePrepareResources", "NodeUnprepareResources"):
                # k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin -> v1.DRAPlugin, as registered
                self.calls.versions.append(".".join(service.split(".")[-2:]))
                calls = (
                    self.calls.prepare if name == "NodePrepareResources" else self.calls.unprepare
                )
                calls.append([c.name for c in request.claims])

    # ---- DRA (gpuslice_draplugin.Plugin) ---------------------------------------------------
    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        return {ref.uid: self._prepare(ref) for ref in claims}

    def _prepare(self, ref: ClaimRef) -> PrepareResult:
        error = self.fail_prepare(ref.name) if self.fail_prepare is not None else ""
        if error:
            return RuntimeError(error)
        claim = self.helper.claims.read(ref)
        if claim["metadata"]["uid"] != ref.uid:
            return RuntimeError(f"claim {ref} has UID {claim['metadata']['uid']}, not {ref.uid}")
        allocation = (claim.get("status") or {}).get("allocation") or {}
        results = (allocation.get("devices") or {}).get("results") or []
        devices: list[Device] = []
        out: list[PreparedDevice] = []
        for r in results:
            if r["driver"] != self.driver:
                continue
            share = r.get("shareID") or None  # the helper sends it on v1 only
            env = [f"GPU_DEVICE={r['device']}", f"GPU_CLAIM={ref.name}", f"GPU_POOL={r['pool']}"]
            cores = (r.get("consumedCapacity") or {}).get("cores")
            if cores is not None:
                env.append(f"GPU_CORES={cores}")
            name = self.specs.device_name(ref.uid, r["device"], share)
            edits = ContainerEdits(env=env, hooks=self.hooks)
            devices.append(Device(name=name, container_edits=edits))
            out.append(
                PreparedDevice(
                    request_names=(r["request"],),
                    pool=r["pool"],
                    device=r["device"],
                    cdi_device_ids=(self.specs.qualified_id(name),),
                    share_id=share,
                )
            )
        if devices and self.write_specs:
            self.specs.write(ref.uid, devices)
        return out

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, Exception | None]:
        out: dict[str, Exception | None] = {}
        for ref in claims:
            error = self.fail_unprepare(ref.name) if self.fail_unprepare else ""
            if not error:
                self.specs.delete(ref.uid)
            out[ref.uid] = RuntimeError(error) if error else None
        return out
