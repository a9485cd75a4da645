"""Each service image installs only its own member, into the path it runs from.

No Docker engine runs in CI, so the images are not built here; these checks catch the mistakes
that would only show when an image starts (a console script whose shebang points into the
build stage, an entrypoint that is not the member's console script, a member that installs
the whole workspace).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.parent for p in ROOT.glob("services/*/pyproject.toml"))


@pytest.mark.parametrize("service", SERVICES, ids=lambda p: p.name)
def test_image_installs_its_member_where_it_runs(service: Path) -> None:
    project = tomllib.loads((service / "pyproject.toml").read_text())["project"]
    dockerfile = (service / "Dockerfile").read_text()
    env = re.search(r"UV_PROJECT_ENVIRONMENT=(\S+)", dockerfile)
    assert env, "the build stage must create the venv at its final path (UV_PROJECT_ENVIRONMENT)"
    venv = env.group(1)
    assert f"COPY --from=build {venv} {venv}" in dockerfile
    assert f"--package {project['name']} " in dockerfile
    assert "--no-dev" in dockerfile and "--locked" in dockerfile
    entrypoint = re.search(r'ENTRYPOINT \["([^"]+)"', dockerfile)
    assert entrypoint and entrypoint.group(1) in project["scripts"]
