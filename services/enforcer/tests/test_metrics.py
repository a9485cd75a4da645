"""The enforcer's share series: labelled as dcgm-exporter labels a GPU, SM as a 0..1 ratio, and
gone when the share is released."""

from __future__ import annotations

from prometheus_client import generate_latest

from gpuslice_enforcer.metrics import EnforcerMetrics
from gpuslice_enforcer.state import ShareRecord
from gpuslice_enforcer.watchdog import DeviceUsage, _labels


def share(uid: str) -> ShareRecord:
    return ShareRecord(
        claim_uid=uid, share_id=uid, device_uuids=["GPU-b", "GPU-d"], gpu_indices=[1, 3]
    )


def test_share_series_name_the_gpu_by_index_and_uuid_and_drop_on_release() -> None:
    metrics = EnforcerMetrics()
    for uid in ("uid-a", "uid-b"):
        labels = _labels(share(uid), DeviceUsage(device_uuid="GPU-d"))
        metrics.sm_used.labels(*labels).set(30 / 100)
        metrics.violations.labels(*labels, "cores", "throttled").inc()
    text = generate_latest(metrics.registry).decode()
    assert 'gpuslice_enforcer_share_sm_ratio{UUID="GPU-d",claim_uid="uid-a",gpu="3"} 0.3' in text
    metrics.forget_share("uid-a")
    text = generate_latest(metrics.registry).decode()
    assert 'claim_uid="uid-a"' not in text
    assert 'gpuslice_enforcer_share_sm_ratio{UUID="GPU-d",claim_uid="uid-b",gpu="3"} 0.3' in text
    assert 'action="throttled",claim_uid="uid-b"' in text


def test_a_share_without_recorded_indices_has_an_empty_gpu_label() -> None:
    """Checkpoints from before gpu_indices existed: the UUID still joins, ``gpu`` is absent."""
    old = ShareRecord(claim_uid="uid-o", share_id="s", device_uuids=["GPU-b"])
    assert _labels(old, DeviceUsage(device_uuid="GPU-b")) == ("uid-o", "", "GPU-b")
