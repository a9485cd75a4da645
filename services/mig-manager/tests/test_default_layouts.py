"""The shipped default layouts (e2e/manifests/mig-configs.yaml) fit every model they name."""

from __future__ import annotations

import pytest
import yaml

from gpuslice_mig_manager.layouts import LayoutConfig, gpu_instance_profile_of
from gpuslice_mig_manager.planner import PlanError, Shape, Want, plan, total_compute_slices
from gpuslice_nvml.fake import CATALOG, GpuModel

from .conftest import MANIFEST

pytestmark = pytest.mark.timeout(20)
MIG_MODELS = [m for m in CATALOG if m.mig_capable]


def test_the_manifest_is_a_configmap_with_config_yaml() -> None:
    doc = yaml.safe_load(MANIFEST.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("v1", "ConfigMap")
    assert doc["metadata"]["name"] == "gpuslice-mig-parted-config"
    assert list(doc["data"]) == ["config.yaml"]


def test_standard_layouts_exist(layouts: LayoutConfig) -> None:
    names = set(layouts.names())
    assert {"all-disabled", "all-enabled", "all-balanced"} <= names
    for model in MIG_MODELS:
        for profile in model.gpu_instance_profiles():
            assert "all-" + profile.name.replace("+me", ".me") in names, (model.key, profile.name)


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.key)
def test_every_layout_fits_the_models_it_selects(layouts: LayoutConfig, model: GpuModel) -> None:
    profiles = model.gpu_instance_profiles()
    shapes = {p.name: Shape.of(p) for p in profiles}
    total = total_compute_slices(profiles)
    selected = 0
    for name in layouts.names():
        for spec in layouts.get(name):
            filters = spec.filters
            if filters and model.pci_device_id not in filters:
                continue
            selected += 1
            wants = [
                Want(dp, shapes[gpu_instance_profile_of(dp)])
                for dp, count in spec.wanted().items()
                for _ in range(count)
            ]
            plan(wants, [], total)  # raises PlanError if it does not fit
            if spec.wanted() and name != "all-balanced":
                # all-<profile> asks for as many as fit: one more must not fit.
                (dp,) = spec.wanted()
                more = [*wants, Want(dp, shapes[dp])]
                with pytest.raises(PlanError, match="does not fit"):
                    plan(more, [], total)
    assert selected >= len(profiles) + 3
