"""A HAMi install that renamed its resources or set defaults (its chart values resourceName,
resourceMem, …, defaultMem, defaultCores, defaultGPUNum) is translated under its own names, and the
controller's --hami-* flags refuse bad values naming the flag."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice_controller.admission.dialects import DEFAULT, Dialects, HamiNames
from gpuslice_controller.admission.translate import ClusterFacts, Denied, translate_pod
from gpuslice_controller.cli import build_parser, settings_from

GI = 2**30
A100_40 = ClusterFacts.of([40 * GI])

RENAMED = HamiNames(
    resource_name="hami.io/vgpu",
    resource_mem="hami.io/vgpu-memory",
    resource_mem_percentage="hami.io/vgpu-memory-percentage",
    resource_cores="hami.io/vgpu-cores",
    resource_priority="hami.io/vgpu-priority",
)


def pod(limits: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


def capacity(limits: dict[str, str], names: HamiNames) -> tuple[int, dict[str, str] | None]:
    """(GPUs, capacity requested) of the translated pod's one request."""
    t = translate_pod(pod(limits), A100_40, dialects=Dialects.of(names))
    assert t is not None and t.dialect == "hami"
    [request] = t.templates[0]["spec"]["spec"]["devices"]["requests"]
    exactly = request.get("exactly") or request["firstAvailable"][0]
    return exactly["count"], (exactly.get("capacity") or {}).get("requests")


def test_renamed_resources_are_translated_and_removed() -> None:
    limits = {"hami.io/vgpu": "1", "hami.io/vgpu-memory": "4096", "hami.io/vgpu-cores": "30"}
    t = translate_pod(pod(limits), A100_40, dialects=Dialects.of(RENAMED))
    assert t is not None and t.dialect == "hami"
    [request] = t.templates[0]["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["capacity"]["requests"] == {"cores": "30", "memory": "4Gi"}
    assert {"op": "remove", "path": "/spec/containers/0/resources/limits"} in t.patch


def test_the_renamed_percentage_and_priority_are_read() -> None:
    limits = {"hami.io/vgpu-memory-percentage": "25", "hami.io/vgpu-cores": "60"}
    assert capacity(limits, RENAMED) == (1, {"cores": "60", "memory": "10Gi"})
    t = translate_pod(
        pod({**limits, "hami.io/vgpu-priority": "1"}), A100_40, dialects=Dialects.of(RENAMED)
    )
    assert t is not None
    assert t.warnings == [
        "container 'main': hami.io/vgpu-priority has no DRA counterpart; it was removed"
    ]


def test_with_renamed_resources_hamis_default_names_are_not_translated() -> None:
    """They belong to no dialect of this install: the pod is left alone (the webhook is not even
    called for it: the chart's matchConditions name the install's resources)."""
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"}
    assert translate_pod(pod(limits), A100_40, dialects=Dialects.of(RENAMED)) is None
    assert translate_pod(pod(limits), A100_40) is not None


def test_a_renamed_count_alone_is_translated_but_nvidia_gpu_alone_stays_plain() -> None:
    """nvidia.com/gpu alone is the NVIDIA device plugin's (and DRA's extended resource
    mapping's) whole-GPU request; any other count name is HAMi's own."""
    assert capacity({"hami.io/vgpu": "2"}, RENAMED) == (2, None)  # two whole GPUs
    assert translate_pod(pod({"nvidia.com/gpu": "2"}), A100_40, dialects=DEFAULT) is None


def test_defaults_fill_what_the_container_leaves_out() -> None:
    names = HamiNames(
        resource_name="hami.io/vgpu",
        resource_mem="hami.io/vgpu-memory",
        resource_mem_percentage="hami.io/vgpu-memory-percentage",
        resource_cores="hami.io/vgpu-cores",
        resource_priority="hami.io/vgpu-priority",
        default_mem=2048,
        default_cores=25,
        default_gpu_num=2,
    )
    # a count alone: defaultMem and defaultCores
    assert capacity({"hami.io/vgpu": "1"}, names) == (1, {"cores": "25", "memory": "2Gi"})
    # cores without a count: defaultGPUNum GPUs, defaultMem each
    assert capacity({"hami.io/vgpu-cores": "40"}, names) == (2, {"cores": "40", "memory": "2Gi"})
    # what the container names wins; 0 cores is "no limit" as in HAMi, not the default
    assert capacity({"hami.io/vgpu": "1", "hami.io/vgpu-memory": "8192"}, names) == (
        1,
        {"cores": "25", "memory": "8Gi"},
    )
    assert capacity({"hami.io/vgpu": "1", "hami.io/vgpu-memory-percentage": "50"}, names) == (
        1,
        {"cores": "25", "memory": "20Gi"},
    )
    # an explicit 0 is HAMi's "no limit": a memory-only share (cores by memory, not 25)
    zero = {"hami.io/vgpu": "1", "hami.io/vgpu-cores": "0", "hami.io/vgpu-memory": "4096"}
    assert capacity(zero, names) == (1, {"cores": "10", "memory": "4Gi"})


def test_default_memory_over_any_gpu_is_denied_naming_the_size() -> None:
    names = HamiNames(resource_name="hami.io/vgpu", default_mem=64 * 1024)
    with pytest.raises(Denied, match=r"64Gi.*largest: 40Gi"):
        translate_pod(pod({"hami.io/vgpu": "1"}), A100_40, dialects=Dialects.of(names))


def test_without_defaults_nothing_changes() -> None:
    """HAMi's own defaults (0, 0, 1) are what the tables did before they were configurable."""
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30"}
    default = translate_pod(pod(limits), A100_40)
    explicit = translate_pod(pod(limits), A100_40, dialects=Dialects.of(HamiNames()))
    assert default == explicit


# --- the controller's flags --------------------------------------------------------------------


def test_flags_and_their_variables_set_the_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_HAMI_RESOURCE_MEM", "hami.io/vgpu-memory")
    monkeypatch.setenv("GPUSLICE_HAMI_DEFAULT_CORES", "25")
    args = build_parser().parse_args(
        ["--hami-resource-name=hami.io/vgpu", "--no-manage-certificates"]
    )
    hami = settings_from(args).hami
    assert (hami.resource_name, hami.resource_mem, hami.default_cores) == (
        "hami.io/vgpu",
        "hami.io/vgpu-memory",
        25,
    )
    assert hami.resource_cores == "nvidia.com/gpucores"  # HAMi's own default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--hami-resource-mem=gpumem"],
            "--hami-resource-mem 'gpumem' is not an extended resource name",
        ),
        (
            ["--hami-resource-cores=kubernetes.io/cores"],
            "--hami-resource-cores 'kubernetes.io/cores' is not an extended resource name",
        ),
        (
            ["--hami-resource-mem=hami.io/x", "--hami-resource-cores=hami.io/x"],
            "--hami-resource-cores 'hami.io/x' is also --hami-resource-mem",
        ),
        (
            ["--hami-resource-cores=volcano.sh/vgpu-cores"],
            "--hami-resource-*: resource volcano.sh/vgpu-cores is named by both HAMi and Volcano",
        ),
        (["--hami-default-cores=101"], "--hami-default-cores 101 must be 0 (no limit) to 100"),
        (["--hami-default-mem=-1"], "--hami-default-mem -1 must be 0 (all) or more MiB"),
        (["--hami-default-gpu-num=0"], "--hami-default-gpu-num 0 must be at least 1"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    args = build_parser().parse_args([*argv, "--no-manage-certificates"])
    with pytest.raises(ValueError) as raised:
        settings_from(args)
    assert message in str(raised.value)
