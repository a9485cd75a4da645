"""The container edits a share's containers receive (the kubelet plugin puts them into the
CDI devices of the share's GPUs).

Only what enforcement needs inside a container: unless enforcement is off, the
``createContainer`` hook that attaches the container to the share (``gpuslice-enforcer-hook
attach``) and the ``poststop`` hook that detaches it; for MPS shares the pipe directory mounted
and the MPS variables. What the share *is* (claim, limits, mechanisms) the plugin states in
per-device variables, whose names are unique to each device: a container can hold devices of
several claims, and a variable named once per claim would keep only the last claim's value
(docs/cdi.md).
"""

from __future__ import annotations

from gpuslice_core.cdi import ContainerEdits, Hook, Mount
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.state import Mechanism, ShareRecord

MIB = 1 << 20


def container_edits(config: EnforcerConfig, share: ShareRecord) -> ContainerEdits:
    env: list[str] = []
    mounts: list[Mount] = []
    if share.cores_mechanism.mps and share.mps_pipe_dir:
        container_dir = config.mps_container_dir
        env.append(f"CUDA_MPS_PIPE_DIRECTORY={container_dir}")
        mounts.append(
            Mount(
                host_path=share.mps_pipe_dir,
                container_path=container_dir,
                options=["rbind", "rw", "nosuid", "nodev"],
            )
        )
        if share.cores_mechanism is Mechanism.MPS_LEGACY:
            env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={share.cores_percent}")
            limits = ",".join(
                f"{i}={max(1, share.memory_bytes // MIB)}M" for i in range(len(share.device_uuids))
            )
            env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={limits}")
    hooks: list[Hook] = []
    if config.hook_path and share.level.value != "none":
        common = [
            "--socket",
            str(config.effective_hook_socket),
            "--claim-uid",
            share.claim_uid,
            "--share-id",
            share.share_id,
        ]
        timeout = config.hook_timeout_s
        hooks = [
            Hook(
                hook_name="createContainer",
                path=config.hook_path,
                args=[config.hook_path, "attach", *common, "--timeout", str(timeout)],
                timeout=timeout + 5,
            ),
            Hook(
                hook_name="poststop",
                path=config.hook_path,
                args=[config.hook_path, "detach", *common, "--timeout", "5"],
                timeout=10,
            ),
        ]
    return ContainerEdits(env=env, mounts=mounts, hooks=hooks)
