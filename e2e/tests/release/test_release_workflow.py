""".github/workflows/release.yml against the chart: what a tag publishes is what the chart's
defaults pull (values.yaml image.registry, each service's image.repository, the appVersion the
workflow packages with), every service is built for both architectures with SBOM and provenance,
signed by digest, and every action is pinned by commit SHA. actionlint (make lint) checks the
workflow's syntax and expressions; this checks what it means for a user."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.support.chart import container_images, helm
from gpuslice_testkit import release as rel

WORKFLOW = rel.ROOT / ".github" / "workflows" / "release.yml"
VALUES = rel.CHART_DIR / "values.yaml"
TAG = "v2.3.4-rc.1"


@pytest.fixture(scope="module")
def workflow() -> dict[str, Any]:
    data: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    # YAML 1.1 reads the key `on` as True
    data["on"] = data.pop(True)
    return data


def steps(workflow: dict[str, Any], job: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = workflow["jobs"][job]["steps"]
    return result


def step_using(workflow: dict[str, Any], job: str, action: str) -> dict[str, Any]:
    (found,) = [s for s in steps(workflow, job) if s.get("uses", "").startswith(action + "@")]
    return found


def run_text(workflow: dict[str, Any], job: str) -> str:
    return "\n".join(s.get("run", "") for s in steps(workflow, job))


def expand(template: str, values: dict[str, str]) -> str:
    """``${{ name }}`` expressions replaced from ``values``; an unknown one is an error."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in values, f"{template}: no value for {name}"
        return values[name]

    return re.sub(r"\$\{\{\s*([^}]+?)\s*\}\}", one, template)


def test_a_version_tag_triggers_it(workflow: dict[str, Any]) -> None:
    assert workflow["on"] == {"push": {"tags": ["v*"]}}


def test_every_service_is_built_for_both_architectures_with_sbom_and_provenance(
    workflow: dict[str, Any],
) -> None:
    assert workflow["jobs"]["images"]["strategy"]["matrix"]["service"] == rel.services()
    build = step_using(workflow, "images", "docker/build-push-action")["with"]
    assert build["file"] == "services/${{ matrix.service }}/Dockerfile"
    assert set(build["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    assert build["push"] is True
    assert build["sbom"] is True
    assert build["provenance"] == "mode=max"


def test_the_charts_default_images_are_the_published_ones(
    workflow: dict[str, Any], helm_bin: Path, tmp_path: Path
) -> None:
    values = yaml.safe_load(VALUES.read_text())
    env = workflow["env"]
    assert values["image"]["registry"] == env["IMAGE_REGISTRY"]
    assert values["image"]["tag"] == "", "a fixed image.tag would not follow the release"
    assert env["CHART_REPOSITORY"] == f"oci://{env['IMAGE_REGISTRY']}/charts"

    version = TAG.removeprefix("v")
    build = step_using(workflow, "images", "docker/build-push-action")["with"]
    published = {
        expand(
            build["tags"],
            {
                "env.IMAGE_REGISTRY": env["IMAGE_REGISTRY"],
                "matrix.service": service,
                "env.VERSION": version,
            },
        )
        for service in rel.services()
    }
    # the version the jobs use is the tag without its v, and the chart is packaged with it
    assert workflow["jobs"]["images"]["env"]["VERSION"] == "${{ needs.version.outputs.version }}"
    assert workflow["jobs"]["chart"]["env"]["VERSION"] == "${{ needs.version.outputs.version }}"
    assert "version=${TAG#v}" in run_text(workflow, "version")
    assert 'helm package charts/gpuslice --version "$VERSION" --app-version "$VERSION"' in run_text(
        workflow, "chart"
    )

    # what a user gets from that package with no --set at all
    helm(
        helm_bin, "package", str(rel.CHART_DIR), "--version", version, "--app-version", version,
        "--destination", str(tmp_path),
    )  # fmt: skip
    rendered = helm(
        helm_bin,
        "template",
        "gpuslice",
        str(tmp_path / f"gpuslice-{version}.tgz"),
        "-n",
        "gpuslice",
    )
    images = container_images(list(yaml.safe_load_all(rendered.stdout)))
    assert images == published


def test_images_and_chart_are_signed_by_digest_with_the_workflows_identity(
    workflow: dict[str, Any],
) -> None:
    assert workflow["permissions"] == {"contents": "read"}
    for job in ("images", "chart"):
        assert workflow["jobs"][job]["permissions"]["id-token"] == "write"
        assert workflow["jobs"][job]["permissions"]["packages"] == "write"
        step_using(workflow, job, "sigstore/cosign-installer")
    images_run = run_text(workflow, "images")
    assert 'cosign sign --yes "$image@$DIGEST"' in images_run
    sign = [s for s in steps(workflow, "images") if "cosign sign" in s.get("run", "")]
    assert sign[0]["env"]["DIGEST"] == "${{ steps.build.outputs.digest }}"
    assert 'cosign sign --yes "$chart@$DIGEST"' in run_text(workflow, "chart")


def test_every_action_is_pinned_by_commit_sha(workflow: dict[str, Any]) -> None:
    uses = [s["uses"] for job in workflow["jobs"] for s in steps(workflow, job) if "uses" in s]
    assert uses
    unpinned = [u for u in uses if not re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", u)]
    assert unpinned == []
