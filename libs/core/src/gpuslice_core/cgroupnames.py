"""How kubelets name a pod's cgroups, so a process's ``/proc/<pid>/cgroup`` tells its pod.

The cgroupfs driver writes ``.../pod<uid>/<container>``, the systemd driver
``.../kubepods-<qos>-pod<uid with underscores>.slice/...``; a path that contains either marker
belongs to that pod. Used by the enforcer's watchdog (process -> share) and the device plugin's
usage metrics (process -> container).
"""

from __future__ import annotations


def pod_markers(uid: str) -> tuple[str, str]:
    """The two ways ``uid`` appears in a pod's cgroup paths (cgroupfs, systemd)."""
    return f"pod{uid}", f"pod{uid.replace('-', '_')}"


def names_pod(paths: list[str], uid: str) -> bool:
    """Whether any of ``paths`` lies in the cgroups of pod ``uid``."""
    return bool(uid) and any(m in p for m in pod_markers(uid) for p in paths)
