"""The cluster view as a user sees it: table rows, describe, claims, references, cordons."""

from __future__ import annotations

import pytest

from gpuslice_core.errors import NotFoundError
from gpuslice_testkit.view import (
    CLASSES,
    GIB,
    claim,
    gpu,
    mig,
    resource_slice,
    result,
    taint_rule,
    v1beta1_device,
)
from gpuslice_view import report
from gpuslice_view.cordon import rule, rule_name
from gpuslice_view.model import ClusterView


def cluster() -> ClusterView:
    """node-a: two H100s (gpu-0 shared by two claims, gpu-1 free) and a GPU in MIG mode;
    node-b: one L4 taken whole."""
    return ClusterView.build(
        slices=[
            resource_slice(
                "node-a", [gpu(0), gpu(1), mig(2, "3g.40gb", 4, 40448), mig(2, "1g.10gb", 0, 9984)]
            ),
            resource_slice("node-b", [gpu(0, model="NVIDIA L4", mib=23034)]),
        ],
        claims=[
            claim(
                "ml",
                "a",
                results=[result("node-a", "gpu-0", cores="30", memory="20Gi")],
                pods=("pa",),
            ),
            claim(
                "ml",
                "b",
                results=[result("node-a", "gpu-0", cores="50", memory="40Gi")],
                pods=("pb",),
            ),
            claim("web", "whole", results=[result("node-b", "gpu-0")], pods=("w",)),
            claim(
                "ml",
                "m",
                device_class="mig.gpuslice.dev",
                results=[result("node-a", "gpu-2-mig-3g-40gb-4")],
            ),
            claim("ml", "pending", memory="10Gi"),
        ],
        classes=CLASSES,
    )


def test_top_gpus_rows_show_allocated_cores_and_memory_per_device() -> None:
    text = report.gpu_table(report.gpu_rows(cluster()))
    assert text.splitlines() == [
        "NODE     DEVICE                MODEL                   CORES%   MEMORY          MEMORY%   SM-USED   MEM-USED   CLAIMS   STATUS",  # noqa: E501 - a table row
        "node-a   gpu-0                 NVIDIA H100 80GB HBM3   80%      60Gi/79.6Gi     75%       -         -          2        Ready",  # noqa: E501 - a table row
        "node-a   gpu-1                 NVIDIA H100 80GB HBM3   0%       0Gi/79.6Gi      0%        -         -          0        Ready",  # noqa: E501 - a table row
        "node-a   gpu-2-mig-1g-10gb-0   MIG 1g.10gb             -        0Gi/9.8Gi       0%        -         -          0        Ready",  # noqa: E501 - a table row
        "node-a   gpu-2-mig-3g-40gb-4   MIG 3g.40gb             -        39.5Gi/39.5Gi   100%      -         -          1        Ready",  # noqa: E501 - a table row
        "node-b   gpu-0                 NVIDIA L4               100%     22.5Gi/22.5Gi   100%      -         -          1        Ready",  # noqa: E501 - a table row
    ]


def test_rows_carry_exact_figures_and_who_holds_what() -> None:
    rows = {r["ref"]: r for r in report.gpu_rows(cluster())}
    row = rows["node-a/0"]
    assert row["uuid"] == "GPU-00000000-aaaa"
    assert row["cores"] == {"total": 100, "used": 80}
    assert row["memory"] == {"total": 81559 * 2**20, "used": 60 * GIB}
    assert [(a["claim"], a["cores"], a["memory"], a["pods"]) for a in row["allocations"]] == [
        ("ml/a", 30, 20 * GIB, ["pa"]),
        ("ml/b", 50, 40 * GIB, ["pb"]),
    ]
    whole = rows["node-b/0"]["allocations"][0]
    assert whole["whole"] and whole["memory"] == 23034 * 2**20 and whole["cores"] == 100
    assert rows["node-a/gpu-2-mig-3g-40gb-4"]["parentUUID"] == "GPU-00000002-aaaa"


def test_the_view_follows_changes_object_by_object() -> None:
    view = cluster()
    view.apply("ResourceClaim", "DELETED", claim("ml", "a"))
    view.apply(
        "ResourceClaim",
        "ADDED",
        claim("ml", "c", results=[result("node-a", "gpu-1", cores="10", memory="1Gi")]),
    )
    usage = {u.device.ref: (u.cores, u.memory) for u in view.usage().values()}
    assert usage["node-a/0"] == (50, 40 * GIB)
    assert usage["node-a/1"] == (10, GIB)
    view.apply("ResourceSlice", "DELETED", resource_slice("node-b", []))
    assert {d.node for d in view.devices()} == {"node-a"}


def test_a_republished_pool_counts_only_its_newest_generation() -> None:
    view = ClusterView.build(
        slices=[
            resource_slice("node-a", [gpu(0)], generation=1),
            {
                **resource_slice("node-a", [gpu(0), gpu(1)], generation=2),
                "metadata": {"name": "new"},
            },
        ]
    )
    assert [d.ref for d in view.devices()] == ["node-a/0", "node-a/1"]


def test_v1beta1_slices_and_claims_read_the_same() -> None:
    view = ClusterView.build(
        slices=[resource_slice("node-a", [v1beta1_device(gpu(0))])],
        claims=[
            claim(
                "ml",
                "a",
                v1beta1=True,
                results=[result("node-a", "gpu-0", cores="25", memory="8Gi")],
            )
        ],
        classes=CLASSES,
    )
    [row] = report.gpu_rows(view)
    assert row["model"] == "NVIDIA H100 80GB HBM3"
    assert (row["cores"]["used"], row["memory"]["used"]) == (25, 8 * GIB)
    assert view.claims[("ml", "a")].requests[0].device_class == "gpu.gpuslice.dev"


def test_describe_lists_taints_and_allocations() -> None:
    view = cluster()
    view.apply("DeviceTaintRule", "ADDED", taint_rule("c0", "node-a", "gpu-0"))
    device = view.find("node-a/0")
    text = report.describe_gpu(report.gpu_row(view, view.usage()[device.key]))
    assert "Cores:      80% of 100% allocated" in text
    assert "Memory:     60Gi of 79.6Gi allocated (75%)" in text
    assert "Status:     Cordoned" in text
    assert "  gpu.gpuslice.dev/cordon:NoSchedule  (DeviceTaintRule c0)" in text
    assert "ml/a    gpu       30%     20Gi     -         -          pa" in text


def test_status_shows_cordons_and_health_taints() -> None:
    sick = gpu(1)
    sick["taints"] = [{"key": "gpu.gpuslice.dev/xid", "value": "79", "effect": "NoSchedule"}]
    info = gpu(2)
    info["taints"] = [{"key": "gpu.gpuslice.dev/xid", "value": "13", "effect": "None"}]
    view = ClusterView.build(
        slices=[resource_slice("n", [gpu(0), sick, info])],
        rules=[taint_rule("r", "n", "gpu-0", effect="NoExecute")],
    )
    assert [report.status(view, d) for d in view.devices()] == [
        "Cordoned(evict)",
        "Tainted(xid)",
        "Ready",
    ]


def test_claims_table_per_namespace_and_all() -> None:
    view = cluster()
    one = report.claim_table(report.claim_rows(view, "web"), all_namespaces=False)
    assert one.splitlines() == [
        "NAME    STATE       DEVICES    CORES   MEMORY   SM-USED   MEM-USED   PODS",
        "whole   Allocated   node-b/0   100%    22.5Gi   -         -          w",
    ]
    every = report.claim_rows(view, None)
    assert [(r["namespace"], r["name"], r["state"]) for r in every] == [
        ("ml", "a", "Allocated"),
        ("ml", "b", "Allocated"),
        ("ml", "m", "Allocated"),
        ("ml", "pending", "Pending"),
        ("web", "whole", "Allocated"),
    ]
    table = report.claim_table(every, all_namespaces=True)
    assert table.splitlines()[4].split() == ["ml", "pending", "Pending", *["-"] * 6]


def test_references_by_uuid_index_and_device_name() -> None:
    view = cluster()
    assert view.find("GPU-00000001-aaaa").ref == "node-a/1"
    assert view.find("gpu-00000001-AAAA").ref == "node-a/1"
    assert view.find("node-b/0").model == "NVIDIA L4"
    assert view.find("node-a/gpu-2-mig-1g-10gb-0").kind == "mig"
    assert view.find("MIG-2-4").profile == "3g.40gb"


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        (
            "node-c/0",
            "node 'node-c' has no gpu.gpuslice.dev devices; nodes with GPUs: node-a, node-b",
        ),
        (
            "node-a/2",
            "GPU 2 on node-a is in MIG mode; name one of its MIG devices: node-a/gpu-2-mig",
        ),
        ("node-a/9", "Known: node-a/0, node-a/1, node-a/gpu-2-mig-1g-10gb-0"),
        (
            "GPU-nope",
            "give a UUID, <node>/<index> or <node>/<device>. Known: GPU-00000000-aaaa (node-a/0)",
        ),
    ],
)
def test_a_bad_reference_names_what_was_given_and_what_exists(ref: str, says: str) -> None:
    with pytest.raises(NotFoundError) as err:
        cluster().find(ref)
    assert f"no GPU {ref!r}" in str(err.value)
    assert says in str(err.value)


def test_cordon_rule_is_named_after_the_device_and_selects_only_it() -> None:
    device = cluster().find("node-a/gpu-2-mig-3g-40gb-4")
    assert rule_name(device) == "gpuslice-cordon-node-a-gpu-2-mig-3g-40gb-4"
    body = rule(device, "v1", evict=True)
    assert body["apiVersion"] == "resource.k8s.io/v1"
    assert body["spec"] == {
        "deviceSelector": {"driver": "gpu.gpuslice.dev", "pool": "node-a", "device": device.name},
        "taint": {"key": "gpu.gpuslice.dev/cordon", "effect": "NoExecute"},
    }
    long = ClusterView.build(slices=[resource_slice("n" * 250, [gpu(0)])]).find(f"{'n' * 250}/0")
    name = rule_name(long)
    assert len(name) <= 253 and name.startswith("gpuslice-cordon-nnn")
