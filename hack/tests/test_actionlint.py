"""hack/actionlint.sh, as ``make lint`` runs it: the repository's workflows pass, and a workflow
with a mistake actionlint knows (an undefined matrix key, an unknown runner label) fails with
the file, the line and the reason. The binary is built once from its Go module (about 16 s cold,
then cached); without Go the module is skipped and says so."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "actionlint.sh"
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("go") is None,
        reason="go is not installed (actionlint is built from its Go module)",
    ),
]

BROKEN = """\
name: broken
on: push
jobs:
  build:
    runs-on: [self-hosted, tpu]
    strategy:
      matrix:
        service: [a, b]
    steps:
      - run: echo "${{ matrix.servce }}"
"""


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=280,
        check=False,
    )


def test_the_repositorys_workflows_pass() -> None:
    out = run()
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_broken_workflow_fails_with_file_line_and_reason(tmp_path: Path) -> None:
    workflow = tmp_path / ".github" / "workflows" / "broken.yml"
    workflow.parent.mkdir(parents=True)
    workflow.write_text(BROKEN)
    out = run(str(workflow), cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    # actionlint names the file relative to where the script runs (the repository root) when
    # it can: "../pytest-of-root/…/broken.yml:10:11: …" from /tmp/ci-clone. Resolve each.
    found = {
        (int(m.group(2)), m.group(3))
        for m in re.finditer(r"^(\S+?):(\d+):\d+: (.*)$", out.stdout, re.MULTILINE)
        if (ROOT / m.group(1)).resolve() == workflow.resolve()
    }
    lines = {line for line, _ in found}
    assert {5, 10} <= lines, out.stdout
    assert any('property "servce" is not defined' in why for line, why in found if line == 10)
    assert any('label "tpu" is unknown' in why for line, why in found if line == 5)
