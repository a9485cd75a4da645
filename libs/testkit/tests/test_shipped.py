"""No test support ships: every shipped member's wheel is built and searched for test modules."""

from __future__ import annotations

import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
UV = ROOT / ".tools" / "uv" / "bin" / "uv"
SHIPPED = sorted(
    p.parent
    for p in ROOT.glob("*/*/pyproject.toml")
    if p.parent.parent.name in ("libs", "services", "tools") and p.parent.name != "testkit"
)


def _test_modules(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    return [
        name
        for name in names
        if any(
            part in ("testing", "testing.py", "testkit", "tests", "conftest.py", "testhooks.py")
            or part.startswith("test_")
            for part in name.split("/")
        )
    ]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not UV.exists(), reason="no .tools/uv (make setup installs it)")
def test_no_wheel_of_a_shipped_member_holds_test_support(tmp_path: Path) -> None:
    built: dict[str, list[str]] = {}
    for member in SHIPPED:
        name = tomllib.loads((member / "pyproject.toml").read_text())["project"]["name"]
        out = tmp_path / member.name
        subprocess.run(
            [str(UV), "build", "--wheel", "--quiet", "--out-dir", str(out), str(member)],
            check=True,
            cwd=ROOT,
            env={"UV_PYTHON_DOWNLOADS": "never", "PATH": "/usr/bin:/bin"},
        )
        (wheel,) = out.glob("*.whl")
        built[name] = _test_modules(wheel)
    assert len(built) == len(SHIPPED) >= 12
    assert {name: found for name, found in built.items() if found} == {}
