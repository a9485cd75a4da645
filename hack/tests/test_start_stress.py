"""hack/start_stress.py on the smallest scale: one start of the device plugin, checked, stopped
and counted in its table. The 200-start run is ``make start-stress`` (minutes per
service); the cause it guards against is tested deterministically in
e2e/tests/controlplane/test_sandbox_units.py (procs.start never forks the launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_start_of_the_device_plugin_is_counted() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "hack" / "start_stress.py"),
            "--starts=1",
            "--services=device-plugin",
            "--load=0",
        ],
        capture_output=True,
        text=True,
        timeout=55,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:6] for line in out.stdout.splitlines() if line}
    # starts, ok, aborts, aborts before exec, failed
    assert rows["device-plugin"] == ["1", "1", "0", "0", "0"]
