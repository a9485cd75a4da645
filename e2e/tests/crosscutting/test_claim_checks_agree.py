"""What the claims webhook refuses, prepare refuses too (issue 29).

The chart's claims webhook fails open by default (``controller.webhook.claims.failurePolicy:
Ignore``), so a claim admitted while no controller answers must still be stopped: the kubelet
plugin checks the same opaque config when it prepares the claim, with the same strict decoder
(``gpuslice_api.gpuconfig.decode``, called by ``gpuslice_controller.validate`` and
``gpuslice_kubelet_plugin.claims``) and the same rules for which device type a config may
configure and where limits apply (``gpuslice_kubelet_plugin.plan``). Each case here is one claim
as the user writes it and as the scheduler allocates it: the webhook denies it and prepare fails
it with ``BadConfig``, both naming the same field. No API server: both checks are pure.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice_api.names import DRIVER
from gpuslice_controller.admission.validate import ClaimValidator, Classes
from gpuslice_draplugin import ClaimRef
from gpuslice_kubelet_plugin.claims import ClaimError, parse_claim
from gpuslice_kubelet_plugin.discovery import Inventory, discover
from gpuslice_kubelet_plugin.plan import make_plan
from gpuslice_nvml import open_nvml
from gpuslice_testkit.kubelet_plugin.harness import H100X2_MIG, write_node

GIB = 1024**3
POOL = "node-a"
GPU_CLASS, MIG_CLASS = "gpu.gpuslice.dev", "mig.gpuslice.dev"
MIG_DEVICE = "gpu-2-mig-3g-40gb-4"  # the harness's node: gpu-0, gpu-1, gpu-2 in MIG mode
OURS = {"apiVersion": "gpu.gpuslice.dev/v1alpha1", "kind": "GpuConfig"}
NVIDIA = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}

# (what, device class, allocated device, config entry's requests, parameters, field named)
CASES: list[tuple[str, str, str, list[str], Any, str]] = [
    ("unknown field", GPU_CLASS, "gpu-0", [], {**OURS, "extra": True}, "extra"),
    (
        "unknown strategy",
        GPU_CLASS,
        "gpu-0",
        [],
        {**OURS, "sharing": {"strategy": "Sometimes"}},
        "sharing.strategy",
    ),
    ("cores out of range", GPU_CLASS, "gpu-0", [], {**OURS, "limits": {"cores": 500}}, "cores"),
    ("unknown kind", GPU_CLASS, "gpu-0", [], {"apiVersion": "v9", "kind": "Gpu"}, "GpuConfig"),
    (
        "limits on a MIG device",
        MIG_CLASS,
        MIG_DEVICE,
        [],
        {**OURS, "limits": {"cores": 50}},
        "MIG device",
    ),
    (
        "NVIDIA's GpuConfig naming a MIG request",
        MIG_CLASS,
        MIG_DEVICE,
        ["gpu"],
        {**NVIDIA, "sharing": {"strategy": "TimeSlicing"}},
        "GpuConfig",
    ),
]


@pytest.fixture(scope="module")
def inventory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Inventory]:
    config = write_node(Path(tmp_path_factory.mktemp("node")), H100X2_MIG, POOL)
    nvml = open_nvml("fake", config)
    yield discover(nvml)
    nvml.close()


def _entry(parameters: Any, requests: list[str]) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": DRIVER, "parameters": parameters}}
    if requests:
        entry["requests"] = requests
    return entry


@pytest.mark.parametrize(
    ("device_class", "device", "requests", "parameters", "field"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_config_the_webhook_denies_fails_at_prepare(
    inventory: Inventory,
    device_class: str,
    device: str,
    requests: list[str],
    parameters: Any,
    field: str,
) -> None:
    spec = {
        "devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}],
            "config": [_entry(parameters, requests)],
        }
    }
    # at the door
    decision = ClaimValidator(Classes(), max_gpu_memory=lambda: 80 * GIB).review(
        {
            "uid": "u",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "operation": "CREATE",
            "object": {"metadata": {"name": "c"}, "spec": spec},
        }
    )
    assert not decision.allowed, "the webhook admitted it"
    assert field in decision.message, decision.message
    # admitted anyway (failurePolicy Ignore, no controller), allocated, prepared
    claim = {
        "metadata": {"uid": "u1", "namespace": "ns", "name": "c"},
        "spec": spec,
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": device}
                    ],
                    "config": [{"source": "FromClaim", **_entry(parameters, requests)}],
                }
            }
        },
    }
    with pytest.raises(ClaimError) as refused:
        parsed = parse_claim(claim, ClaimRef("ns", "c", "u1"), driver=DRIVER, pool=POOL)
        make_plan(parsed, inventory, POOL)
    assert refused.value.reason == "BadConfig", str(refused.value)
    assert field in str(refused.value), str(refused.value)
