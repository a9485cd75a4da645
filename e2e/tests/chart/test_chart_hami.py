"""controller.webhook.pods.hami (a HAMi install's renamed resources and defaults) feeds both the
pod webhook's matchConditions and the controller's translation, so a pod asking for a renamed
resource reaches the webhook and is translated under that name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from e2e.sandbox.binaries import REPO_ROOT
from e2e.support.chart import Obj, env_of, every_name, helm, one, render, sets
from gpuslice_controller.admission.dialects import DEFAULT, Dialects, HamiNames
from gpuslice_controller.cli import build_parser, settings_from

CHART = REPO_ROOT / "charts" / "gpuslice"
RENAMED = {
    "resourceName": "hami.io/vgpu",
    "resourceMem": "hami.io/vgpu-memory",
    "resourceMemPercentage": "hami.io/vgpu-memory-percentage",
    "resourceCores": "hami.io/vgpu-cores",
    "resourcePriority": "hami.io/vgpu-priority",
    "defaultMem": "2048",
    "defaultCores": "25",
    "defaultGPUNum": "1",
}
RENAMED_NAMES = HamiNames(
    resource_name="hami.io/vgpu",
    resource_mem="hami.io/vgpu-memory",
    resource_mem_percentage="hami.io/vgpu-memory-percentage",
    resource_cores="hami.io/vgpu-cores",
    resource_priority="hami.io/vgpu-priority",
    default_mem=2048,
    default_cores=25,
    default_gpu_num=1,
)


def renamed_args() -> list[str]:
    return sets(*(f"controller.webhook.pods.hami.{k}={v}" for k, v in RENAMED.items()))


def match_lists(objs: list[Obj]) -> tuple[set[str], set[str]]:
    """The resources and annotations the pod webhook's matchCondition sends to the controller."""
    config = one(objs, "MutatingWebhookConfiguration")
    [webhook] = config["webhooks"]
    [condition] = webhook["matchConditions"]
    lists = re.findall(r"k in \[([^\]]*)\]", condition["expression"])
    resources = {n.strip().strip("'") for n in lists[0].split(",")}
    for other in lists[1:-1]:  # the same list for limits and requests, containers and init
        assert {n.strip().strip("'") for n in other.split(",")} == resources
    annotations = {n.strip().strip("'") for n in lists[-1].split(",")}
    return resources, annotations


def controller_hami(objs: list[Obj], monkeypatch: pytest.MonkeyPatch) -> HamiNames:
    """What the controller reads from the environment the chart gives it."""
    [container] = one(objs, "Deployment", "gpuslice-controller")["spec"]["template"]["spec"][
        "containers"
    ]
    with monkeypatch.context() as m:
        for var in every_name(build_parser()):
            m.delenv(var, raising=False)
        for var, value in env_of(container).items():
            m.setenv(var, value if isinstance(value, str) else "from-the-pod")
        return settings_from(build_parser().parse_args(container.get("args", []))).hami


def test_by_default_the_webhook_is_sent_exactly_the_dialects_resources(
    helm_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(helm_bin)
    resources, annotations = match_lists(objs)
    assert resources == set(DEFAULT.resources)
    assert "nvidia.com/gpu" not in resources  # alone, the plain whole-GPU request
    assert annotations == {a for d in DEFAULT.all for a in d.annotations}
    assert controller_hami(objs, monkeypatch) == HamiNames()


def test_renamed_hami_resources_reach_the_webhook_and_the_translation(
    helm_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(helm_bin, *renamed_args())
    resources, _ = match_lists(objs)
    renamed = Dialects.of(RENAMED_NAMES)
    assert resources == set(renamed.resources)
    # the renamed count is HAMi's own (not nvidia.com/gpu): a pod asking only for it is sent
    assert {"hami.io/vgpu", "hami.io/vgpu-memory", "hami.io/vgpu-cores"} <= resources
    assert not {"nvidia.com/gpumem", "nvidia.com/gpucores"} & resources
    assert controller_hami(objs, monkeypatch) == RENAMED_NAMES


@pytest.mark.parametrize(
    ("assignment", "error"),
    [
        (
            "controller.webhook.pods.hami.resourceMem=gpumem",
            "at '/controller/webhook/pods/hami/resourceMem': 'gpumem' does not match pattern",
        ),
        (
            "controller.webhook.pods.hami.defaultCores=101",
            "at '/controller/webhook/pods/hami/defaultCores'",
        ),
        (
            "controller.webhook.pods.hami.resourceNmae=hami.io/vgpu",
            "at '/controller/webhook/pods/hami': additional properties 'resourceNmae' not allowed",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    helm_bin: Path, assignment: str, error: str
) -> None:
    out = helm(
        helm_bin,
        "template",
        "gpuslice",
        str(CHART),
        "-n",
        "gpuslice",
        *sets(assignment),
        check=False,
    )
    assert out.returncode != 0
    assert error in out.stderr
