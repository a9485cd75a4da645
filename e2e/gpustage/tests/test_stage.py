"""The whole GPU stage on the fake NVML backend, as CI runs it: every section present, the
watchdog's memory row a kill within two sampling periods, numbers in the SM rows, and nothing
left behind (cgroups, MPS stand-in daemons, workloads, the working directory).

The fake cannot show MPS's effect on its clients, so those rows are "measured" there; and SM
rates of fake workloads depend on the CPU they get, so the test does not ask for the stage's
exit status to be 0 (a missed SM target on a loaded machine is a 1), only that it completed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.gpustage.checks import REPO_ROOT
from e2e.gpustage.clients import WORKLOAD_MODULE

WORKLOAD = os.environ.get("GPU_STAGE_WORKLOAD", WORKLOAD_MODULE)

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and the freezer"),
    pytest.mark.skipif(
        importlib.util.find_spec(WORKLOAD) is None,
        reason=f"the workload program ({WORKLOAD}) is not in this checkout",
    ),
    pytest.mark.timeout(180),
]

SECTIONS = {
    "contract",
    "probe",
    "cdi",
    "baseline",
    "latency",
    "memory",
    "sm",
    "overhead",
    "bypass",
    "settings",
    "cleanup",
}


NUL = b"\0"


def _processes_naming(path: str) -> list[str]:
    """Processes whose command line names ``path`` (the stage's working directory: its
    enforcer, MPS stand-in daemons and fake workloads all do)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if path.encode() in cmdline:
            found.append(f"{proc.name}: {cmdline.replace(NUL, b' ').decode(errors='replace')}")
    return found


def test_the_whole_stage_runs_on_the_fake_backend(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "e2e.gpustage", "--nvml", "fake", "--json", str(report_path)],
        cwd=REPO_ROOT,
        env={**os.environ, "GPU_STAGE_WORKLOAD": WORKLOAD},
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    print(out.stdout)
    assert out.returncode in (0, 1), out.stderr[-3000:]
    assert "section" in out.stdout and "passed" in out.stdout  # the table and its summary
    report = json.loads(report_path.read_text())
    assert report["schema"] == "gpuslice.gpustage/v1"
    assert report["gpu"]["driver_version"] == "580.65.06"
    assert report["summary"]["exit_code"] == out.returncode
    rows = report["rows"]

    assert {row["section"] for row in rows} >= SECTIONS
    crashed = [row for row in rows if row["value"] == "crashed"]
    assert not crashed, crashed
    mechanisms = {row["mechanism"] for row in rows if row["section"] == "memory"}
    assert mechanisms == {"watchdog", "mps-legacy"}  # driver 580: legacy MPS, no partitioning

    (memory,) = [r for r in rows if r["section"] == "memory" and r["mechanism"] == "watchdog"]
    assert memory["verdict"] == "pass", memory
    assert memory["data"]["exit"] == -9 and memory["data"]["periods"] <= 2.0

    for mechanism in ("watchdog", "mps-legacy"):
        sm = {r["figure"]: r for r in rows if r["section"] == "sm" and r["mechanism"] == mechanism}
        alone, pair = sm["SM 30 alone"], sm["SM 30 + 70 together"]
        assert alone["verdict"] == "measured" and alone["data"].get("percent", 0) > 0, alone
        percents = pair["data"].get("percent", [])
        assert len(percents) == 2 and all(p > 0 for p in percents), pair
        assert pair["verdict"] in ("pass", "fail", "measured")

    (contract,) = [r for r in rows if r["section"] == "contract"]
    assert contract["verdict"] == "pass", contract
    bypass = [r for r in rows if r["section"] == "bypass"]
    assert bypass and bypass[0]["verdict"] in ("pass", "fail")

    cleanup = [r for r in rows if r["section"] == "cleanup"]
    assert len(cleanup) == 3 and all(r["verdict"] == "pass" for r in cleanup), cleanup
    (cgroups,) = [r for r in cleanup if r["figure"] == "cgroups of the stage"]
    assert cgroups["data"]["made"], "the experiments made no cgroups"
    assert [c for c in cgroups["data"]["made"] if Path(c).exists()] == []
    workdir = report["flags"]["workdir"]
    assert not Path(workdir).exists()
    assert _processes_naming(workdir) == []
