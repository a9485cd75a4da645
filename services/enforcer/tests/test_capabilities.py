"""Mechanism choice per share, and the capability probe on the fake NVML."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_enforcer.capabilities import Capability, GpuCapabilities, choose, probe
from gpuslice_enforcer.cgroups import CgroupView
from gpuslice_enforcer.config import EnforcerConfig
from gpuslice_enforcer.state import Level, Mechanism, Mode
from gpuslice_nvml import ComputeMode
from gpuslice_nvml.fake import FakeNvml

GIB = 1 << 30
YES, NO = Capability(True, "yes"), Capability(False, "driver too old")


def gpu(
    partition: Capability = NO,
    mps3: Capability = NO,
    legacy: Capability = NO,
    mig: Capability = NO,
    index: int = 0,
    exclusive: Capability = YES,
) -> GpuCapabilities:
    return GpuCapabilities(
        index=index,
        uuid=f"GPU-{index}",
        driver_version="615.1",
        memory_total_bytes=40 * GIB,
        memory_partitioning=partition,
        mps_protocol3=mps3,
        mps_legacy=legacy,
        mig=mig,
        exclusive=exclusive,
    )


def pick(gpus: list[GpuCapabilities], mode: Mode = Mode.AUTO, **kw: object) -> tuple[str, str]:
    args: dict[str, object] = {"strict": False, "cores_percent": 30, "memory_bytes": 4 * GIB}
    args.update(kw)
    choice = choose(gpus, mode=mode, **args)  # type: ignore[arg-type]
    return choice.memory.value, choice.cores.value


def test_strongest_first() -> None:
    assert pick([gpu(YES, YES, YES)]) == ("memory-partition", "mps-protocol3")
    assert pick([gpu(NO, YES, YES)]) == ("mps-protocol3", "mps-protocol3")
    assert pick([gpu(NO, NO, YES)]) == ("mps-legacy", "mps-legacy")
    assert pick([gpu(YES, NO, NO)]) == ("memory-partition", "watchdog")
    assert pick([gpu()]) == ("watchdog", "watchdog")


def test_modes_and_whole_gpus() -> None:
    assert pick([gpu(YES, YES, YES)], Mode.SOFT) == ("watchdog", "watchdog")
    assert pick([gpu(YES, YES, YES)], Mode.OFF) == ("none", "none")
    assert pick([gpu(YES, YES, YES)], cores_percent=100, memory_bytes=40 * GIB) == (
        "none",
        "none",
    )


def test_mps_serves_single_gpu_shares_only() -> None:
    two = [gpu(YES, YES, YES, index=0), gpu(YES, YES, YES, index=1)]
    choice = choose(two, mode=Mode.AUTO, strict=False, cores_percent=30, memory_bytes=GIB)
    assert (choice.memory, choice.cores) == (Mechanism.MEMORY_PARTITION, Mechanism.WATCHDOG)
    assert "spans several" in choice.cores_reason


def test_strict_hard_on_a_soft_gpu_is_refused_with_the_reasons() -> None:
    with pytest.raises(FailedPreconditionError, match=r"memory: .*driver too old"):
        pick([gpu()], Mode.HARD, strict=True)
    with pytest.raises(FailedPreconditionError, match="cores: "):
        pick([gpu(YES)], Mode.HARD, strict=True)
    assert pick([gpu(NO, NO, YES)], Mode.HARD, strict=True) == ("mps-legacy", "mps-legacy")
    lenient = choose([gpu()], mode=Mode.HARD, strict=False, cores_percent=30, memory_bytes=GIB)
    assert "using the watchdog (soft)" in lenient.memory_reason


def test_mig_gpus_are_refused() -> None:
    with pytest.raises(FailedPreconditionError, match="MIG"):
        pick([gpu(mig=Capability(True, "the GPU is in MIG mode"))])


def test_level() -> None:
    assert gpu(YES, YES).level is Level.HARD
    assert gpu(YES).level is Level.SOFT
    assert gpu().level is Level.SOFT


def test_probe_on_the_fake(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text(
        'name: n\ndriverVersion: "570.1"\nstatePath: s.json\ngpus:\n'
        "  - model: T4\n  - model: H100\n    migEnabled: true\n"
    )
    cfg = EnforcerConfig(socket=tmp_path / "s", state_dir=tmp_path, mps_control=("/bin/true",))
    found = probe(FakeNvml.from_config_file(config), cfg, CgroupView(mounts=()))
    t4, h100 = found
    assert "no cgroup v2" in t4.memory_partitioning.reason
    assert not t4.mps_protocol3.available and "615" in t4.mps_protocol3.reason
    assert t4.mps_legacy.available  # Turing is newer than Volta
    assert h100.mig.available and not h100.mps_legacy.available


LEFT = Capability(False, "compute mode DEFAULT is left as it is (--compute-mode=leave)")


def test_mps_is_hard_only_where_no_process_can_run_beside_the_server() -> None:
    assert gpu(NO, NO, YES).level is Level.HARD
    assert gpu(NO, NO, YES, exclusive=LEFT).level is Level.SOFT
    assert gpu(YES, NO, NO, exclusive=LEFT).level is Level.SOFT  # cores by the watchdog anyway
    choice = choose(
        [gpu(NO, NO, YES, exclusive=LEFT)],
        mode=Mode.AUTO,
        strict=False,
        cores_percent=30,
        memory_bytes=GIB,
    )
    assert (choice.memory, choice.cores) == (Mechanism.MPS_LEGACY, Mechanism.MPS_LEGACY)
    assert not choice.mps_exclusive
    assert "SOFT: compute mode DEFAULT" in choice.cores_reason
    assert "SOFT: compute mode DEFAULT" in choice.memory_reason
    with pytest.raises(FailedPreconditionError, match=r"cores: .*--compute-mode=leave"):
        pick([gpu(NO, NO, YES, exclusive=LEFT)], Mode.HARD, strict=True)
    # memory partitioning holds every process whatever the compute mode
    assert pick([gpu(YES, NO, YES, exclusive=LEFT)]) == ("memory-partition", "mps-legacy")


def test_the_probe_reads_the_compute_mode(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text('name: n\ndriverVersion: "580.1"\nstatePath: s.json\ngpus:\n  - model: L4\n')
    fake = FakeNvml.from_config_file(config)
    manage = EnforcerConfig(socket=tmp_path / "s", state_dir=tmp_path, mps_control=("/bin/true",))
    leave = EnforcerConfig(
        socket=tmp_path / "s",
        state_dir=tmp_path,
        mps_control=("/bin/true",),
        manage_compute_mode=False,
    )
    views = CgroupView(mounts=())
    assert probe(fake, manage, views)[0].exclusive.available
    assert probe(fake, manage, views)[0].level is Level.HARD
    assert not probe(fake, leave, views)[0].exclusive.available
    assert probe(fake, leave, views)[0].level is Level.SOFT
    fake.set_compute_mode(0, ComputeMode.EXCLUSIVE_PROCESS)  # the operator's choice
    assert probe(fake, leave, views)[0].exclusive.available
    assert probe(fake, leave, views)[0].level is Level.HARD
