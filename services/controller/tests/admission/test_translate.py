"""translate_pod: one table row per dialect and unit, every denial, idempotence through a real
JSON-patch application, init containers, several containers, stable template names, CEL."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from gpuslice_api import gpuconfig
from gpuslice_api.names import TRANSLATED_ANNOTATION
from gpuslice_controller.admission.selectors import cel_string
from gpuslice_controller.admission.translate import (
    ClusterFacts,
    Denied,
    Translation,
    pointer_escape,
    translate_pod,
)

GI = 2**30
MI = 2**20
A100_40 = ClusterFacts.of([40 * GI])
MIXED = ClusterFacts.of([40 * GI, 80 * GI])
UNKNOWN = ClusterFacts()
DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


# --- helpers -----------------------------------------------------------------------------------


def ctr(name: str = "main", limits: Any = None, requests: Any = None, **extra: Any) -> Any:
    resources: dict[str, Any] = {}
    if limits is not None:
        resources["limits"] = dict(limits)
    if requests is not None:
        resources["requests"] = dict(requests)
    return {"name": name, "image": "cuda", "resources": resources, **extra}


def pod(
    *containers: Any,
    init: Any = (),
    annotations: Any = None,
    labels: Any = None,
    claims: Any = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if annotations is not None:
        meta["annotations"] = dict(annotations)
    if labels is not None:
        meta["labels"] = dict(labels)
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    if claims is not None:
        spec["resourceClaims"] = list(claims)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def apply_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """A tiny RFC 6902 applier (add, remove) — strict: a missing parent or key is an error."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [_unescape(t) for t in op["path"].split("/")[1:]]
        target = doc
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        if op["op"] == "add":
            if isinstance(target, list):
                if last == "-":
                    target.append(op["value"])
                else:
                    target.insert(int(last), op["value"])
            else:
                target[last] = op["value"]
        elif op["op"] == "remove":
            if isinstance(target, list):
                del target[int(last)]
            else:
                del target[last]
        else:
            raise AssertionError(f"unexpected op {op}")
    return doc


def translate(p: dict[str, Any], facts: ClusterFacts = A100_40) -> Translation:
    t = translate_pod(p, facts)
    assert t is not None
    return t


def request_of(t: Translation, index: int = 0) -> dict[str, Any]:
    [request] = t.templates[index]["spec"]["spec"]["devices"]["requests"]
    assert request["name"] == "gpu"
    return request  # type: ignore[no-any-return]


def exactly(t: Translation, index: int = 0) -> dict[str, Any]:
    return request_of(t, index)["exactly"]  # type: ignore[no-any-return]


def config_of(t: Translation, index: int = 0) -> list[Any]:
    return t.templates[index]["spec"]["spec"]["devices"].get("config", [])  # type: ignore[no-any-return]


# --- one row per dialect and unit --------------------------------------------------------------

WC = "work-conserving"
WHOLE = None

ROWS: list[tuple[str, dict[str, Any], dict[str, str], int, dict[str, str] | None, str]] = [
    # id, limits, pod labels, count, capacity (None = whole GPU), note
    ("hami-mem-cores", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096",
                        "nvidia.com/gpucores": "30"}, {}, 1, {"cores": "30", "memory": "4Gi"}, ""),
    ("hami-mem-only-default-count", {"nvidia.com/gpumem": "4096"}, {}, 1,
     {"cores": "10", "memory": "4Gi"}, WC),
    ("hami-two-gpus-percentage", {"nvidia.com/gpu": "2", "nvidia.com/gpumem-percentage": "50"},
     {}, 2, {"cores": "50", "memory": "20Gi"}, WC),
    ("hami-percentage-and-cores", {"nvidia.com/gpumem-percentage": "25",
                                   "nvidia.com/gpucores": "60"}, {}, 1,
     {"cores": "60", "memory": "10Gi"}, ""),
    ("hami-cores-100-exclusive", {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "100"}, {}, 1,
     WHOLE, ""),
    ("hami-percentage-100-exclusive", {"nvidia.com/gpu": "1",
                                       "nvidia.com/gpumem-percentage": "100"}, {}, 1, WHOLE, ""),
    ("hami-zero-means-unset", {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "0",
                               "nvidia.com/gpumem": "1024"}, {}, 1,
     {"cores": "3", "memory": "1Gi"}, WC),
    ("aliyun-gib", {"aliyun.com/gpu-mem": "8"}, {}, 1, {"cores": "20", "memory": "8Gi"}, WC),
    ("aliyun-total-split", {"aliyun.com/gpu-mem": "8", "aliyun.com/gpu-count": "2"}, {}, 2,
     {"cores": "10", "memory": "4Gi"}, WC),
    ("aliyun-count-label", {"aliyun.com/gpu-mem": "8"}, {"aliyun.com/gpu-count": "2"}, 2,
     {"cores": "10", "memory": "4Gi"}, WC),
    ("aliyun-cgpu-cores", {"aliyun.com/gpu-mem": "4", "aliyun.com/gpu-core.percentage": "30"},
     {}, 1, {"cores": "30", "memory": "4Gi"}, ""),
    ("aliyun-count-alone", {"aliyun.com/gpu-count": "2"}, {}, 2, WHOLE, ""),
    ("vcuda-share", {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "16"}, {}, 1,
     {"cores": "50", "memory": "4Gi"}, ""),
    ("vcuda-whole-multiple", {"tencent.com/vcuda-core": "200"}, {}, 2, WHOLE, ""),
    ("vcuda-memory-only", {"tencent.com/vcuda-memory": "8"}, {}, 1,
     {"cores": "5", "memory": "2Gi"}, WC),
    ("docker-vcuda-whole", {"docker.com/vcuda-core": "100"}, {}, 1, WHOLE, ""),
    ("docker-vcuda-share", {"docker.com/vcuda-core": "30", "docker.com/vcuda-memory": "4"}, {},
     1, {"cores": "30", "memory": "1Gi"}, ""),
    ("qgpu-share", {"tke.cloud.tencent.com/qgpu-core": "40",
                    "tke.cloud.tencent.com/qgpu-memory": "5"}, {}, 1,
     {"cores": "40", "memory": "5Gi"}, ""),
    ("qgpu-whole", {"tke.cloud.tencent.com/qgpu-core": "300"}, {}, 3, WHOLE, ""),
    ("volcano-share", {"volcano.sh/vgpu-number": "2", "volcano.sh/vgpu-memory": "1024",
                       "volcano.sh/vgpu-cores": "25"}, {}, 2, {"cores": "25", "memory": "1Gi"}, ""),
    ("volcano-percentage", {"volcano.sh/vgpu-memory-percentage": "25"}, {}, 1,
     {"cores": "25", "memory": "10Gi"}, WC),
    ("volcano-number-alone", {"volcano.sh/vgpu-number": "1"}, {}, 1, WHOLE, ""),
]  # fmt: skip


@pytest.mark.parametrize(
    ("limits", "labels", "count", "capacity", "note"),
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_dialect_row(
    limits: dict[str, Any],
    labels: dict[str, str],
    count: int,
    capacity: dict[str, str] | None,
    note: str,
) -> None:
    t = translate(pod(ctr(limits=limits), labels=labels))
    body = exactly(t)
    assert body["deviceClassName"] == "gpu.gpuslice.dev"
    assert body["allocationMode"] == "ExactCount"
    assert body["count"] == count
    if capacity is None:
        assert "capacity" not in body, "a whole GPU asks for no capacity (exclusive)"
    else:
        assert body["capacity"] == {"requests": capacity}
    configs = config_of(t)
    if note == WC:
        [config] = configs
        assert config["requests"] == ["gpu"]
        assert config["opaque"]["driver"] == "gpu.gpuslice.dev"
        decoded = gpuconfig.decode(config["opaque"]["parameters"])
        assert decoded.enforcement.work_conserving
    else:
        assert configs == []
    # everything the dialect asked for is gone from the patched pod
    patched = apply_patch(pod(ctr(limits=limits), labels=labels), t.patch)
    assert patched["spec"]["containers"][0]["resources"] == {"claims": [{"name": "gpu-main"}]}


def test_requests_only_and_equal_requests_and_limits() -> None:
    asked = {"nvidia.com/gpumem": "2048", "nvidia.com/gpucores": "20"}
    by_requests = translate(pod(ctr(requests=asked)))
    by_both = translate(pod(ctr(limits=asked, requests=asked)))
    assert exactly(by_requests)["capacity"] == {"requests": {"cores": "20", "memory": "2Gi"}}
    assert by_both.templates == by_requests.templates
    patched = apply_patch(pod(ctr(limits=asked, requests=asked)), by_both.patch)
    assert "limits" not in patched["spec"]["containers"][0]["resources"]
    assert "requests" not in patched["spec"]["containers"][0]["resources"]


def test_other_resources_are_kept() -> None:
    limits = {"cpu": "2", "memory": "1Gi", "nvidia.com/gpumem": "1024"}
    requests = {"cpu": "1", "nvidia.com/gpumem": "1024"}
    t = translate(pod(ctr(limits=limits, requests=requests)))
    patched = apply_patch(pod(ctr(limits=limits, requests=requests)), t.patch)
    resources = patched["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"cpu": "2", "memory": "1Gi"}
    assert resources["requests"] == {"cpu": "1"}
    assert any(op["path"].endswith("/limits/nvidia.com~1gpumem") for op in t.patch)


# --- HAMi's plain nvidia.com/gpu and its annotations -------------------------------------------


def test_plain_nvidia_gpu_is_left_to_the_device_class() -> None:
    assert translate_pod(pod(ctr(limits={"nvidia.com/gpu": "1"})), A100_40) is None
    two = pod(ctr("a", limits={"nvidia.com/gpu": "2"}), ctr("b", limits={"cpu": "1"}))
    assert translate_pod(two, A100_40) is None


def test_nvidia_gpu_with_a_hami_annotation_is_hami() -> None:
    p = pod(
        ctr(limits={"nvidia.com/gpu": "1"}),
        annotations={"nvidia.com/use-gputype": "A100"},
    )
    t = translate(p)
    body = exactly(t)
    assert "capacity" not in body and body["count"] == 1
    [selector] = body["selectors"]
    assert 'lowerAscii().contains("a100")' in selector["cel"]["expression"]


def test_plain_nvidia_gpu_in_a_hami_pod_is_translated_too() -> None:
    p = pod(
        ctr("share", limits={"nvidia.com/gpumem": "1024"}),
        ctr("whole", limits={"nvidia.com/gpu": "1"}),
    )
    t = translate(p)
    assert len(t.templates) == 2
    assert "capacity" in exactly(t, 0)
    assert "capacity" not in exactly(t, 1) and exactly(t, 1)["count"] == 1


def test_gputype_selectors_match_like_hami() -> None:
    p = pod(
        ctr(limits={"nvidia.com/gpumem": "1024"}),
        annotations={
            "nvidia.com/use-gputype": "A100, H100 ,",
            "nvidia.com/nouse-gputype": "A100-SXM4-40GB",
            "nvidia.com/use-gpuuuid": "GPU-aaa,GPU-bbb",
            "nvidia.com/nouse-gpuuuid": "GPU-ccc",
        },
    )
    cel = [s["cel"]["expression"] for s in exactly(translate(p))["selectors"]]
    attrs = 'device.attributes["gpu.gpuslice.dev"]'
    assert cel == [
        f'has({attrs}.productName) && ({attrs}.productName.lowerAscii().contains("a100") || '
        f'{attrs}.productName.lowerAscii().contains("h100"))',
        f"!(has({attrs}.productName) && "
        f'{attrs}.productName.lowerAscii().contains("a100-sxm4-40gb"))',
        f'has({attrs}.uuid) && {attrs}.uuid in ["GPU-aaa", "GPU-bbb"]',
        f'!(has({attrs}.uuid) && {attrs}.uuid in ["GPU-ccc"])',
    ]


def test_selectors_use_the_driver_domain() -> None:
    p = pod(ctr(limits={"nvidia.com/gpumem": "1024"}),
            annotations={"nvidia.com/use-gpuuuid": "GPU-a"})  # fmt: skip
    t = translate_pod(p, A100_40, driver_domain="gpu.example.com", device_class="gpu.example.com")
    assert t is not None
    body = exactly(t)
    assert body["deviceClassName"] == "gpu.example.com"
    assert 'device.attributes["gpu.example.com"].uuid' in body["selectors"][0]["cel"]["expression"]
    assert config_of(t)[0]["opaque"]["driver"] == "gpu.example.com"


def test_hostile_annotation_stays_inside_its_string_literal() -> None:
    evil = 'x") || true || ("'
    p = pod(ctr(limits={"nvidia.com/gpumem": "1024"}),
            annotations={"nvidia.com/use-gpuuuid": evil})  # fmt: skip
    [selector] = exactly(translate(p))["selectors"]
    expression = selector["cel"]["expression"]
    literal = expression.split(" in [", 1)[1].removesuffix("]")
    assert literal == cel_string(evil)
    assert decode_cel_string(literal) == evil


def decode_cel_string(literal: str) -> str:
    """Reads back the subset of CEL string literals cel_string writes; fails on a bare quote."""
    assert literal[0] == literal[-1] == '"'
    body, out, i = literal[1:-1], [], 0
    while i < len(body):
        ch = body[i]
        assert ch != '"', "an unescaped quote would end the literal"
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        kind = body[i + 1]
        if kind in '\\"':
            out.append(kind)
            i += 2
        elif kind == "u":
            out.append(chr(int(body[i + 2 : i + 6], 16)))
            i += 6
        elif kind == "U":
            out.append(chr(int(body[i + 2 : i + 10], 16)))
            i += 10
        else:
            raise AssertionError(f"unexpected escape {kind}")
    return "".join(out)


@pytest.mark.parametrize(
    "text",
    ["plain", 'quo"te', "back\\slash", "new\nline", "tab\t", "ümlaut", "emoji 🎉", "\x00nul"],
)
def test_cel_string_round_trips(text: str) -> None:
    literal = cel_string(text)
    assert all(" " <= ch <= "~" for ch in literal), "only printable ASCII in the expression"
    assert decode_cel_string(literal) == text


def test_cel_string_refuses_lone_surrogates() -> None:
    with pytest.raises(ValueError, match="surrogate"):
        cel_string("a\ud800b")


def test_gputype_lowercases_ascii_only() -> None:
    p = pod(ctr(limits={"nvidia.com/gpumem": "1024"}),
            annotations={"nvidia.com/use-gputype": "RTX ÄB"})  # fmt: skip
    [selector] = exactly(translate(p))["selectors"]
    # CEL's lowerAscii() leaves non-ASCII alone, so the literal must too
    assert 'contains("rtx \\u00c4b")' in selector["cel"]["expression"]


def test_hami_priority_is_removed_with_a_warning() -> None:
    limits = {"nvidia.com/gpumem": "1024", "nvidia.com/priority": "0"}
    t = translate(pod(ctr(limits=limits)))
    assert any("nvidia.com/priority" in w for w in t.warnings)
    patched = apply_patch(pod(ctr(limits=limits)), t.patch)
    assert "limits" not in patched["spec"]["containers"][0]["resources"]


# --- shares: memory only, percentages, GPU sizes -----------------------------------------------


def test_memory_only_share_is_sized_per_gpu_size() -> None:
    t = translate(pod(ctr(limits={"nvidia.com/gpumem": "10240"})), MIXED)
    [first, second] = request_of(t)["firstAvailable"]
    assert first["name"] == "gpu-40gi" and second["name"] == "gpu-80gi"
    assert first["capacity"]["requests"] == {"cores": "25", "memory": "10Gi"}
    assert second["capacity"]["requests"] == {"cores": "13", "memory": "10Gi"}
    assert first["selectors"][-1]["cel"]["expression"] == (
        'device.capacity["gpu.gpuslice.dev"].memory.compareTo(quantity("40Gi")) == 0'
    )
    assert all(DNS_1123.fullmatch(s["name"]) for s in (first, second))
    assert config_of(t)[0]["requests"] == ["gpu"], "the config applies to every alternative"


def test_memory_only_skips_gpus_too_small() -> None:
    t = translate(pod(ctr(limits={"nvidia.com/gpumem": str(60 * 1024)})), MIXED)
    body = exactly(t)
    assert body["capacity"]["requests"] == {"cores": "75", "memory": "60Gi"}


def test_percentage_is_sized_per_gpu_size() -> None:
    t = translate(pod(ctr(limits={"nvidia.com/gpumem-percentage": "10"})), MIXED)
    subs = request_of(t)["firstAvailable"]
    assert [s["capacity"]["requests"] for s in subs] == [
        {"cores": "10", "memory": "4Gi"},
        {"cores": "10", "memory": "8Gi"},
    ]


def test_percentage_of_an_odd_size_rounds_down_to_whole_mib() -> None:
    size = 15360 * MI + 123  # not a whole MiB
    t = translate(pod(ctr(limits={"nvidia.com/gpumem-percentage": "33"})), ClusterFacts.of([size]))
    assert exactly(t)["capacity"]["requests"]["memory"] == "5068Mi"  # floor(15360 * 33 / 100)


def test_unknown_sizes_memory_only_takes_all_cores_with_a_warning() -> None:
    t = translate(pod(ctr(limits={"nvidia.com/gpumem": str(200 * 1024)})), UNKNOWN)
    assert exactly(t)["capacity"]["requests"] == {"memory": "200Gi"}, "no size check when unknown"
    assert config_of(t) == []
    assert any("all cores" in w for w in t.warnings)


def test_cores_only_share_warns_that_it_takes_all_memory() -> None:
    t = translate(pod(ctr(limits={"nvidia.com/gpucores": "30"})))
    assert exactly(t)["capacity"]["requests"] == {"cores": "30"}
    assert any("all of each GPU's memory" in w for w in t.warnings)


def test_memory_wins_over_percentage_with_a_warning() -> None:
    limits = {"nvidia.com/gpumem": "2048", "nvidia.com/gpumem-percentage": "50"}
    t = translate(pod(ctr(limits=limits)))
    assert exactly(t)["capacity"]["requests"] == {"cores": "5", "memory": "2Gi"}
    assert any("gpumem-percentage is ignored" in w for w in t.warnings)


def test_vcuda_whole_gpus_ignore_memory_with_a_warning() -> None:
    limits = {"tencent.com/vcuda-core": "200", "tencent.com/vcuda-memory": "4"}
    t = translate(pod(ctr(limits=limits)))
    assert exactly(t)["count"] == 2 and "capacity" not in exactly(t)
    assert any("tencent.com/vcuda-memory is ignored" in w for w in t.warnings)


def test_count_zero_removes_the_resources_and_claims_nothing() -> None:
    limits = {"nvidia.com/gpu": "0", "nvidia.com/gpumem": "1024"}
    t = translate(pod(ctr(limits=limits)))
    assert t.templates == []
    patched = apply_patch(pod(ctr(limits=limits)), t.patch)
    assert "resourceClaims" not in patched["spec"]
    assert patched["spec"]["containers"][0]["resources"] == {}
    assert translate_pod(patched, A100_40) is None


# --- denials -----------------------------------------------------------------------------------

DENIALS: list[tuple[str, Any, ClusterFacts, list[str]]] = [
    ("cores-over-100-per-gpu",
     pod(ctr(limits={"nvidia.com/gpu": "2", "nvidia.com/gpucores": "150"})), A100_40,
     ["'main'", "nvidia.com/gpucores", "150", "over 100"]),
    ("vcuda-cores-not-multiple-of-100",
     pod(ctr(limits={"tencent.com/vcuda-core": "150"})), A100_40,
     ["'main'", "tencent.com/vcuda-core", "150", "multiple of 100"]),
    ("qgpu-cores-not-multiple-of-100",
     pod(ctr(limits={"tke.cloud.tencent.com/qgpu-core": "250"})), A100_40,
     ["tke.cloud.tencent.com/qgpu-core", "250"]),
    ("aliyun-cores-with-count",
     pod(ctr(limits={"aliyun.com/gpu-mem": "8", "aliyun.com/gpu-count": "2",
                     "aliyun.com/gpu-core.percentage": "30"})), A100_40,
     ["'main'", "aliyun.com/gpu-core.percentage", "30", "2 GPUs"]),
    ("aliyun-memory-not-divisible",
     pod(ctr(limits={"aliyun.com/gpu-mem": "5", "aliyun.com/gpu-count": "2"})), A100_40,
     ["'main'", "aliyun.com/gpu-mem", "5", "split evenly"]),
    ("memory-larger-than-any-gpu",
     pod(ctr(limits={"nvidia.com/gpumem": str(100 * 1024)})), MIXED,
     ["'main'", "100Gi", "largest: 80Gi"]),
    ("memory-larger-than-any-gpu-with-cores",
     pod(ctr(limits={"volcano.sh/vgpu-memory": str(48 * 1024), "volcano.sh/vgpu-cores": "10"})),
     A100_40, ["'main'", "48Gi", "largest: 40Gi"]),
    ("mixing-dialects-across-containers",
     pod(ctr("a", limits={"nvidia.com/gpumem": "1024"}),
         ctr("b", limits={"aliyun.com/gpu-mem": "1"})), A100_40,
     ["'a'", "nvidia.com/gpumem", "HAMi", "'b'", "aliyun.com/gpu-mem", "one GPU-sharing dialect"]),
    ("mixing-dialects-in-one-container",
     pod(ctr(limits={"tencent.com/vcuda-core": "50", "volcano.sh/vgpu-memory": "1024"})), A100_40,
     ["'main'", "one GPU-sharing dialect"]),
    ("mixing-with-plain-nvidia-gpu-in-one-container",
     pod(ctr(limits={"aliyun.com/gpu-mem": "4", "nvidia.com/gpu": "1"})), A100_40,
     ["'main'", "nvidia.com/gpu", "aliyun.com/gpu-mem"]),
    ("request-differs-from-limit",
     pod(ctr(limits={"nvidia.com/gpumem": "2048"}, requests={"nvidia.com/gpumem": "1024"})),
     A100_40, ["'main'", "nvidia.com/gpumem", "'1024'", "'2048'"]),
    ("fractional-value",
     pod(ctr(limits={"nvidia.com/gpucores": "1.5"})), A100_40,
     ["'main'", "nvidia.com/gpucores", "'1.5'", "whole number"]),
    ("not-a-quantity",
     pod(ctr(limits={"nvidia.com/gpumem": "lots"})), A100_40,
     ["'main'", "nvidia.com/gpumem", "'lots'", "not a quantity"]),
    ("negative",
     pod(ctr(limits={"volcano.sh/vgpu-memory": "-5"})), A100_40,
     ["'main'", "volcano.sh/vgpu-memory", "'-5'"]),
    ("percentage-over-100",
     pod(ctr(limits={"nvidia.com/gpumem-percentage": "120"})), A100_40,
     ["'main'", "nvidia.com/gpumem-percentage", "120", "over 100"]),
    ("percentage-without-known-sizes",
     pod(ctr(limits={"volcano.sh/vgpu-memory-percentage": "50"})), UNKNOWN,
     ["'main'", "50%", "no GPU sizes are known"]),
    ("mig-mode",
     pod(ctr(limits={"nvidia.com/gpumem": "1024"}), annotations={"nvidia.com/vgpu-mode": "mig"}),
     A100_40, ["nvidia.com/vgpu-mode", "'mig'", "mig.gpuslice.dev"]),
    ("too-many-gpu-sizes",
     pod(ctr(limits={"nvidia.com/gpumem": "1024"})), ClusterFacts.of(range(GI, 11 * GI, GI)),
     ["'main'", "10 GPU memory sizes", "8 alternatives"]),
    ("bad-count-label",
     pod(ctr(limits={"aliyun.com/gpu-mem": "4"}), labels={"aliyun.com/gpu-count": "two"}),
     A100_40, ["aliyun.com/gpu-count", "'two'", "'main'"]),
    ("lone-surrogate-in-annotation",
     pod(ctr(limits={"nvidia.com/gpumem": "1024"}),
         annotations={"nvidia.com/use-gputype": "A\ud800"}), A100_40,
     ["nvidia.com/use-gputype", "surrogate"]),
    ("annotation-too-long",
     pod(ctr(limits={"nvidia.com/gpumem": "1024"}),
         annotations={"nvidia.com/nouse-gpuuuid": ",".join(f"GPU-{i:036d}" for i in range(400))}),
     A100_40, ["nvidia.com/nouse-gpuuuid", "too long"]),
    ("init-container-named",
     pod(ctr(limits={"cpu": "1"}), init=[ctr("setup", limits={"nvidia.com/gpucores": "101"})]),
     A100_40, ["init container 'setup'", "nvidia.com/gpucores", "101"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("p", "facts", "words"), [d[1:] for d in DENIALS], ids=[d[0] for d in DENIALS]
)
def test_denied_with_a_reason(p: Any, facts: ClusterFacts, words: list[str]) -> None:
    with pytest.raises(Denied) as info:
        translate_pod(p, facts)
    for word in words:
        assert word in info.value.reason
    assert str(info.value) == info.value.reason


# --- idempotence, opt-out, already translated --------------------------------------------------

IDEMPOTENT = [
    pod(ctr(limits={"nvidia.com/gpumem": "1024"})),
    pod(ctr(limits={"nvidia.com/gpumem": "1024"}), annotations={"team": "a"}),
    pod(
        ctr("a", limits={"volcano.sh/vgpu-memory": "1024", "cpu": "1"}),
        ctr("b", limits={"volcano.sh/vgpu-number": "2"}),
        init=[ctr("warm", limits={"volcano.sh/vgpu-cores": "10"}, restartPolicy="Always")],
        claims=[{"name": "other", "resourceClaimName": "mine"}],
    ),
]


@pytest.mark.parametrize("p", IDEMPOTENT)
def test_translating_the_patched_pod_again_returns_none(p: dict[str, Any]) -> None:
    t = translate(p, MIXED)
    patched = apply_patch(p, t.patch)
    assert translate_pod(patched, MIXED) is None
    # and even with the annotation removed, nothing of the dialect is left to translate
    del patched["metadata"]["annotations"][TRANSLATED_ANNOTATION]
    assert translate_pod(patched, MIXED) is None


def test_annotation_records_the_original_request() -> None:
    p = pod(
        ctr("a", limits={"nvidia.com/gpumem": "1024", "cpu": "1"},
            requests={"nvidia.com/gpumem": "1024"}),
        init=[ctr("i", limits={"nvidia.com/gpu": "1"})],
        annotations={"nvidia.com/use-gputype": "A100", "other": "x"},
    )  # fmt: skip
    t = translate(p)
    patched = apply_patch(p, t.patch)
    record = json.loads(patched["metadata"]["annotations"][TRANSLATED_ANNOTATION])
    assert patched["metadata"]["annotations"]["other"] == "x"
    assert record["dialect"] == "hami"
    assert record["annotations"] == {"nvidia.com/use-gputype": "A100"}
    assert record["containers"] == [
        {"container": "i", "init": True, "limits": {"nvidia.com/gpu": "1"}, "claim": "gpu-i",
         "template": t.templates[0]["metadata"]["name"]},
        {"container": "a", "limits": {"nvidia.com/gpumem": "1024"},
         "requests": {"nvidia.com/gpumem": "1024"}, "claim": "gpu-a",
         "template": t.templates[1]["metadata"]["name"]},
    ]  # fmt: skip


def test_already_translated_pod_is_left_alone() -> None:
    p = pod(ctr(limits={"nvidia.com/gpumem": "1024"}), annotations={TRANSLATED_ANNOTATION: "{}"})
    assert translate_pod(p, A100_40) is None


@pytest.mark.parametrize("value", ["false", "False"])
def test_opt_out_label(value: str) -> None:
    p = pod(ctr(limits={"nvidia.com/gpumem": "1024"}), labels={"gpu.gpuslice.dev/translate": value})
    assert translate_pod(p, A100_40) is None


def test_opt_out_label_other_values_translate() -> None:
    p = pod(
        ctr(limits={"nvidia.com/gpumem": "1024"}), labels={"gpu.gpuslice.dev/translate": "true"}
    )
    assert translate_pod(p, A100_40) is not None


def test_pod_without_gpu_resources_is_none() -> None:
    assert translate_pod(pod(ctr(limits={"cpu": "1"})), A100_40) is None
    assert translate_pod({"metadata": {}, "spec": {}}, A100_40) is None


# --- patch shape -------------------------------------------------------------------------------


def test_pointer_escape() -> None:
    assert pointer_escape("nvidia.com/gpumem") == "nvidia.com~1gpumem"
    assert pointer_escape("a~b/c") == "a~0b~1c"
    assert _unescape(pointer_escape("a~1/~0")) == "a~1/~0"


def test_patch_on_a_bare_pod_adds_lists_and_maps() -> None:
    t = translate(pod(ctr(limits={"aliyun.com/gpu-mem": "2"})))
    assert {"op": "add", "path": "/spec/resourceClaims", "value": [
        {"name": "gpu-main", "resourceClaimTemplateName": t.templates[0]["metadata"]["name"]}
    ]} in t.patch  # fmt: skip
    assert {"op": "remove", "path": "/spec/containers/0/resources/limits"} in t.patch
    assert t.patch[-1]["path"] == "/metadata/annotations"


def test_patch_appends_to_existing_claims_and_annotations() -> None:
    main = ctr(limits={"nvidia.com/gpumem": "1024"})
    main["resources"]["claims"] = [{"name": "other"}]
    p = pod(main, annotations={"a": "b"}, claims=[{"name": "other", "resourceClaimName": "x"}])
    t = translate(p)
    paths = [op["path"] for op in t.patch if op["op"] == "add"]
    assert paths == [
        "/spec/resourceClaims/-",
        "/spec/containers/0/resources/claims/-",
        "/metadata/annotations/gpu.gpuslice.dev~1translated-from",
    ]
    patched = apply_patch(p, t.patch)
    assert [c["name"] for c in patched["spec"]["resourceClaims"]] == ["other", "gpu-main"]
    assert patched["spec"]["containers"][0]["resources"]["claims"] == [
        {"name": "other"},
        {"name": "gpu-main"},
    ]


def test_claim_name_clash_and_long_container_names() -> None:
    long_name = "c" * 63
    p = pod(
        ctr("main", limits={"nvidia.com/gpumem": "1024"}),
        ctr(long_name, limits={"nvidia.com/gpumem": "1024"}),
        claims=[{"name": "gpu-main", "resourceClaimName": "x"}],
    )
    t = translate(p)
    patched = apply_patch(p, t.patch)
    names = [c["name"] for c in patched["spec"]["resourceClaims"]]
    assert names[0] == "gpu-main" and len(set(names)) == 3
    assert all(DNS_1123.fullmatch(n) and len(n) <= 63 for n in names)


# --- init containers, several containers, template names ---------------------------------------


def test_init_and_sidecar_containers_get_their_own_claims() -> None:
    p = pod(
        ctr("app", limits={"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "4"}),
        init=[
            ctr("setup", limits={"tencent.com/vcuda-memory": "4"}),
            ctr("sidecar", limits={"tencent.com/vcuda-core": "100"}, restartPolicy="Always"),
        ],
    )
    t = translate(p)
    patched = apply_patch(p, t.patch)
    spec = patched["spec"]
    assert spec["initContainers"][0]["resources"] == {"claims": [{"name": "gpu-setup"}]}
    assert spec["initContainers"][1]["resources"] == {"claims": [{"name": "gpu-sidecar"}]}
    assert spec["initContainers"][1]["restartPolicy"] == "Always"
    assert spec["containers"][0]["resources"] == {"claims": [{"name": "gpu-app"}]}
    assert [c["name"] for c in spec["resourceClaims"]] == ["gpu-setup", "gpu-sidecar", "gpu-app"]
    assert len(t.templates) == 3
    assert "setup:" in t.summary and "sidecar: 1 GPU, whole" in t.summary


def test_containers_asking_the_same_share_one_template() -> None:
    same = {"nvidia.com/gpumem": "2048", "nvidia.com/gpucores": "20"}
    p = pod(ctr("a", limits=same), ctr("b", limits=same), ctr("c", limits={"nvidia.com/gpu": "1"}))
    t = translate(p)
    assert len(t.templates) == 2
    patched = apply_patch(p, t.patch)
    claims = patched["spec"]["resourceClaims"]
    assert [c["name"] for c in claims] == ["gpu-a", "gpu-b", "gpu-c"]
    assert claims[0]["resourceClaimTemplateName"] == claims[1]["resourceClaimTemplateName"]
    assert claims[2]["resourceClaimTemplateName"] != claims[0]["resourceClaimTemplateName"]


def test_template_names_are_stable_and_reused_across_pods() -> None:
    asked = {"volcano.sh/vgpu-memory": "3000", "volcano.sh/vgpu-cores": "15"}
    first = translate(pod(ctr("x", limits=asked)))
    other = pod(ctr("y", limits={**asked, "cpu": "4"}), annotations={"k": "v"})
    other["metadata"]["name"] = "another"
    second = translate(other)
    assert first.templates == second.templates
    [template] = first.templates
    name = template["metadata"]["name"]
    assert name.startswith("gpuslice-volcano-")
    assert DNS_1123.fullmatch(name) and len(name) <= 63
    assert template["apiVersion"] == "resource.k8s.io/v1"
    assert template["kind"] == "ResourceClaimTemplate"
    assert template["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "gpuslice-controller",
        "gpu.gpuslice.dev/dialect": "volcano",
    }
    # a different ask, or the same ask in another dialect, is another template
    more = translate(pod(ctr(limits={**asked, "volcano.sh/vgpu-cores": "16"})))
    assert more.templates[0]["metadata"]["name"] != name
    hami = translate(pod(ctr(limits={"nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "15"})))
    assert hami.templates[0]["spec"] == template["spec"]
    assert hami.templates[0]["metadata"]["name"] != name


def test_template_name_pinned() -> None:
    """The name is part of the contract with pods already admitted: changing the canonical form
    orphans every template in the cluster. Update this pin only on purpose."""
    t = translate(pod(ctr(limits={"nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"})))
    assert t.templates[0]["metadata"]["name"] == t.templates[0]["metadata"]["name"].lower()
    assert re.fullmatch(r"gpuslice-hami-[0-9a-f]{10}", t.templates[0]["metadata"]["name"])


def test_summary_is_one_line() -> None:
    p = pod(
        ctr("a", limits={"nvidia.com/gpumem": "1024"}), ctr("b", limits={"nvidia.com/gpu": "2"})
    )
    t = translate(p, MIXED)
    assert "\n" not in t.summary
    assert t.summary.startswith("HAMi: a: 1 GPU, ")
    assert "b: 2 GPUs, whole (exclusive)" in t.summary
