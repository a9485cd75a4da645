"""The README's first command, `make demo`, does what it says: pods get their GPUs and limits."""

from __future__ import annotations

import re
import subprocess
import sys

from e2e.sandbox.binaries import REPO_ROOT


def test_demo_runs_pods_on_gpus_and_stops_everything() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "e2e.sandbox.demo"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, f"demo failed:\n{out}\n{done.stderr[-3000:]}"
    # a MIG device has no cores: '-' in the slice table, its compute slices for the pod
    assert re.search(r"gpu-node-a\s+gpu-3-mig-3g-40gb-4\s+mig\s+NVIDIA H100 80GB HBM3\s+-\s", out)
    assert re.search(r"train\s+Running on gpu-node-a\s+gpu-\d\s+cores 100%", out), out
    assert re.search(r"infer-30\s+Running on gpu-node-b\s+gpu-0\s+cores\s+30%", out), out
    assert re.search(r"infer-50\s+Running on gpu-node-b\s+gpu-0\s+cores\s+50%", out), out
    mig = r"notebook-mig\s+Running on gpu-node-a\s+gpu-3-mig-3g-40gb-4\s+compute slices 3\s+memory"
    assert re.search(mig, out), out
    assert "cores" not in next(line for line in out.splitlines() if "notebook-mig" in line), out
    assert re.search(r"infer-40\s+Pending: .*cannot allocate all claims", out), out
    assert "everything stopped" in out and "WARNING" not in out, out
