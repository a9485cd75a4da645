"""A kubelet-side DRA client and builders of allocation results, for tests and bench/.

client = DraClient(dra_socket)                 # v1 by default, "v1beta1" for the other
answer = client.prepare([("ns", "name", "uid")])
answer["uid"].error, answer["uid"].devices     # devices as dicts
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuslice_api.names import DRIVER
from gpuslice_protos.kubelet.dra.v1 import api_pb2 as v1
from gpuslice_protos.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from gpuslice_protos.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc

Obj = dict[str, Any]
ClaimTuple = tuple[str, str, str]  # namespace, name, uid


@dataclass
class ClaimAnswer:
    error: str = ""
    devices: list[Obj] = field(default_factory=list)


class DraClient:
    def __init__(self, socket: Path, version: str = "v1", *, timeout: float = 30.0) -> None:
        self.version = version
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.pb: Any = v1 if version == "v1" else v1beta1
        grpc_mod: Any = v1_grpc if version == "v1" else v1beta1_grpc
        self.stub = grpc_mod.DRAPluginStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def _claims(self, claims: Iterable[ClaimTuple]) -> list[Any]:
        return [self.pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]

    def prepare(self, claims: Iterable[ClaimTuple]) -> dict[str, ClaimAnswer]:
        request = self.pb.NodePrepareResourcesRequest(claims=self._claims(claims))
        response = self.stub.NodePrepareResources(request, timeout=self.timeout)
        out = {}
        for uid, result in response.claims.items():
            devices = []
            for d in result.devices:
                device = {
                    "request_names": list(d.request_names),
                    "pool": d.pool_name,
                    "device": d.device_name,
                    "cdi_device_ids": list(d.cdi_device_ids),
                }
                if self.version == "v1" and d.HasField("share_id"):
                    device["share_id"] = d.share_id
                devices.append(device)
            out[uid] = ClaimAnswer(error=result.error, devices=devices)
        return out

    def unprepare(self, claims: Iterable[ClaimTuple]) -> dict[str, str]:
        request = self.pb.NodeUnprepareResourcesRequest(claims=self._claims(claims))
        response = self.stub.NodeUnprepareResources(request, timeout=self.timeout)
        return {uid: r.error for uid, r in response.claims.items()}


def result(
    device: str,
    *,
    pool: str,
    request: str = "gpu",
    driver: str = DRIVER,
    cores: str | None = None,
    memory: str | None = None,
    share_id: str | None = None,
    admin_access: bool = False,
) -> Obj:
    """One allocation result as the scheduler writes it."""
    out: Obj = {"request": request, "driver": driver, "pool": pool, "device": device}
    consumed = {k: v for k, v in (("cores", cores), ("memory", memory)) if v is not None}
    if consumed:
        out["consumedCapacity"] = consumed
        out["shareID"] = share_id or str(uuid.uuid4())
    elif share_id:
        out["shareID"] = share_id
    if admin_access:
        out["adminAccess"] = True
    return out


def gpu_config(
    parameters: Obj | None = None,
    *,
    source: str = "FromClaim",
    requests: Sequence[str] = (),
    driver: str = DRIVER,
    **fields: Any,
) -> Obj:
    """An allocation config entry carrying an opaque GpuConfig (``fields`` merged in)."""
    params: Obj = (
        parameters
        if parameters is not None
        else {
            "apiVersion": "gpu.gpuslice.dev/v1alpha1",
            "kind": "GpuConfig",
        }
    )
    params = {**params, **fields}
    entry: Obj = {"source": source, "opaque": {"driver": driver, "parameters": params}}
    if requests:
        entry["requests"] = list(requests)
    return entry


def ref(claim: Obj) -> ClaimTuple:
    meta = claim["metadata"]
    return meta["namespace"], meta["name"], meta["uid"]
