"""hack/e2e-kind.sh where kind cannot run: it stops at once with a message that says what is
missing and where the same scenarios run instead, and creates nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "hack" / "e2e-kind.sh"


def _run(path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        ["/bin/bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_without_docker_it_says_so_and_points_at_the_real_node_tier(tmp_path: Path) -> None:
    done = _run(f"{tmp_path}:/usr/bin/env-missing")  # no docker on PATH at all
    assert done.returncode == 2, done
    assert "needs Docker" in done.stderr and "make e2e-real" in done.stderr, done.stderr


@pytest.mark.parametrize("engine", [False, True])
def test_docker_without_an_engine_or_kind_is_refused_by_name(tmp_path: Path, engine: bool) -> None:
    (tmp_path / "docker").write_text(f"#!/bin/sh\nexit {0 if engine else 1}\n")
    (tmp_path / "docker").chmod(0o755)
    done = _run(f"{tmp_path}:/usr/bin:/bin")
    assert done.returncode == 2, done
    if engine:  # docker answers; kind is what is missing (none in this PATH)
        assert "needs kind" in done.stderr, done.stderr
    else:
        assert "no engine answers" in done.stderr and "make e2e-real" in done.stderr
