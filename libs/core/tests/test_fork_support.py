"""gRPC's fork support is off in every service process (gpuslice_core's import-time default).

gRPC reads GRPC_ENABLE_FORK_SUPPORT when ``grpc`` is imported; a default set later is ignored.
Each service's entry point is imported in a fresh interpreter that records the variable at the
moment ``grpc`` is first imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SPY = """
import importlib, os, sys
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "(unset)"))
        return None
sys.meta_path.insert(0, Spy())
importlib.import_module(sys.argv[1])
print(seen[0] if seen else "(grpc not imported)")
"""


def entry_points() -> list[tuple[str, str]]:
    """(script, module) of every console script of the services."""
    found = []
    for pyproject in sorted(ROOT.glob("services/*/pyproject.toml")):
        scripts = tomllib.loads(pyproject.read_text())["project"].get("scripts", {})
        found += [(name, target.split(":")[0]) for name, target in scripts.items()]
    return found


def test_every_service_has_an_entry_point() -> None:
    assert len({module.split(".")[0] for _, module in entry_points()}) >= 5


@pytest.mark.parametrize(("script", "module"), entry_points())
def test_grpc_is_imported_with_fork_support_off(script: str, module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run(
        [sys.executable, "-c", SPY, module],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    assert out.stdout.strip() in ("false", "(grpc not imported)"), (
        f"{script} ({module}) imports grpc before gpuslice_core: "
        f"GRPC_ENABLE_FORK_SUPPORT={out.stdout.strip()}"
    )
