"""The stage's checks that are not enforcement experiments: the NVML contract tests, the CDI
spec check, the GPU's settings, and what is left on the machine afterwards."""

from __future__ import annotations

import contextlib
import importlib
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from e2e.gpustage.report import Row, Verdict, judged
from gpuslice_core import cdi
from gpuslice_nvml import GpuInfo, Nvml, NvmlError

REPO_ROOT = Path(__file__).resolve().parents[2]

#: The fake node of ``--nvml fake`` without a config: one H100 on the driver of the first
#: real-GPU run (580: no memory partitioning or MPS protocol 3, so MPS is legacy MPS).
FAKE_NODE = """\
name: gpustage-node
driverVersion: "580.65.06"
cudaDriverVersion: "13.0"
statePath: state.json
gpus:
  - model: NVIDIA H100 80GB HBM3
"""


def write_fake_node(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "node.yaml"
    config.write_text(FAKE_NODE)
    return config


# -- NVML contract tests ------------------------------------------------------------------


def contract_tests(backend: str) -> Row:
    """The NVML contract tests as a subprocess: on the real backend the ``gpu``-marked ones
    (the contract against the real NVML, the MIG manager's read-only checks), on the fake the
    contract against the fake."""
    if backend == "real":
        targets = ["-m", "gpu", "libs/nvml/tests", "services/mig-manager/tests/test_real_gpu.py"]
    else:
        targets = ["libs/nvml/tests/contract", "-m", "not gpu"]
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets]
    out = subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    counts = summary_counts(out.stdout)
    passed, failed = counts.get("passed", 0), counts.get("failed", 0) + counts.get("errors", 0)
    ok = out.returncode == 0 and failed == 0 and passed > 0
    value = ", ".join(f"{n} {what}" for what, n in counts.items()) or f"exit {out.returncode}"
    tail = "" if ok else (out.stdout + out.stderr)[-1500:].strip()
    return Row(
        "contract",
        backend,
        "NVML contract tests",
        value,
        "all pass",
        judged(ok),
        tail,
        data={"argv": argv[1:], "exit": out.returncode, "counts": counts},
    )


SUMMARY_COUNT = r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)"


def summary_counts(stdout: str) -> dict[str, int]:
    """pytest's last summary line ("3 passed, 1 skipped in 0.5s") as counts."""
    for line in reversed(stdout.strip().splitlines()):
        found = re.findall(
            r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", line
        )
        if found:
            counts: dict[str, int] = {}
            for n, what in found:
                key = "errors" if what.startswith("error") else what
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return {}


# -- CDI -------------------------------------------------------------------------------------


def cdi_check(
    nvml: Nvml,
    gpu: int,
    probe_cmd: Sequence[str],
    workdir: Path,
    *,
    kind: str,
    shared_edits: cdi.ContainerEdits | None = None,
    mechanism: str = "-",
) -> list[Row]:
    """``e2e.gpustage.cdicheck.check_cdi``'s results of one kind of claim ("whole", or "shared"
    with the edits of a real share) on the stage's GPU; imported here, so that a checkout
    without it still runs the rest of the stage and says so.

    The two kinds run at different moments: a whole-GPU claim's probe is a plain CUDA process,
    refused a context while the enforcer holds the GPU in EXCLUSIVE_PROCESS for MPS shares; a
    shared claim's probe with MPS edits needs the share's daemon running."""
    try:
        module = importlib.import_module("e2e.gpustage.cdicheck")
    except ModuleNotFoundError as exc:
        if exc.name != "e2e.gpustage.cdicheck":
            raise
        reason = "not available: e2e/gpustage/cdicheck.py is not in this checkout"
        return [Row("cdi", mechanism, f"CDI spec, {kind} claim", "-", "-", "skipped", reason)]
    check: Callable[..., list[object]] = module.check_cdi
    workdir.mkdir(parents=True, exist_ok=True)
    given = None if shared_edits is None else {gpu: shared_edits}
    rows = []
    for result in check(nvml, probe_cmd=list(probe_cmd), workdir=workdir, shared_edits=given):
        to_json = getattr(result, "to_json", None)
        data = to_json() if callable(to_json) else {"result": repr(result)}
        if not isinstance(data, dict) or data.get("gpu") != gpu or data.get("kind") != kind:
            continue
        status, reason = str(data.get("status", "")), str(data.get("reason", ""))
        verdict: Verdict = "skipped" if status == "skipped" else judged(status == "pass")
        value = "-" if verdict == "skipped" else "ok" if verdict == "pass" else "not ok"
        figure = f"CDI spec, {kind} claim"
        rows.append(
            Row("cdi", mechanism, figure, value, "probe sees its GPU", verdict, reason, data)
        )
    if not rows:
        why = f"check_cdi returned no {kind} result for GPU {gpu}"
        rows.append(Row("cdi", mechanism, f"CDI spec, {kind} claim", "none", "-", "fail", why))
    return rows


# -- the GPU and its settings ------------------------------------------------------------------


def gpu_facts(nvml: Nvml, gpu: GpuInfo) -> dict[str, object]:
    system = nvml.system_info()
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "architecture": gpu.architecture,
        "compute_capability": gpu.cuda_compute_capability_str,
        "multiprocessors": gpu.multiprocessors,
        "memory_total_bytes": gpu.memory_total_bytes,
        "driver_version": system.driver_version,
        "cuda_driver_version": system.cuda_version,
    }


def settings(nvml: Nvml, index: int) -> dict[str, object]:
    """Compute mode (where gpuslice_nvml can read it) and MIG mode, now."""
    read: Callable[[int], object] | None = getattr(nvml, "compute_mode", None)
    compute: object = None
    if read is not None:
        try:
            compute = str(read(index))
        except NvmlError as exc:
            compute = f"error: {exc}"
    try:
        mig = nvml.gpu(index).mig_mode
        mig_mode: object = None if mig is None else {"current": mig.current, "pending": mig.pending}
    except NvmlError as exc:
        mig_mode = f"error: {exc}"
    return {"compute_mode": compute, "mig_mode": mig_mode}


def settings_rows(seen: dict[str, dict[str, object]], keep: bool) -> list[Row]:
    """``seen``: settings by moment (before, during-<mechanism>…, after). With
    --keep-gpu-settings nothing may change at any moment; without it, what the enforcer changed
    while serving shares must be back afterwards."""
    rows = []
    for setting in ("compute_mode", "mig_mode"):
        values = {moment: s.get(setting) for moment, s in seen.items()}
        figure = setting.replace("_", " ")
        if setting == "compute_mode" and values.get("before") is None:
            reason = "gpuslice_nvml cannot read the compute mode here (no compute_mode())"
            rows.append(Row("settings", "-", figure, "-", "-", "skipped", reason, {"seen": values}))
            continue
        if keep:
            ok, target = len({repr(v) for v in values.values()}) == 1, "never changed"
        else:
            ok, target = values.get("after") == values.get("before"), "restored afterwards"
        value = _changes(values)
        rows.append(Row("settings", "-", figure, value, target, judged(ok), data={"seen": values}))
    return rows


def _changes(values: dict[str, object]) -> str:
    """ "DEFAULT throughout", or each change with the moment it was seen:
    "DEFAULT, mps-legacy: EXCLUSIVE_PROCESS, after: DEFAULT"."""
    parts: list[str] = []
    last = None
    for moment, value in values.items():
        text = _short(value)
        if text != last:
            parts.append(f"{moment.removeprefix('during ')}: {text}" if parts else text)
            last = text
    return f"{parts[0]} throughout" if len(parts) == 1 else ", ".join(parts)


def _short(value: object) -> str:
    if isinstance(value, dict):
        return "on" if value.get("current") else "off"
    return "n/a" if value is None else str(value)


# -- what is left -----------------------------------------------------------------------------


def mps_leftovers(mps_root: Path) -> list[str]:
    """MPS control daemons and servers of this stage still running (a process whose command
    line or environment names the stage's MPS root), and pid files left under it."""
    left = [f"pid file {p}" for p in mps_root.glob("*/nvidia-cuda-mps-control.pid")]
    needle = str(mps_root).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes()
            comm = (proc / "comm").read_text().strip()
            if not (comm.startswith("nvidia-cuda-mps") or b"mps_control" in cmdline):
                continue
            if needle in cmdline or needle in (proc / "environ").read_bytes():
                left.append(f"pid {proc.name} ({comm})")
    return left


def alive(pids: Sequence[int]) -> list[int]:
    def running(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")

    return [pid for pid in pids if running(pid)]
