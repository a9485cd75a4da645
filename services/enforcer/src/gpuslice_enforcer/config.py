"""The enforcer's settings, built from its flags (``cli``) or directly by tests."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

MEMORY_ACTIONS = ("kill", "report")
SM_ACTIONS = ("throttle", "report")
COMPUTE_MODE_POLICIES = ("exclusive", "leave")
CONTAINER_MPS_DIR = "/var/run/gpuslice/mps"


@dataclass(frozen=True)
class EnforcerConfig:
    #: The gRPC socket the enforcer serves (Enforcer and EnforcerContainers).
    socket: Path
    #: Where the checkpoint lives.
    state_dir: Path
    #: The same socket as the host (and so the CDI hook) sees it; default: ``socket``.
    hook_socket: Path | None = None
    #: Host path of ``gpuslice-enforcer-hook``; empty disables the CDI hooks.
    hook_path: str = "/var/lib/gpuslice/hook/bin/gpuslice-enforcer-hook"
    #: How long the hook may take to get the limits in force, in seconds.
    hook_timeout_s: int = 10
    #: Watchdog sampling period.
    sample_interval_s: float = 0.1
    #: What the watchdog does to a process of a share over its memory limit.
    memory_action: str = "kill"
    #: What the watchdog does to a share over its SM limit.
    sm_action: str = "throttle"
    #: How long a share may run above its SM limit after being under it (the credit bucket).
    burst_s: float = 0.5
    #: Use driver memory partitioning where the driver offers it.
    memory_partitioning: bool = True
    #: Use MPS (protocol 3 or legacy) where available.
    mps: bool = True
    #: The MPS control command (``nvidia-cuda-mps-control`` or the fake's stand-in).
    mps_control: tuple[str, ...] = ("nvidia-cuda-mps-control",)
    #: Host directory under which each GPU's MPS pipe directory lives.
    mps_root: Path = Path("/var/run/gpuslice/mps")
    #: Where the containers see their MPS pipe directory.
    mps_container_dir: str = CONTAINER_MPS_DIR
    #: Start legacy daemons in multi-user mode (-m).
    mps_multiuser: bool = False
    #: Extra environment for the MPS daemons (the fake's stand-in needs GPUSLICE_FAKE_NVML_CONFIG).
    mps_env: dict[str, str] = field(default_factory=dict)
    #: Thaw frozen shares and leave MPS daemons running at shutdown (False stops the daemons).
    keep_mps_on_exit: bool = True
    #: Hold GPUs that serve MPS shares in EXCLUSIVE_PROCESS compute mode (and restore the mode
    #: found after the last one); False never changes a compute mode (``--compute-mode=leave``).
    manage_compute_mode: bool = True

    @property
    def effective_hook_socket(self) -> Path:
        return self.hook_socket or self.socket

    def mps_control_found(self) -> str | None:
        """Why the MPS control command cannot run, or None when it can."""
        if not self.mps_control:
            return "no MPS control command configured"
        binary = self.mps_control[0]
        if "/" in binary:
            return None if Path(binary).is_file() else f"{binary} does not exist"
        return None if shutil.which(binary) else f"{binary} is not on PATH"
