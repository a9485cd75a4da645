"""The view's GPUs as ``gpus.view.gpuslice.dev`` objects: names, labels, table cells, and the
label and field selectors the API applies to them."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice_core.errors import InvalidArgumentError
from gpuslice_testkit.view import claim, gpu, mig, resource_slice, result
from gpuslice_view import report, resource
from gpuslice_view.model import ClusterView
from gpuslice_view.selectors import field_selector, label_selector


def objects() -> dict[str, Any]:
    view = ClusterView.build(
        slices=[resource_slice("node-a", [gpu(0), mig(2, "1g.10gb", 0, 9984)])],
        claims=[
            claim(
                "ml",
                "a",
                results=[result("node-a", "gpu-0", cores="30", memory="20Gi")],
                pods=("p",),
            )
        ],
    )
    found = [resource.gpu_object(row) for row in report.gpu_rows(view)]
    return {o["metadata"]["name"]: o for o in found}


def test_names_labels_and_the_spec_status_split() -> None:
    objs = objects()
    assert sorted(objs) == ["node-a.gpu-0", "node-a.gpu-2-mig-1g-10gb-0"]
    whole, part = objs["node-a.gpu-0"], objs["node-a.gpu-2-mig-1g-10gb-0"]
    assert whole["metadata"]["labels"] == {
        "gpuslice.dev/node": "node-a",
        "gpuslice.dev/type": "gpu",
        "gpuslice.dev/model": "NVIDIA-H100-80GB-HBM3",
        "gpuslice.dev/cordoned": "false",
        "gpuslice.dev/allocated": "true",
    }
    assert part["metadata"]["labels"]["gpuslice.dev/mig-profile"] == "1g.10gb"
    assert whole["status"]["allocatedCores"] == 30
    assert "ageSeconds" not in whole["status"]["live"]
    assert whole["metadata"]["uid"] == resource.uid("node-a.gpu-0")
    cells = resource.cells(whole)
    assert cells[:4] == ["node-a.gpu-0", "node-a", "NVIDIA H100 80GB HBM3", "30%"]
    assert cells[-2:] == ["GPU-00000000-aaaa", "p"]
    assert len(cells) == len(resource.column_definitions())


def test_label_values_that_do_not_fit_are_left_out() -> None:
    assert resource.label_value("NVIDIA A100-SXM4-80GB (rev 1)") == "NVIDIA-A100-SXM4-80GB-rev-1"
    assert resource.label_value("x" * 64) is None
    assert resource.label_value("  ") is None


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("", {}, True),
        ("a=b", {"a": "b"}, True),
        ("a==b", {"a": "c"}, False),
        ("a!=b", {}, True),
        ("x.io/a in (b, c)", {"x.io/a": "c"}, True),
        ("a notin (b)", {"a": "b"}, False),
        ("a notin (b)", {}, True),
        ("a,!c", {"a": "1"}, True),
        ("a,!c", {"a": "1", "c": ""}, False),
        ("a in ()", {"a": ""}, False),
    ],
)
def test_label_selectors_as_the_api_server_reads_them(
    selector: str, labels: dict[str, str], matches: bool
) -> None:
    assert label_selector(selector)(labels) is matches


@pytest.mark.parametrize("bad", ["a b", "a=(b)", "a in (b", "=b", "a in (b c)"])
def test_bad_label_selectors_name_what_was_given(bad: str) -> None:
    with pytest.raises(InvalidArgumentError, match="labelSelector"):
        label_selector(bad)


def test_field_selectors_know_the_name_and_namespace_only() -> None:
    obj = {"metadata": {"name": "n.gpu-0"}}
    assert field_selector("metadata.name=n.gpu-0")(obj)
    assert not field_selector("metadata.name!=n.gpu-0")(obj)
    assert field_selector("metadata.namespace=")(obj)  # cluster-scoped: no namespace
    claim = {"metadata": {"name": "a", "namespace": "ml"}}
    assert field_selector("metadata.namespace==ml,metadata.name=a")(claim)
    assert not field_selector("metadata.namespace!=ml")(claim)
    with pytest.raises(InvalidArgumentError, match=r"spec\.node"):
        field_selector("spec.node=n")


def test_an_object_gives_back_the_row_it_was_built_from() -> None:
    view = ClusterView.build(
        slices=[resource_slice("node-a", [gpu(0), mig(2, "1g.10gb", 0, 9984)])],
        claims=[claim("ml", "a", results=[result("node-a", "gpu-0", cores="30")], pods=("p",))],
    )
    for row in report.gpu_rows(view):
        row["live"].pop("ageSeconds", None)
        assert resource.row_of(resource.gpu_object(row)) == row
