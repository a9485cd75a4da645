"""``make release-local`` end to end: a loopback registry, every image of the images cache and
the chart pushed to it (gpuslice_testkit.release), then read back the way a user's tools read
them: the registry API for each image's manifest and digest, ``helm pull oci://`` for the chart,
whose rendered image references must be exactly the pushed ones once ``image.registry`` names
the registry. Nothing is built: without ``make images`` the module is skipped and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.support.chart import container_images, helm
from gpuslice_testkit import release as rel
from gpuslice_testkit.registry import Registry, start_registry

VERSION = "1.2.3-e2e.1"
PREFIX = "team/gpuslice"
MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def archives() -> dict[str, Path]:
    for tool in ("skopeo", "docker-registry"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: hack/node-packages.sh installs it")
    try:
        return rel.cached_images()
    except rel.ReleaseError as exc:
        pytest.skip(f"no images to push (this test builds none; run `make images`): {exc}")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with start_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def pushed(
    registry: Registry,
    archives: dict[str, Path],
    helm_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> rel.Summary:
    summary = rel.release(
        registry.address,
        PREFIX,
        VERSION,
        plain_http=True,
        workdir=tmp_path_factory.mktemp("release"),
        helm=str(helm_bin),
        archives=archives,
    )
    print(
        f"\npushed {len(summary.images)} images in {summary.images_seconds:.2f} s, "
        f"the chart in {summary.chart.seconds:.2f} s"
    )
    return summary


def archive_manifest_digest(archive: Path) -> str:
    """The digest of the one manifest in an OCI archive's index.json."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        assert member is not None, f"{archive}: no index.json"
        index = json.load(member)
    (manifest,) = index["manifests"]
    return str(manifest["digest"])


def test_every_image_is_in_the_registry_under_its_digest(
    registry: Registry, archives: dict[str, Path], pushed: rel.Summary
) -> None:
    assert set(pushed.images) == set(archives)
    assert {n for n, i in pushed.images.items() if i.chart} == set(rel.services())
    for name, image in pushed.images.items():
        repository = image.repository.removeprefix(f"{registry.address}/")
        tag = image.ref.rsplit(":", 1)[1]
        assert tag == VERSION
        if image.chart:
            assert repository == f"{PREFIX}/gpuslice-{name}"
        _, by_tag = registry.get_json(f"/v2/{repository}/manifests/{tag}", MANIFEST_TYPES)
        assert by_tag == image.digest, f"{image.ref}: the registry serves {by_tag}"
        # what the archive held, unchanged (skopeo copied, did not convert)
        assert image.digest == archive_manifest_digest(archives[name])
        manifest, by_digest = registry.get_json(
            f"/v2/{repository}/manifests/{image.digest}", MANIFEST_TYPES
        )
        assert by_digest == image.digest
        layers: list[dict[str, Any]] = manifest["layers"]  # type: ignore[assignment]
        assert layers, f"{image.ref}: a manifest without layers"
        tags, _ = registry.get_json(f"/v2/{repository}/tags/list")
        assert tags["tags"] == [VERSION]


def test_the_pulled_chart_resolves_to_exactly_the_pushed_images(
    registry: Registry, pushed: rel.Summary, helm_bin: Path, tmp_path: Path
) -> None:
    env_home = tmp_path / "helm"
    env = [f"--registry-config={env_home / 'registry.json'}"]
    pulled = helm(
        helm_bin, "pull", pushed.chart.ref, "--version", VERSION, "--plain-http",
        "--destination", str(tmp_path), *env,
    )  # fmt: skip
    assert pushed.chart.digest in pulled.stdout + pulled.stderr
    package = tmp_path / f"gpuslice-{VERSION}.tgz"
    with tarfile.open(package) as tar:
        member = tar.extractfile("gpuslice/Chart.yaml")
        assert member is not None
        chart = yaml.safe_load(member)
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)

    rendered = helm(
        helm_bin, "template", "gpuslice", str(package), "-n", "gpuslice",
        "--set", f"image.registry={pushed.image_registry}",
    )  # fmt: skip
    images = container_images(list(yaml.safe_load_all(rendered.stdout)))
    expected = {i.ref for i in pushed.images.values() if i.chart}
    assert images == expected


def test_an_unknown_version_is_not_in_the_registry(registry: Registry, pushed: rel.Summary) -> None:
    """The registry answers by what was pushed, not by any tag (else the checks above prove
    nothing)."""
    image = pushed.images["enforcer"]
    repository = image.repository.removeprefix(f"{registry.address}/")
    with pytest.raises(urllib.error.HTTPError) as err:
        registry.get_json(f"/v2/{repository}/manifests/9.9.9", MANIFEST_TYPES)
    assert err.value.code == 404


def test_make_release_local_prints_the_summary_and_the_install_command(
    archives: dict[str, Path], helm_bin: Path, tmp_path: Path
) -> None:
    """hack/release.sh --local (what ``make release-local`` runs): a registry of its own,
    stopped at the end; the summary on stdout, the install command on stderr."""
    out = subprocess.run(
        ["bash", str(rel.ROOT / "hack" / "release.sh"), "--local", "--version", VERSION,
         "--workdir", str(tmp_path), "--summary", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["images"]) == set(archives)
    registry = summary["registry"]
    assert summary["chart"]["ref"] == f"oci://{registry}/gpuslice/charts/gpuslice"
    assert (
        f"helm install gpuslice oci://{registry}/gpuslice/charts/gpuslice --version {VERSION} "
        f"--plain-http --namespace gpuslice --create-namespace "
        f"--set image.registry={registry}/gpuslice"
    ) in out.stderr
    # the registry is gone with the command
    log = (tmp_path / "registry" / "registry.log").read_text()
    assert "listening on" in log
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{registry}/v2/", timeout=5)
