"""The claim validator: what a user who writes a claim sees at the door."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice_controller.admission.review import Decision
from gpuslice_controller.admission.validate import ClaimValidator, Classes

GIB = 1024**3
GPU, MIG = "gpu.gpuslice.dev", "mig.gpuslice.dev"
validator = ClaimValidator(Classes(), max_gpu_memory=lambda: 80 * GIB)


def claim(
    requests: list[dict[str, Any]],
    config: list[dict[str, Any]] | None = None,
    *,
    kind: str = "ResourceClaim",
    version: str = "v1",
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": requests, "config": config or []}
    spec: dict[str, Any] = {"devices": devices}
    obj = {"metadata": {"name": "c"}, "spec": spec if kind == "ResourceClaim" else {"spec": spec}}
    return {
        "uid": "u",
        "kind": {"group": "resource.k8s.io", "version": version, "kind": kind},
        "operation": "CREATE",
        "object": obj,
    }


def exactly(cls: str = GPU, **capacity: str) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": cls}
    if capacity:
        body["capacity"] = {"requests": capacity}
    return {"name": "gpu", "exactly": body}


def opaque(parameters: Any, requests: list[str] | None = None, driver: str = GPU) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        entry["requests"] = requests
    return entry


def gpuconfig(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": "gpu.gpuslice.dev/v1alpha1", "kind": "GpuConfig", **fields}


def review(req: dict[str, Any]) -> Decision:
    return validator.review(req)


def test_a_share_with_cores_and_memory_is_admitted_without_warnings() -> None:
    d = review(claim([exactly(cores="30", memory="20Gi")]))
    assert d.allowed and not d.warnings


def test_an_exclusive_gpu_and_other_drivers_claims_pass_untouched() -> None:
    assert review(claim([exactly()])) == Decision.allow()
    other = claim(
        [exactly("nic.example.com", bandwidth="10G")],
        [opaque({"anything": 1}, driver="nic.example.com")],
    )
    assert review(other) == Decision.allow()


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        (
            {"cores": "0"},
            "exactly.capacity.requests.cores: '0' is not allowed; allowed: an integer 1..100",
        ),
        ({"cores": "101"}, "cores: '101' is not allowed"),
        ({"cores": "30.5"}, "cores: '30.5' is not allowed"),
        ({"cores": "lots"}, "cores: 'lots' is not allowed"),
        (
            {"memory": "512Ki"},
            "memory: '512Ki' is not allowed; allowed: a quantity of at least 1Mi",
        ),
        (
            {"memory": "100Gi"},
            "memory: '100Gi' is more than any GPU in the cluster has; allowed: 1Mi..80Gi",
        ),
        ({"sms": "10"}, "unknown capacity sms; allowed: cores, memory"),
    ],
)
def test_capacity_out_of_the_device_model_is_denied_naming_the_field(
    capacity: dict[str, str], message: str
) -> None:
    d = review(claim([exactly(**capacity)]))
    assert not d.allowed
    assert "spec.devices.requests[0].exactly.capacity.requests" in d.message
    assert message in d.message


@pytest.mark.parametrize(("asked", "other"), [("cores", "memory"), ("memory", "cores")])
def test_a_one_sided_share_is_admitted_with_a_warning(asked: str, other: str) -> None:
    d = review(claim([exactly(**{asked: "10" if asked == "cores" else "4Gi"})]))
    assert d.allowed
    [warning] = d.warnings
    assert f"asks for {asked} but not {other}" in warning
    assert f"Add capacity.requests.{other}" in warning


def test_memory_that_is_not_whole_mib_is_admitted_with_the_rounding_stated() -> None:
    d = review(claim([exactly(cores="10", memory="1500000")]))
    assert d.allowed and d.warnings == (
        "spec.devices.requests[0].exactly.capacity.requests.memory: '1500000' is not a whole "
        "number of MiB; the scheduler rounds it up to 2Mi",
    )


def test_a_bad_gpuconfig_gets_one_denial_listing_every_field() -> None:
    bad = gpuconfig(sharing={"strategy": "Sometimes"}, limits={"cores": 500}, extra=True)
    d = review(claim([exactly()], [opaque(bad)]))
    assert not d.allowed
    assert d.message.startswith("ResourceClaim c: spec.devices.config[0].opaque.parameters: ")
    for text in ("sharing.strategy: 'Sometimes'", "limits.cores: 500", "unknown field 'extra'"):
        assert text in d.message


def test_an_unknown_kind_is_denied_with_what_is_accepted() -> None:
    d = review(claim([exactly()], [opaque({"apiVersion": "v9", "kind": "Gpu"})]))
    assert not d.allowed and "this driver accepts gpu.gpuslice.dev/v1alpha1 GpuConfig" in d.message


def test_mig_devices_are_whole_no_capacity_no_limits() -> None:
    d = review(claim([exactly(MIG, memory="5Gi")]))
    assert not d.allowed and "a MIG device is allocated whole" in d.message
    d = review(claim([exactly(MIG)], [opaque(gpuconfig(limits={"cores": 50}))]))
    assert not d.allowed and "limits apply to spec.devices.requests[0].exactly" in d.message
    # Limits for a named GPU request in a claim that also has a MIG request are fine.
    both = [exactly(), {"name": "mig", "exactly": {"deviceClassName": MIG}}]
    d = review(claim(both, [opaque(gpuconfig(limits={"cores": 50}), ["gpu"])]))
    assert d.allowed


def test_nvidia_kinds_pass_over_the_other_device_type_unless_they_name_it() -> None:
    nvidia = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing"},
    }
    mig = {"name": "mig", "exactly": {"deviceClassName": MIG}}
    assert review(claim([mig], [opaque(nvidia)])).allowed
    d = review(claim([mig], [opaque(nvidia, ["mig"])]))
    assert not d.allowed and "cannot configure" in d.message


def test_every_problem_of_a_template_in_v1beta1_is_reported_at_once() -> None:
    requests: list[dict[str, Any]] = [
        {"name": "a", "deviceClassName": GPU, "capacity": {"requests": {"cores": "0"}}},
        {
            "name": "b",
            "firstAvailable": [
                {
                    "name": "big",
                    "deviceClassName": GPU,
                    "capacity": {"requests": {"memory": "1Ti"}},
                },
            ],
        },
    ]
    d = review(
        claim(
            requests,
            [opaque(gpuconfig(enforcement={"mode": "Maybe"}))],
            kind="ResourceClaimTemplate",
            version="v1beta1",
        )
    )
    assert not d.allowed
    assert "spec.spec.devices.requests[0].capacity.requests.cores: '0'" in d.message
    assert "spec.spec.devices.requests[1].firstAvailable[0].capacity.requests.memory" in d.message
    assert "spec.spec.devices.config[0].opaque.parameters: enforcement.mode" in d.message


def test_without_published_gpus_the_memory_ceiling_is_not_guessed() -> None:
    blind = ClaimValidator(Classes(), max_gpu_memory=lambda: None)
    assert blind.review(claim([exactly(cores="1", memory="1Ti")])).allowed
