"""The GPU stage, top to bottom: what it runs, in which order, and how it always cleans up.

Order matters on a real GPU. The baseline and the watchdog's experiments run before any MPS
share exists, because the enforcer may put the GPU in EXCLUSIVE_PROCESS compute mode while it
serves MPS shares, and then only MPS clients get a context. The MPS experiments keep one share
(the first of the latency shares) for their whole section, so the daemon starts once.

Whatever happens, every workload is killed, every share released, the enforcer stopped (which
stops the MPS daemons), every cgroup removed and the working directory deleted; the cleanup rows
then check that nothing is left.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from e2e.gpustage import checks, harness, measure
from e2e.gpustage.bypass import bypass
from e2e.gpustage.clients import WORKLOAD_MODULE, Launcher
from e2e.gpustage.enforcer import (
    StageEnforcer,
    capabilities_json,
    enforcer_has_flag,
    mechanism_name,
    unavailable_rows,
)
from e2e.gpustage.report import Report, Row, Section
from gpuslice_api.enforcer import cdi_edits
from gpuslice_core.errors import GpusliceError
from gpuslice_nvml import GpuInfo, Nvml, open_nvml
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.enforcer import remove_tree, short_tempdir

SECTIONS = ("contract", "probe", "cdi", "latency", "memory", "sm", "overhead", "bypass")
ENFORCED = {"latency", "memory", "sm", "overhead", "bypass"}
NEEDS_BASELINE = {"sm", "overhead", "bypass"}
MPS = {pb.MECHANISM_MPS_PROTOCOL3, pb.MECHANISM_MPS_LEGACY}
FAKE_MPS = (
    "fake NVML: the MPS daemon is simulated, not its effect on clients (docs/nvml.md), so "
    "this limit is exercised but not judged"
)


@dataclass(frozen=True)
class Options:
    nvml: str  # "real" | "fake"
    fake_config: Path | None
    keep_gpu_settings: bool
    gpu: int
    json_path: Path
    seconds: float
    only: tuple[str, ...]
    workload_module: str = WORKLOAD_MODULE
    #: Where to keep the enforcer's and the workloads' logs (a .tar.gz); None: not kept.
    logs_archive: Path | None = None

    def wants(self, *sections: str) -> bool:
        return any(s in self.only for s in sections)

    def to_json(self) -> dict[str, object]:
        flags = asdict(self)
        flags.update(
            fake_config=str(self.fake_config or ""),
            json_path=str(self.json_path),
            logs_archive=str(self.logs_archive or ""),
        )
        return flags


def keep_logs(workdir: Path, archive: Path) -> None:
    """Every log the stage's processes wrote under ``workdir``, in one .tar.gz."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(workdir.rglob("*")):
            if path.is_file() and path.suffix in (".log", ".out", ".err"):
                tar.add(path, arcname=str(path.relative_to(workdir)))


class Stage:
    def __init__(self, opts: Options, stack: contextlib.ExitStack) -> None:
        self.opts = opts
        self.report = Report(flags=opts.to_json())
        self.settings_seen: dict[str, dict[str, object]] = {}
        self.workdir = short_tempdir("gs-stage-")
        stack.callback(remove_tree, self.workdir)
        if opts.logs_archive is not None:  # runs before the removal (last in, first out)
            stack.callback(keep_logs, self.workdir, opts.logs_archive)
        self.fake_config = opts.fake_config
        if opts.nvml == "fake" and self.fake_config is None:
            self.fake_config = checks.write_fake_node(self.workdir / "node")
        self.nvml: Nvml = stack.enter_context(open_nvml(opts.nvml, self.fake_config))
        self.gpu: GpuInfo = self.nvml.gpu(opts.gpu)
        self.launcher = Launcher(
            module=opts.workload_module,
            backend="cuda" if opts.nvml == "real" else "fake",
            device=self.gpu.index,
            gpu_uuid=self.gpu.uuid,
            fake_config=self.fake_config,
            logs=self.workdir / "logs",
        )
        self.iterations = 0
        self.baseline_rate = 0.0
        self.mps_root: Path | None = None
        self.edits_from = ""
        self.cgroups_made: list[Path] = []
        self.report.flags["workdir"] = str(self.workdir)

    # -- helpers ------------------------------------------------------------------------------
    def section(self, name: str, mechanism: str = "-") -> Section:
        return Section(self.report, name, mechanism)

    def see_settings(self, moment: str) -> None:
        self.settings_seen[moment] = checks.settings(self.nvml, self.gpu.index)

    # -- the stage ----------------------------------------------------------------------------
    def run(self) -> None:
        """Every selected section; the GPU's settings are read before and after, also when the
        stage is interrupted (what an interrupted run changed must be back too)."""
        self.report.gpu = checks.gpu_facts(self.nvml, self.gpu)
        self.see_settings("before")
        try:
            self.sections()
        finally:
            self.see_settings("after")
            for setting in ("compute_mode", "mig_mode"):
                seen = {moment: values[setting] for moment, values in self.settings_seen.items()}
                self.report.gpu[setting] = seen
            for row in checks.settings_rows(self.settings_seen, self.opts.keep_gpu_settings):
                self.report.add(row)

    def sections(self) -> None:
        if self.opts.wants("contract"):
            with self.section("contract"):
                self.report.add(checks.contract_tests(self.opts.nvml))
        workload_missing = not module_exists(self.opts.workload_module)
        if workload_missing:
            reason = f"the workload program ({self.opts.workload_module}) is not in this checkout"
            for name in [s for s in SECTIONS if s not in ("contract", "cdi")]:
                if self.opts.wants(name):
                    self.report.skip(name, "-", "every row", reason)
        if self.opts.wants("probe") and not workload_missing:
            with self.section("probe"):
                self.report.add(self.probe())
        if self.opts.wants("cdi"):
            with self.section("cdi"):
                self.cdi("whole")
        if self.opts.wants(*NEEDS_BASELINE) and not workload_missing:
            with self.section("baseline"):
                self.iterations, self.baseline_rate, row = harness.baseline(
                    self.launcher, self.opts.seconds
                )
                self.report.add(row)
        if self.opts.wants(*ENFORCED, "cdi") and not workload_missing:
            if os.geteuid() != 0:
                reason = "needs root (cgroups, the freezer, the enforcer's NVML calls)"
                self.report.skip("enforcer", "-", "every enforcement row", reason)
            else:
                with contextlib.ExitStack() as enforcement:
                    self.enforcement(enforcement)

    def probe(self) -> Row:
        proc = self.launcher.start("probe", ["probe"], wait=False)
        try:
            proc.finish(harness.START_TIMEOUT_S)
        finally:
            proc.stop()
        result = proc.result or {}
        devices = result.get("devices")
        listed = devices if isinstance(devices, list) else []
        uuids = [d.get("uuid") for d in listed if isinstance(d, dict)]
        ok = bool(result.get("ok")) and self.gpu.uuid in uuids
        value = f"{len(uuids)} device(s), driver {result.get('driver_version', '?')}"
        detail = "" if ok else f"{self.gpu.uuid} not among {uuids}: {proc.describe_end()}"
        target = "sees the GPU through the driver alone"
        return Row(
            "probe",
            "-",
            "workload probe",
            value,
            target,
            "pass" if ok else "fail",
            detail,
            {"result": result},
        )

    def cdi(self, kind: str, share: harness.Share | None = None, mechanism: str = "-") -> None:
        edits = None if share is None else cdi_edits(share.reply.container_edits)
        workdir = self.workdir / f"cdi-{kind}"
        for row in checks.cdi_check(
            self.nvml,
            self.gpu.index,
            self.launcher.argv(["probe"]),
            workdir,
            kind=kind,
            shared_edits=edits,
            mechanism=mechanism,
        ):
            self.report.add(row)

    def enforcement(self, stack: contextlib.ExitStack) -> None:
        caps: pb.GpuCapabilities | None = None
        with self.section("enforcer"):
            extra = []
            if self.opts.keep_gpu_settings and enforcer_has_flag("--compute-mode"):
                extra.append("--compute-mode=leave")
            self.report.flags["enforcer_args"] = extra
            enforcer = StageEnforcer(self.opts.nvml, self.fake_config, self.workdir / "e", extra)
            stack.callback(enforcer.close)
            self.mps_root = enforcer.mps_root
            caps = enforcer.capabilities(self.gpu.uuid)
            if caps is None:
                raise RuntimeError(f"GetCapabilities does not list {self.gpu.uuid}")
            self.report.capabilities = capabilities_json(caps)
            for row in unavailable_rows(caps):
                self.report.add(row)
        if self.mps_root is None or caps is None:
            return
        hard = caps.cores_mechanism in MPS or caps.memory_mechanism == pb.MECHANISM_MEMORY_PARTITION
        label = mechanism_name(
            caps.cores_mechanism if caps.cores_mechanism in MPS else caps.memory_mechanism
        )
        # A shared claim's CDI spec carries the edits of the strongest share this GPU gives.
        self.edits_from = label if hard else "watchdog"
        self.mechanism(enforcer, "watchdog", pb.ENFORCEMENT_MODE_SOFT, caps)
        if self.opts.wants("bypass") and caps.cores_mechanism not in MPS:
            reason = f"no MPS on this GPU: {caps.mps_legacy.reason or caps.mps_protocol3.reason}"
            self.report.skip("bypass", "mps", "non-MPS process in the share", reason)
        if hard:
            self.mechanism(enforcer, label, pb.ENFORCEMENT_MODE_AUTO, caps)

    def mechanism(
        self,
        enforcer: StageEnforcer,
        label: str,
        mode: pb.EnforcementMode.ValueType,
        caps: pb.GpuCapabilities,
    ) -> None:
        """Every experiment of one mechanism, with its latency shares' first one kept."""
        opts, add = self.opts, self.report.add
        bench = harness.Bench(
            nvml=self.nvml,
            enforcer=enforcer,
            launcher=self.launcher,
            gpu_uuid=self.gpu.uuid,
            memory_total=self.gpu.memory_total_bytes,
            seconds=opts.seconds,
            iterations=self.iterations,
            baseline_rate=self.baseline_rate,
            mechanism=label,
            mode=mode,
            unjudged=FAKE_MPS if opts.nvml == "fake" else "",
            cgroups_made=self.cgroups_made,
        )
        mps_cores = mode != pb.ENFORCEMENT_MODE_SOFT and caps.cores_mechanism in MPS
        anchor: harness.Share | None = None
        with self.section("latency", label):
            row, anchor = measure.latency(bench)
            if opts.wants("latency"):
                add(row)
        self.see_settings(f"during {label}")
        try:
            if opts.wants("cdi") and anchor is not None and label == self.edits_from:
                with self.section("cdi", label):
                    self.cdi("shared", anchor, label)
            self.experiments(bench, mode, caps, mps_cores)
        finally:
            if anchor is not None:
                with self.section("latency", label):
                    enforcer.release(anchor.claim)

    def experiments(
        self,
        bench: harness.Bench,
        mode: pb.EnforcementMode.ValueType,
        caps: pb.GpuCapabilities,
        mps_cores: bool,
    ) -> None:
        opts, add, label = self.opts, self.report.add, bench.mechanism
        if opts.wants("memory"):
            with self.section("memory", label):
                add(measure.memory_limit(bench))
            if mps_cores and caps.memory_mechanism == pb.MECHANISM_MEMORY_PARTITION:
                reason = "memory partitioning holds memory on this GPU, not MPS's pinned limit"
                self.report.skip("memory", label, "MPS pinned memory limit", reason)
        cores_elsewhere = mode != pb.ENFORCEMENT_MODE_SOFT and not mps_cores
        if cores_elsewhere:
            reason = f"cores fall back to the watchdog here ({caps.mps_legacy.reason})"
            for name in ("sm", "overhead", "bypass"):
                if opts.wants(name):
                    self.report.skip(name, label, "every row", reason)
            return
        if not bench.iterations:
            reason = "no baseline to compare with (see the baseline row)"
            for name in ("sm", "overhead", "bypass"):
                if opts.wants(name):
                    self.report.skip(name, label, "every row", reason)
            return
        alone: float | None = None
        if opts.wants("sm", "bypass"):
            with self.section("sm", label):
                row, alone = measure.sm_alone(bench)
                if opts.wants("sm"):
                    add(row)
        if opts.wants("sm"):
            with self.section("sm", label):
                add(measure.sm_pair(bench, start_margin=3.0 if opts.nvml == "fake" else 5.0))
        if opts.wants("overhead"):
            with self.section("overhead", label):
                add(measure.overhead(bench))
        if opts.wants("bypass") and mps_cores:
            with self.section("bypass", label):
                for row in bypass(bench, alone):
                    add(row)

    def cleanup_rows(self) -> None:
        """After every experiment and the enforcer stopped: nothing of the stage may be left.
        An MPS server may take a moment to exit after its control daemon quit: up to 10 s."""
        left_mps = checks.mps_leftovers(self.mps_root) if self.mps_root else []
        deadline = time.monotonic() + 10.0
        while left_mps and self.mps_root and time.monotonic() < deadline:
            time.sleep(0.2)
            left_mps = checks.mps_leftovers(self.mps_root)
        left_procs = checks.alive(self.launcher.started)
        left_cgroups = [p for p in self.cgroups_made if p.exists()]
        checked: list[tuple[str, Sequence[object], list[str]]] = [
            ("MPS daemons of the stage", [], left_mps),
            ("workload processes", self.launcher.started, [str(p) for p in left_procs]),
            ("cgroups of the stage", self.cgroups_made, [str(p) for p in left_cgroups]),
        ]
        for figure, made, left in checked:
            value = ", ".join(left) if left else f"none of {len(made)}" if made else "none"
            self.report.add(
                Row(
                    "cleanup",
                    "-",
                    figure,
                    value,
                    "none left",
                    "pass" if not left else "fail",
                    data={"made": [str(m) for m in made], "left": left},
                )
            )


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def run(opts: Options) -> Report:
    """The whole stage; the report is complete (cleanup rows included) when it returns."""
    with contextlib.ExitStack() as stack:
        try:
            stage = Stage(opts, stack)
        except GpusliceError as exc:  # no NVML (no driver, no GPU, a bad fake config)
            report = Report(flags=opts.to_json())
            report.add(Row("gpu", "-", "NVML opens the GPU", "no", "yes", "fail", str(exc)))
            report.finished_at = time.time()
            return report
        try:
            stage.run()
        except (KeyboardInterrupt, SystemExit) as exc:  # everything it started is undone by now
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped ({exc})"
            stage.report.add(Row("stage", "-", "ran to the end", why, "yes", "fail"))
        stage.cleanup_rows()
    stage.report.finished_at = time.time()
    return stage.report
