"""The enforcer's gRPC API (``gpuslice.v1.Enforcer``) as its clients read its answers.

Both plugins ask the enforcer for shares (the kubelet plugin for claims, the device plugin for
MPS replicas); they name its enforcement levels and mechanisms with the same words (the
enforcer's ``GPUSLICE_*_MECHANISM`` environment uses them too) and turn the container edits it
returns into CDI edits the same way.
"""

from __future__ import annotations

from gpuslice_core import cdi
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb

LEVELS = {
    pb.ENFORCEMENT_LEVEL_HARD: "hard",
    pb.ENFORCEMENT_LEVEL_SOFT: "soft",
    pb.ENFORCEMENT_LEVEL_NONE: "none",
}
MECHANISMS = {
    pb.MECHANISM_MEMORY_PARTITION: "memory-partition",
    pb.MECHANISM_MPS_PROTOCOL3: "mps-protocol3",
    pb.MECHANISM_MPS_LEGACY: "mps-legacy",
    pb.MECHANISM_WATCHDOG: "watchdog",
    pb.MECHANISM_NONE: "none",
}


def level_name(level: pb.EnforcementLevel.ValueType) -> str:
    return LEVELS.get(level, "none")


def mechanism_name(mechanism: pb.Mechanism.ValueType) -> str:
    return MECHANISMS.get(mechanism, "none")


def cdi_edits(message: pb.ContainerEdits) -> cdi.ContainerEdits:
    """The enforcer's container edits as CDI container edits."""
    return cdi.ContainerEdits(
        env=list(message.env),
        mounts=[
            cdi.Mount(
                host_path=m.host_path, container_path=m.container_path, options=list(m.options)
            )
            for m in message.mounts
        ],
        device_nodes=[
            cdi.DeviceNode(path=d.path, host_path=d.host_path, permissions=d.permissions)
            for d in message.device_nodes
        ],
        hooks=[
            cdi.Hook(
                hook_name=h.hook_name,
                path=h.path,
                args=list(h.args),
                env=list(h.env),
                timeout=h.timeout_seconds if h.HasField("timeout_seconds") else None,
            )
            for h in message.hooks
        ],
    )
