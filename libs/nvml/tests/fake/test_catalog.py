"""The catalog's numbers, and profile names computed from them."""

from __future__ import annotations

import pytest

from gpuslice_nvml.fake import CATALOG, FakeNvml, find_model
from gpuslice_nvml.fake.catalog import MEMORY_SLICES, GpuModel

EXPECTED_NAMES = {
    "A100-SXM4-40GB": [
        "1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb",
    ],
    "A100-SXM4-80GB": [
        "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
    ],
    "H100-SXM5-80GB": [
        "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
    ],
    "H200-SXM-141GB": [
        "1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb",
    ],
}  # fmt: skip


@pytest.mark.parametrize("model", [m for m in CATALOG if m.mig_capable], ids=lambda m: m.key)
def test_computed_profile_names_match_nvidia(model: GpuModel) -> None:
    assert [p.name for p in model.gpu_instance_profiles()] == EXPECTED_NAMES[model.key]


@pytest.mark.parametrize("model", [m for m in CATALOG if m.mig_capable], ids=lambda m: m.key)
def test_profile_tables_are_consistent(model: GpuModel) -> None:
    profiles = model.gpu_instance_profiles()
    assert [p.id for p in profiles] == [19, 20, 15, 14, 9, 5, 0]
    for profile in profiles:
        assert profile.instance_count <= len(profile.placements)
        assert profile.memory_mib < model.memory_mib
        for placement in profile.placements:
            assert placement.size == profile.memory_slices
            assert placement.start % placement.size == 0 or placement.size == 1
            assert placement.end <= MEMORY_SLICES
    # compute-instance names inside the largest profile
    whole = profiles[-1]
    names = [p.name for p in model.compute_instance_profiles(whole)]
    assert names == [f"{c}c.{whole.name}" for c in (1, 2, 3, 4)] + [whole.name]


def test_h100_matches_nvidia_smi() -> None:
    model = find_model("NVIDIA H100 80GB HBM3")
    assert model is not None and model is find_model("h100-sxm5-80gb")
    assert (model.memory_mib, model.multiprocessors) == (81559, 132)
    assert model.cuda_compute_capability == (9, 0)
    assert (model.architecture, model.pci_device_id) == ("Hopper", 0x233010DE)
    table = [(p.name, p.instance_count) for p in model.gpu_instance_profiles()]
    assert table == [
        ("1g.10gb", 7),
        ("1g.10gb+me", 1),
        ("1g.20gb", 4),
        ("2g.20gb", 3),
        ("3g.40gb", 2),
        ("4g.40gb", 1),
        ("7g.80gb", 1),
    ]
    sms = [p.multiprocessors for p in model.gpu_instance_profiles()]
    assert sms == [16, 16, 26, 32, 60, 64, 132]


@pytest.mark.parametrize(
    ("key", "name", "mib", "sms", "cc", "arch"),
    [
        ("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", 40960, 108, (8, 0), "Ampere"),
        ("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", 81920, 108, (8, 0), "Ampere"),
        ("H200-SXM-141GB", "NVIDIA H200", 143771, 132, (9, 0), "Hopper"),
        ("L4", "NVIDIA L4", 23034, 58, (8, 9), "Ada Lovelace"),
        ("T4", "Tesla T4", 15360, 40, (7, 5), "Turing"),
    ],
)
def test_model_facts(
    key: str, name: str, mib: int, sms: int, cc: tuple[int, int], arch: str
) -> None:
    model = find_model(key)
    assert model is not None
    assert (model.product_name, model.memory_mib, model.multiprocessors) == (name, mib, sms)
    assert (model.cuda_compute_capability, model.architecture) == (cc, arch)
    assert model.mig_capable == key.startswith(("A100", "H"))


def test_fake_reports_catalog_values(fake: FakeNvml) -> None:
    gpu = fake.gpu(0)
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.memory_total_bytes == 81559 * 1024 * 1024
    assert (gpu.multiprocessors, gpu.cuda_compute_capability) == (132, (9, 0))
    assert [p.name for p in fake.gpu_instance_profiles(0)] == EXPECTED_NAMES["H100-SXM5-80GB"]
    l4 = fake.gpu(2)
    assert (l4.name, l4.mig_capable, l4.mig_mode) == ("NVIDIA L4", False, None)
