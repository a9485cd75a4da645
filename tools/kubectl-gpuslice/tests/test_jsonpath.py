"""-o jsonpath=: the subset of kubectl's JSONPath that kubectl gpuslice supports, and errors
that name what it does not."""

from __future__ import annotations

import pytest

from gpuslice_core.errors import InvalidArgumentError
from gpuslice_kubectl.jsonpath import render

pytestmark = pytest.mark.timeout(10)

LISTED = {
    "kind": "GPUList",
    "items": [
        {
            "metadata": {"name": "n.gpu-0", "labels": {"gpuslice.dev/node": "n"}},
            "spec": {"cores": 100},
        },
        {"metadata": {"name": "n.gpu-1"}, "spec": {"cores": 100, "uuid": None, "mig": True}},
    ],
}


@pytest.mark.parametrize(
    ("template", "printed"),
    [
        ("{.items[*].metadata.name}", "n.gpu-0 n.gpu-1"),
        ("{$.kind}", "GPUList"),
        ("kind={.kind}", "kind=GPUList"),
        (
            '{range .items[*]}{.metadata.name}{"\\t"}{.spec.cores}{"\\n"}{end}',
            "n.gpu-0\t100\nn.gpu-1\t100\n",
        ),
        ("{.items[0].metadata.labels.gpuslice\\.dev/node}", "n"),
        ("{.items[-1]['metadata'].name}", "n.gpu-1"),
        ("{.items[1].spec.*}", "100 null true"),
        ("{.items[0].metadata.labels}", '{"gpuslice.dev/node":"n"}'),
        ("{.items[5].metadata.name}{.nothing}", ""),  # missing prints nothing, as with kubectl get
    ],
)
def test_templates(template: str, printed: str) -> None:
    assert render(template, LISTED) == printed


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{.items[?(@.spec.cores>1)]}", "cannot read '[?(@.spec.cores>1)]'"),
        ("{.items[0:1]}", "cannot read '[0:1]'"),
        ("{..name}", "cannot read '..name'"),
        ("{range .items[*]}{.kind}", "{range} without {end}"),
        ("{end}", "{end} without {range}"),
        ("{.kind", "unbalanced braces"),
    ],
)
def test_what_is_not_supported_says_so(template: str, says: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        render(template, LISTED)
    assert says in str(err.value)
