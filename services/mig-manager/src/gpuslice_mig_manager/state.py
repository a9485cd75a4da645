"""The MIG manager's checkpoint: which instances it made, for whom, and what it was doing.

NVML cannot tag a GPU instance with an owner, so ownership lives here: every instance the
manager creates (for a layout or for a claim) gets an :class:`InstanceRecord` keyed by
``<gpu uuid>/<gpu instance id>``. Multi-step NVML work records an :class:`Intent` *before* the
first side effect and removes it with the result, so a kill -9 anywhere in between leaves an
intent that :mod:`gpuslice_mig_manager.recovery` completes or rolls back at the next start.

Schema version 1. Compatibility follows gpuslice_core.checkpoint: adding a defaulted field keeps
the version; anything else is version 2 with a migration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from gpuslice_core.checkpoint import CheckpointStore
from gpuslice_nvml import Placement

KIND = "mig-manager"
SCHEMA_VERSION = 1
FILE_NAME = "mig-manager.json"


def instance_key(gpu_uuid: str, gpu_instance_id: int) -> str:
    return f"{gpu_uuid}/{gpu_instance_id}"


class InstanceRecord(BaseModel):
    """A GPU instance (with its compute instance) the manager created or adopted."""

    gpu_uuid: str
    gpu_instance_id: int
    profile_id: int
    profile_name: str
    placement_start: int
    placement_size: int
    compute_instance_id: int | None = None
    #: The MIG device's profile: the GPU-instance name, or ``<c>c.<name>`` for a smaller CI.
    device_profile: str = ""
    mig_uuid: str = ""
    #: Who holds the instance (a claim UID from CreateInstance); empty when nobody does.
    owner: str = ""
    #: The layout that created or kept the instance; empty for on-demand instances.
    layout: str = ""

    @property
    def key(self) -> str:
        return instance_key(self.gpu_uuid, self.gpu_instance_id)

    @property
    def placement(self) -> Placement:
        return Placement(self.placement_start, self.placement_size)


class Intent(BaseModel):
    """NVML work that was started and not yet recorded as finished."""

    op: Literal["create", "destroy"]
    gpu_uuid: str
    profile_id: int
    profile_name: str
    placement_start: int
    placement_size: int
    device_profile: str = ""
    owner: str = ""
    layout: str = ""
    #: Known for destroys; for creates the placement identifies the instance.
    gpu_instance_id: int | None = None

    @property
    def placement(self) -> Placement:
        return Placement(self.placement_start, self.placement_size)

    @property
    def key(self) -> str:
        return f"{self.op}:{self.gpu_uuid}/{self.placement_start}:{self.placement_size}"


class MigState(BaseModel):
    """The whole checkpoint (``data`` of the envelope). Every field has a default."""

    instances: dict[str, InstanceRecord] = {}
    intents: dict[str, Intent] = {}


def open_store(state_dir: Path | str, *, boot_id: str | None = None) -> CheckpointStore[MigState]:
    return CheckpointStore(
        Path(state_dir) / FILE_NAME,
        kind=KIND,
        model=MigState,
        schema_version=SCHEMA_VERSION,
        boot_id=boot_id,
    )
