"""The release's inputs: a bad registry, prefix or version is refused before anything is pushed,
with the field and what it allows; a missing images cache says to run `make images`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice_testkit import release as rel


@pytest.mark.parametrize(
    ("registry", "prefix", "version", "message"),
    [
        (
            "http://127.0.0.1:5000",
            "gpuslice",
            "1.0.0",
            "registry: 'http://127.0.0.1:5000' is not HOST",
        ),
        ("127.0.0.1:5000/x", "gpuslice", "1.0.0", "registry: .* no path"),
        ("127.0.0.1:5000", "GpuSlice", "1.0.0", "prefix: 'GpuSlice' is not a repository path"),
        ("127.0.0.1:5000", "/gpuslice", "1.0.0", "prefix: '/gpuslice'"),
        ("127.0.0.1:5000", "gpuslice", "v1.0.0", "version: 'v1.0.0' is not a release version"),
        ("127.0.0.1:5000", "gpuslice", "1.0.0+build.1", r"version: '1.0.0\+build.1'"),
        ("127.0.0.1:5000", "gpuslice", "1.0", "MAJOR.MINOR.PATCH"),
    ],
)
def test_bad_input_names_the_field(registry: str, prefix: str, version: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rel.check_inputs(registry, prefix, version)


@pytest.mark.parametrize(
    ("registry", "prefix", "version"),
    [
        ("127.0.0.1:5000", "gpuslice", "0.1.0"),
        ("[::1]:5000", "team/gpu-slice", "1.2.3-rc.1"),
        ("ghcr.io", "my_org/gpuslice", "10.0.0"),
    ],
)
def test_good_input_passes(registry: str, prefix: str, version: str) -> None:
    rel.check_inputs(registry, prefix, version)


def test_a_manifest_without_the_service_images_says_make_images(tmp_path: Path) -> None:
    archive = tmp_path / "pause.tar"
    archive.write_bytes(b"")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"images": {"pause": {"archive": str(archive)}}}))
    with pytest.raises(rel.ReleaseError, match="make images") as err:
        rel.cached_images(manifest)
    assert "enforcer" in str(err.value)
