"""Several processes share one fake node through its state file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpuslice_nvml.fake import FakeNvml
from gpuslice_nvml.types import HealthEventKind


def ctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_nvml.fake.ctl", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_xid_from_another_process_reaches_a_waiting_watch(
    fake: FakeNvml, mixed_config: Path
) -> None:
    with fake.watch_events([0]) as watch:
        result = ctl(mixed_config, "xid", "--gpu", "0", "--code", "79")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["xid"] == 79
        event = watch.wait(timeout_s=10)
    assert event is not None
    assert (event.kind, event.gpu_index, event.xid) == (HealthEventKind.XID, 0, 79)


def test_lost_gpu_from_another_process(fake: FakeNvml, mixed_config: Path) -> None:
    with fake.watch_events() as watch:
        assert ctl(mixed_config, "lost", "--gpu", "2").returncode == 0
        event = watch.wait(timeout_s=10)
    assert event is not None and event.kind is HealthEventKind.GPU_LOST
    assert fake.gpu(1).name  # the others still answer


def test_process_added_elsewhere_is_seen_here(fake: FakeNvml, mixed_config: Path) -> None:
    result = ctl(
        mixed_config, "process", "add", "--pid", "4242", "--device", "1", "--memory", "8GiB",
        "--sm", "70",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (proc,) = fake.running_processes(1)
    assert (proc.pid, proc.used_memory_bytes) == (4242, 8 << 30)
    assert fake.process_utilization(1)[0].sm_percent == 70


def test_change_made_here_is_seen_elsewhere(fake: FakeNvml, mixed_config: Path) -> None:
    gi = fake.create_gpu_instance(0, 14)
    state = json.loads(ctl(mixed_config, "state").stdout)
    assert [g["id"] for g in state["gpus"][0]["gpuInstances"]] == [gi.id]


def test_ctl_errors_name_the_problem(mixed_config: Path) -> None:
    result = ctl(mixed_config, "process", "add", "--pid", "1", "--device", "0")
    assert result.returncode == 1
    assert "MIG mode" in result.stderr


def test_concurrent_creators_never_lose_an_update(fake: FakeNvml, mixed_config: Path) -> None:
    """Four processes race to fill GPU 0 with 1g.10gb instances: exactly 7 succeed."""
    script = textwrap.dedent(
        f"""
        from gpuslice_nvml.errors import NvmlInsufficientResources
        from gpuslice_nvml.fake import FakeNvml
        nvml = FakeNvml.from_config_file({str(mixed_config)!r})
        made = 0
        while True:
            try:
                nvml.create_gpu_instance(0, 19)
            except NvmlInsufficientResources:
                break
            made += 1
        print(made)
        """
    )

    def run() -> int:
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
        )
        return int(out.stdout)

    with ThreadPoolExecutor(4) as pool:
        made = list(pool.map(lambda _: run(), range(4)))
    assert sum(made) == 7
    assert len(fake.gpu_instances(0)) == 7
