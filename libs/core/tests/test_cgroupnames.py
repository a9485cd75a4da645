"""A pod's cgroup paths as kubelets name them, cgroupfs and systemd drivers."""

from __future__ import annotations

from gpuslice_core.cgroupnames import names_pod

UID = "1f2e3d4c-aaaa-bbbb-cccc-000000000001"


def test_both_drivers_name_the_pod() -> None:
    cgroupfs = [f"/kubepods/burstable/pod{UID}/0123456789abcdef"]
    systemd = [
        "/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{UID.replace('-', '_')}.slice/cri-containerd-0123.scope"
    ]
    assert names_pod(cgroupfs, UID) and names_pod(systemd, UID)


def test_another_pod_or_no_uid_does_not_match() -> None:
    paths = [f"/kubepods/burstable/pod{UID}/0123"]
    assert not names_pod(paths, "1f2e3d4c-aaaa-bbbb-cccc-000000000002")
    assert not names_pod(paths, "")
    assert not names_pod([], UID)
