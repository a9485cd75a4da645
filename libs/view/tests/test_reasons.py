"""``why``: the reason a user reads for each cause of an unschedulable claim."""

from __future__ import annotations

import re
import time

import pytest

from gpuslice_testkit.view import (
    CLASSES,
    Obj,
    claim,
    gpu,
    mig,
    pod,
    resource_slice,
    result,
    taint_rule,
)
from gpuslice_view import cel
from gpuslice_view.model import ClusterView
from gpuslice_view.objects import pod_from
from gpuslice_view.reasons import Reason, why_claim, why_pod

ON_A100 = "device.attributes['gpu.gpuslice.dev'].productName == 'NVIDIA A100-SXM4-40GB'"


def view(*claims: Obj, rules: tuple[Obj, ...] = ()) -> ClusterView:
    """node-a: two H100s; node-b: one L4 (22.5Gi) and a MIG 1g.10gb."""
    return ClusterView.build(
        slices=[
            resource_slice("node-a", [gpu(0), gpu(1)]),
            resource_slice(
                "node-b", [gpu(0, model="NVIDIA L4", mib=23034), mig(1, "1g.10gb", 0, 9984)]
            ),
        ],
        claims=list(claims),
        classes=CLASSES,
        rules=list(rules),
    )


def why(v: ClusterView, name: str = "new") -> list[Reason]:
    return why_claim(v, v.claims[("ml", name)])


def test_no_gpu_has_that_much_free_memory_names_the_largest_free() -> None:
    v = view(
        claim("ml", "x", results=[result("node-a", "gpu-0", cores="10", memory="60Gi")]),
        claim("ml", "y", results=[result("node-a", "gpu-1", cores="10", memory="70Gi")]),
        claim("ml", "new", cores="10", memory="30Gi"),
    )
    [reason] = why(v)
    assert reason.code == "NoFreeMemory"
    assert reason.message == (
        "no matching GPU has 30Gi of free memory; the largest free is 22.5Gi on node node-b "
        "(node-b/0)"
    )
    assert str(reason).startswith("claim ml/new, gpu: no matching GPU has 30Gi")


def test_memory_beyond_every_gpu_says_so() -> None:
    [reason] = why(view(claim("ml", "new", memory="100Gi")))
    assert reason.code == "NoFreeMemory"
    assert "(the largest matching GPU has 79.6Gi)" in reason.message


def test_all_gpus_of_the_model_are_fully_booked() -> None:
    v = view(
        claim("ml", "x", results=[result("node-a", "gpu-0")]),
        claim("ml", "y", results=[result("node-a", "gpu-1", cores="100", memory="1Gi")]),
        claim(
            "ml",
            "new",
            selectors=(
                "device.attributes['gpu.gpuslice.dev'].productName.startsWith('NVIDIA H100')",
            ),
        ),
    )
    [reason] = why(v)
    assert reason.code == "FullyBooked"
    assert reason.message == (
        "all 2 matching devices are fully booked (NVIDIA H100 80GB HBM3): "
        "node-a/0 by ml/x; node-a/1 by ml/y"
    )


def test_no_free_cores() -> None:
    v = view(
        claim("ml", "x", results=[result("node-a", "gpu-0", cores="90", memory="1Gi")]),
        claim("ml", "y", results=[result("node-a", "gpu-1", cores="80", memory="1Gi")]),
        claim("ml", "z", results=[result("node-b", "gpu-0", cores="95", memory="1Gi")]),
        claim("ml", "new", cores="50", memory="1Gi"),
    )
    [reason] = why(v)
    assert reason.code == "NoFreeCores"
    assert "the most free is 20% on node node-a (node-a/1)" in reason.message


def test_the_selector_clause_that_rules_every_device_out_is_named_with_the_values() -> None:
    [reason] = why(view(claim("ml", "new", selectors=(f"{ON_A100} && true",))))
    assert reason.code == "NoMatch"
    assert reason.message == (
        "the selector matches no device: `device.attributes['gpu.gpuslice.dev'].productName == "
        "'NVIDIA A100-SXM4-40GB'` rules out all 3 devices left "
        "(productName is one of 'NVIDIA H100 80GB HBM3', 'NVIDIA L4')"
    )


def test_a_later_clause_is_judged_on_what_the_earlier_ones_left() -> None:
    selector = (
        "device.attributes['gpu.gpuslice.dev'].productName == 'NVIDIA L4' && "
        "device.capacity['gpu.gpuslice.dev'].memory.compareTo(quantity('40Gi')) >= 0"
    )
    [reason] = why(view(claim("ml", "new", selectors=(selector,))))
    assert reason.code == "NoMatch"
    assert "rules out the one device left (memory is 23034Mi)" in reason.message


def test_a_class_without_devices_is_the_reason() -> None:
    v = ClusterView.build(
        slices=[resource_slice("node-a", [gpu(0)])],
        claims=[claim("ml", "new", device_class="mig.gpuslice.dev")],
        classes=CLASSES,
    )
    [reason] = why(v)
    assert reason.code == "NoMatch"
    assert reason.message.startswith(
        "device class mig.gpuslice.dev matches no device: "
        "`device.attributes['gpu.gpuslice.dev'].type == 'mig'` rules out the one device left "
        "(type is 'gpu')"
    )


def test_tainted_devices_name_the_taint_and_the_rule() -> None:
    v = view(
        claim(
            "ml",
            "new",
            selectors=("device.attributes['gpu.gpuslice.dev'].productName == 'NVIDIA L4'",),
        ),
        rules=(taint_rule("gpuslice-cordon-node-b-gpu-0", "node-b", "gpu-0"),),
    )
    [reason] = why(v)
    assert reason.code == "Tainted"
    assert reason.message == (
        "every matching device is tainted: node-b/0: gpu.gpuslice.dev/cordon:NoSchedule "
        "(DeviceTaintRule gpuslice-cordon-node-b-gpu-0)"
    )
    tolerant = claim(
        "ml",
        "tolerant",
        selectors=("device.attributes['gpu.gpuslice.dev'].productName == 'NVIDIA L4'",),
        tolerations=[{"key": "gpu.gpuslice.dev/cordon", "operator": "Exists"}],
    )
    v.apply("ResourceClaim", "ADDED", tolerant)
    assert [r.code for r in why(v, "tolerant")] == ["Fits"]


def test_a_cordoned_gpu_leaves_the_others_and_only_when_all_are_taken_says_so() -> None:
    rules = tuple(taint_rule(f"c{i}", "node-a", f"gpu-{i}") for i in (0, 1))
    v = view(claim("ml", "new", memory="30Gi"), rules=rules)
    [reason] = why(v)
    assert reason.code == "NoFreeMemory"  # the L4 is left, and it is too small
    assert "the largest free is 22.5Gi on node node-b" in reason.message


def test_mig_devices_in_use_are_fully_booked_and_count_matters() -> None:
    v = view(
        claim(
            "ml",
            "x",
            device_class="mig.gpuslice.dev",
            results=[result("node-b", "gpu-1-mig-1g-10gb-0")],
        ),
        claim("ml", "new", device_class="mig.gpuslice.dev"),
        claim("ml", "two", count=2, memory="1Gi"),
    )
    [reason] = why(v)
    assert (reason.code, reason.message) == (
        "FullyBooked",
        "the one matching device is fully booked (NVIDIA H100 80GB HBM3): "
        "node-b/gpu-1-mig-1g-10gb-0 by ml/x",
    )
    assert [r.code for r in why(v, "two")] == ["Fits"]
    v.apply("ResourceClaim", "ADDED", claim("ml", "four", count=4, memory="1Gi"))
    [reason] = why(v, "four")
    assert reason.message == "asks for 4 devices; 3 fit: node-a/0, node-a/1, node-b/0"


def test_an_allocated_claim_says_where() -> None:
    v = view(
        claim(
            "ml", "new", results=[result("node-a", "gpu-1", cores="10", memory="1Gi")], pods=("p",)
        )
    )
    [reason] = why(v)
    assert (reason.code, reason.message) == (
        "Allocated",
        "allocated: gpu on node-a/1; reserved for p",
    )


def test_a_pod_is_judged_on_its_node_and_its_claims() -> None:
    v = view(claim("ml", "p-gpu-abc", memory="30Gi"))
    pinned = pod_from(pod("ml", "p", template="t", generated="p-gpu-abc", hostname="node-b"))
    assert pinned is not None
    [reason] = why_pod(v, pinned)
    assert reason.code == "NoFreeMemory"  # node-a's H100s have room, but the pod wants node-b
    waiting = pod_from(pod("ml", "q", template="t"))
    assert waiting is not None
    [reason] = why_pod(v, waiting)
    assert reason.code == "ClaimNotCreated"
    assert "template t" in reason.message
    gone = pod_from(pod("ml", "r", claim="nope"))
    assert gone is not None
    assert [r.message for r in why_pod(v, gone)] == ["ResourceClaim ml/nope does not exist"]


def test_first_available_fails_only_when_every_alternative_fails() -> None:
    pending = claim("ml", "new")
    pending["spec"]["devices"]["requests"] = [
        {
            "name": "gpu",
            "firstAvailable": [
                {
                    "name": "big",
                    "deviceClassName": "gpu.gpuslice.dev",
                    "capacity": {"requests": {"memory": "90Gi"}},
                },
                {
                    "name": "small",
                    "deviceClassName": "gpu.gpuslice.dev",
                    "selectors": [{"cel": {"expression": ON_A100}}],
                },
            ],
        }
    ]
    [big, small] = why(view(pending))
    assert (big.request, big.code) == ("gpu/big", "NoFreeMemory")
    assert (small.request, small.code) == ("gpu/small", "NoMatch")


def test_cel_subset() -> None:
    env = cel.device_env(
        "gpu.gpuslice.dev",
        {"productName": {"string": "NVIDIA L4"}, "driverVersion": {"version": "570.158.1"}},
        {"memory": {"value": "23034Mi"}},
    )
    d = "device.attributes['gpu.gpuslice.dev']"
    yes = [
        f"{d}.driverVersion.isGreaterThan(semver('550.0.0'))",
        f"{d}.productName in ['NVIDIA L4', 'T4']",
        f"has({d}.productName) && !has({d}.profile)",
        f"{d}.profile == 'x' || {d}.productName.lowerAscii().contains('l4')",
        "device.capacity['gpu.gpuslice.dev'].memory.compareTo(quantity('20Gi')) > 0",
    ]
    no = [f"{d}.profile == 'x'", f"{d}.productName.matches('^T')"]
    assert [cel.matches(cel.parse(e), env) for e in yes] == [True] * len(yes)
    assert [cel.matches(cel.parse(e), env) for e in no] == [False] * len(no)


def test_cel_the_api_server_takes_but_we_cannot_afford_is_not_judged() -> None:
    """The API server takes 5,000 ``!`` in a row and patterns that make Python's re backtrack
    for hours; ``why`` must not recurse or stall on them (it holds the view's lock)."""
    env = cel.device_env("gpu.gpuslice.dev", {"productName": {"string": "NVIDIA H100 80GB"}}, {})
    d = "device.attributes['gpu.gpuslice.dev'].productName"
    for expression, reason in [
        ("!" * 5000 + "true", "nests deeper than 50"),
        ("(" * 300 + "true" + ")" * 300, "nests deeper than 50"),
        (" && ".join(["true"] * 100), "nests deeper than 50"),
    ]:
        with pytest.raises(cel.Unsupported, match=reason):
            cel.parse(expression)
    for pattern, reason in [
        ("^(.*.*.*)*X$", "a repeat inside a repeat"),
        ("^(a|b.*)+$", "an alternation in a repeat"),
        ("(a)\\\\1", "a back-reference"),
        (".*a.*b.*c", "more than 2 repeats"),
    ]:
        with pytest.raises(cel.Unsupported, match=re.escape(reason)):
            cel.matches(cel.parse(f"{d}.matches('{pattern}')"), env)
    with pytest.raises(cel.Unsupported, match="longer than 64"):
        cel.matches(cel.parse(f"'{'a' * 100}'.matches('a*b')"), env)
    assert cel.matches(cel.parse(f"{d}.matches('^NVIDIA H1[0-9]+ .*GB$')"), env)
    assert cel.matches(cel.parse(" && ".join(["true"] * 40)), env)
    v = view(claim("ml", "new", selectors=(f"{d}.matches('^(.*.*.*)*X$')",)))
    start = time.perf_counter()
    assert [r.code for r in why(v)] == ["Fits"]  # not judged: the scheduler decides
    assert time.perf_counter() - start < 0.5
