"""The GPU stage's workload: arguments, the CUDA binding's pieces that need no GPU, the fake
backend end to end, and (``gpu`` mark) the real thing where there is a GPU."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.gpustage import cuda, workload
from gpuslice_nvml.fake import FakeNvmlControl

REPO_ROOT = Path(__file__).resolve().parents[3]
GIB, MIB = 1 << 30, 1 << 20
NODE = """\
name: gpustage-test
statePath: state.json
gpus:
  - model: T4
  - model: L4
"""

pytestmark = pytest.mark.timeout(30)


def _parse(stdout: str) -> list[dict[str, Any]]:
    """Every line of the workload's stdout, each of which must be one JSON object."""
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert lines, "the workload printed nothing"
    assert all(isinstance(line, dict) for line in lines)
    return lines


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "e2e.gpustage.workload", *args]


def run_workload(*args: str, timeout: float = 20) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.run(
        _command(*args),
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, _parse(proc.stdout)


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL(cuda.LIBRARY)
    except OSError:
        return False
    return True


@pytest.fixture
def node(tmp_path: Path) -> Path:
    config = tmp_path / "node.yaml"
    config.write_text(NODE)
    return config


def fake(config: Path, *args: str) -> list[str]:
    return [*args, "--backend", "fake", "--fake-nvml-config", str(config)]


# -- arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [("4GiB", 4 * GIB), ("512MiB", 512 * MIB), ("1.5GiB", 3 * GIB // 2), ("1000", 1000)],
)
def test_byte_counts_parse(text: str, value: int) -> None:
    assert workload.parse_bytes(text) == value


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["alloc", "--bytes", "4GB"], "--bytes"),
        (["alloc", "--bytes", "1.5"], "--bytes"),
        (["alloc", "--bytes", "0"], "--bytes"),
        (["alloc", "--bytes", "1GiB", "--chunk", "lots"], "--chunk"),
        (["alloc"], "--bytes"),
        (["sm"], "--seconds"),
        (["sm", "--seconds", "0"], "--seconds"),
        (["sm", "--seconds", "1", "--iterations", str(2**32)], "--iterations"),
        (["sm", "--seconds", "1", "--per-sync", "0"], "--per-sync"),
        (["probe", "--device", "-1"], "--device"),
        (["probe", "--backend", "fake"], "--fake-nvml-config"),
        (["frobnicate"], "COMMAND"),
    ],
)
def test_bad_arguments_name_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        workload.main(argv)
    assert exit_info.value.code == workload.EXIT_USAGE
    out, err = capsys.readouterr()
    result = _parse(out)[-1]
    assert result["ok"] is False
    assert result["stage"] == "arguments"
    assert option in result["error"]
    assert option in err


# -- the CUDA binding without a GPU ---------------------------------------------------------
def test_uuid_is_formatted_as_nvml_does() -> None:
    assert cuda.format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_cuda_error_names_the_call_and_the_error() -> None:
    error = cuda.CudaError("cuCtxSetCurrent", 46, "CUDA_ERROR_DEVICES_UNAVAILABLE")
    assert str(error) == "cuCtxSetCurrent: CUDA_ERROR_DEVICES_UNAVAILABLE (46)"
    error.detail = "ptxas fatal"
    assert str(error).endswith("(46): ptxas fatal")


def test_a_missing_library_is_a_context_failure_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda, "LIBRARY", "libcuda-absent.so.1")
    args = workload.build_parser().parse_args(["sm", "--seconds", "1"])
    status, result = workload.run(args)
    assert status == workload.EXIT_NO_CONTEXT
    assert result["ok"] is False
    assert result["stage"] == "context"
    assert "libcuda-absent.so.1 could not be loaded" in str(result["error"])


@pytest.mark.skipif(_libcuda_loads(), reason="this machine has libcuda.so.1")
@pytest.mark.parametrize("command", [["probe"], ["alloc", "--bytes", "1MiB"]])
def test_without_libcuda_the_workload_exits_3(command: list[str]) -> None:
    status, lines = run_workload(*command)
    assert status == 3
    assert lines[-1]["stage"] == "context"
    assert "libcuda.so.1" in lines[-1]["error"]


def test_windows_are_rates_per_half_second() -> None:
    windows = workload._Windows(1.2)
    windows.add(0.1, 2)
    windows.add(0.7, 1)
    windows.add(1.19, 1)
    assert windows.rates() == pytest.approx([4.0, 2.0, 5.0])


# -- the CUDA backend on a stub libcuda.so.1 ---------------------------------------------
#: A stand-in driver, so the ctypes plumbing (signatures, kernel parameters, the JIT log, error
#: names) runs without a GPU. A kernel sleeps 100 ns per iteration; STUB_CUDA_FAIL=call:code
#: makes one call fail; STUB_CUDA_MEMORY is the GPU's memory. cuGetErrorName knows only code 2,
#: so other codes take the workload's own table.
STUB_LIBCUDA = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t used;
static int fail(const char *call) {
    const char *spec = getenv("STUB_CUDA_FAIL");
    size_t n = strlen(call);
    return spec && !strncmp(spec, call, n) && spec[n] == ':' ? atoi(spec + n + 1) : 0;
}
#define CHECK(call) do { int rc = fail(call); if (rc) return rc; } while (0)
static size_t memory(void) {
    const char *m = getenv("STUB_CUDA_MEMORY");
    return m ? strtoull(m, 0, 10) : (size_t)1 << 30;
}
int cuGetErrorName(int code, const char **name) {
    if (code != 2) return 1;
    *name = "CUDA_ERROR_OUT_OF_MEMORY";
    return 0;
}
int cuInit(unsigned flags) { CHECK("cuInit"); return flags ? 1 : 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGet(int *d, int ordinal) { if (ordinal) return 101; *d = 0; return 0; }
int cuDeviceGetName(char *s, int len, int d) { strncpy(s, "Stub GPU", len); return d; }
int cuDeviceGetUuid_v2(unsigned char *u, int d) { for (int i = 0; i < 16; i++) u[i] = i; return d; }
int cuDeviceGetAttribute(int *v, int attr, int d) { *v = 2; return attr == 16 ? d : 1; }
int cuDeviceTotalMem_v2(size_t *b, int d) { *b = memory(); return d; }
int cuDevicePrimaryCtxRetain(void **c, int d) {
    CHECK("cuDevicePrimaryCtxRetain");
    *c = (void *)1;
    return d;
}
int cuCtxSetCurrent(void *c) { CHECK("cuCtxSetCurrent"); return c == (void *)1 ? 0 : 201; }
int cuCtxSynchronize(void) { return 0; }
int cuModuleLoadDataEx(void **m, const char *ptx, unsigned n, int *opt, void **val) {
    if (n != 2 || opt[0] != 5 || opt[1] != 6) return 1;
    if (!strstr(ptx, ".entry gpuslice_spin(") || ptx[strlen(ptx) - 2] != '}') {
        strncpy((char *)val[0], "stub JIT: no gpuslice_spin", (size_t)val[1]);
        return 218;
    }
    *m = (void *)2;
    return 0;
}
int cuModuleGetFunction(void **f, void *m, const char *name) {
    if (m != (void *)2 || strcmp(name, "gpuslice_spin")) return 500;
    *f = (void *)3;
    return 0;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    if (f != (void *)3 || gx != 1024 || gy != 1 || gz != 1 || bx != 256 || by != 1 || bz != 1
        || shared || stream || extra || !params) return 1;
    if (*(uint64_t *)params[1] != 0x100000) return 700;  /* the first allocation */
    uint64_t ns = *(uint32_t *)params[0] * 100ull;
    struct timespec t = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    nanosleep(&t, 0);
    return 0;
}
int cuMemAlloc_v2(uint64_t *p, size_t n) {
    if (used + n > memory()) return 2;
    *p = 0x100000 + used;
    used += n;
    return 0;
}
int cuMemFree_v2(uint64_t p) { return p ? 0 : 1; }
int cuMemGetInfo_v2(size_t *free, size_t *total) {
    *total = memory();
    *free = *total - used;
    return 0;
}
int cuMemsetD8_v2(uint64_t p, unsigned char v, size_t n) { return p && v == 0xA5 && n ? 0 : 1; }
"""


@pytest.fixture(scope="module")
def stub_driver(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment that makes the workload load the stub as libcuda.so.1."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler for the stub libcuda.so.1")
    directory = tmp_path_factory.mktemp("stub-libcuda")
    source = directory / "stub.c"
    source.write_text(STUB_LIBCUDA)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(directory / cuda.LIBRARY), str(source)],
        check=True,
    )
    return {**os.environ, "LD_LIBRARY_PATH": str(directory)}


def run_stub(env: dict[str, str], *args: str, **extra: str) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.run(
        _command(*args),
        cwd=REPO_ROOT,
        env={**env, **extra},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    return proc.returncode, _parse(proc.stdout)


def test_stub_probe(stub_driver: dict[str, str]) -> None:
    status, lines = run_stub(stub_driver, "probe", STUB_CUDA_MEMORY=str(GIB))
    assert status == 0
    assert lines == [
        {
            "ok": True,
            "driver_version": 13000,
            "devices": [
                {
                    "ordinal": 0,
                    "uuid": "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f",
                    "name": "Stub GPU",
                    "multiprocessors": 2,
                    "memory_total": GIB,
                }
            ],
        }
    ]


def test_stub_probe_without_devices_lists_none(stub_driver: dict[str, str]) -> None:
    status, lines = run_stub(stub_driver, "probe", STUB_CUDA_FAIL="cuInit:100")
    assert (status, lines[-1]) == (0, {"ok": True, "driver_version": 13000, "devices": []})


def test_stub_sm_calibrates_then_counts(stub_driver: dict[str, str]) -> None:
    status, lines = run_stub(stub_driver, "sm", "--seconds", "0.6", "--kernel-ms", "4")
    assert status == 0, lines
    assert lines[0]["device_uuid"] == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    result = lines[-1]
    assert result["calibrated"] is True
    assert 5_000 <= result["iterations"] <= 40_000  # 4 ms at 100 ns per iteration, or less
    assert 2 <= result["kernel_ms"] <= 12
    kernel_s = result["iterations"] * 100e-9  # the stub's kernel sleeps at least this long
    assert 0 < result["kernels"] <= 0.6 / kernel_s
    assert len(result["windows"]) == 2 and sum(result["windows"]) > 0

    status, lines = run_stub(
        stub_driver, "sm", "--seconds", "0.3", "--iterations", "1000", "--per-sync", "3"
    )
    assert status == 0, lines
    assert (lines[-1]["iterations"], lines[-1]["calibrated"]) == (1000, False)
    assert lines[-1]["kernels"] % 3 == 0 and lines[-1]["kernels"] > 0


def test_stub_alloc_stops_at_out_of_memory(stub_driver: dict[str, str]) -> None:
    status, lines = run_stub(
        stub_driver,
        "alloc",
        "--bytes",
        "3MiB",
        "--chunk",
        "1MiB",
        STUB_CUDA_MEMORY=str(5 * MIB // 2),
    )
    assert status == 0
    assert [line.get("allocated") for line in lines[1:]] == [MIB, 2 * MIB, 2 * MIB]
    assert lines[-1] == {
        "ok": False,
        "allocated": 2 * MIB,
        "error": "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2)",
        "free": MIB // 2,
        "total": 5 * MIB // 2,
    }


def test_stub_refused_context_exits_3_naming_the_call(stub_driver: dict[str, str]) -> None:
    status, lines = run_stub(
        stub_driver, "sm", "--seconds", "1", STUB_CUDA_FAIL="cuCtxSetCurrent:46"
    )
    assert status == 3
    assert lines == [
        {
            "ok": False,
            "stage": "context",
            "error": "cuCtxSetCurrent: CUDA_ERROR_DEVICES_UNAVAILABLE (46)",
        }
    ]


def test_stub_jit_failure_carries_the_log(stub_driver: dict[str, str]) -> None:
    driver = cuda.CudaDriver(str(Path(stub_driver["LD_LIBRARY_PATH"]) / cuda.LIBRARY))
    with pytest.raises(cuda.CudaError) as error:
        driver.load_module(cuda.SPIN_PTX.replace(cuda.SPIN_KERNEL, "other_kernel"))
    assert str(error.value) == (
        "cuModuleLoadDataEx: CUDA_ERROR_INVALID_PTX (218): stub JIT: no gpuslice_spin"
    )


# -- the PTX --------------------------------------------------------------------------------
def test_ptx_is_well_formed() -> None:
    ptx = cuda.SPIN_PTX
    lines = [line.strip() for line in ptx.splitlines()]
    assert lines[lines.index(".version 7.0") :][:3] == [
        ".version 7.0",
        ".target sm_70",
        ".address_size 64",
    ]
    entry = re.search(r"\.visible \.entry (\w+)\(\s*([^)]*)\)", ptx)
    assert entry is not None and entry.group(1) == cuda.SPIN_KERNEL
    params = [p.strip().split()[1] for p in entry.group(2).split(",")]
    assert params == [".u32", ".u64"]  # iterations, out: what SpinKernel.launch passes
    assert ptx.count("{") == ptx.count("}") == 1
    assert "fma.rn.f32" in ptx and "st.global.f32" in ptx
    for kind, declared in re.findall(r"\.reg \.\w+\s+%(\w+)<(\d+)>", ptx):
        used = {int(n) for n in re.findall(rf"%{kind}(\d+)\b", ptx)}
        assert used and max(used) < int(declared), f"%{kind} registers past <{declared}>"
    labels = set(re.findall(r"^(\$\w+):", ptx, re.MULTILINE))
    assert set(re.findall(r"bra \t?(\$\w+);", ptx)) <= labels


@pytest.mark.parametrize("arch", ["sm_70", "sm_90"])
def test_ptx_assembles(arch: str, tmp_path: Path) -> None:
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas (set PTXAS, e.g. from the nvidia-cuda-nvcc-cu12 wheel)")
    source = tmp_path / "spin.ptx"
    source.write_text(cuda.SPIN_PTX)
    proc = subprocess.run(
        [ptxas, f"-arch={arch}", str(source), "-o", str(tmp_path / "spin.cubin")],
        capture_output=True,
        text=True,
        check=False,
    )
    if "is not defined for option 'gpu-name'" in proc.stderr:
        pytest.skip(f"this ptxas does not target {arch} (CUDA 13 dropped sm_70)")
    assert proc.returncode == 0, proc.stderr


# -- the fake backend -----------------------------------------------------------------------
def test_fake_probe_lists_the_node(node: Path) -> None:
    status, lines = run_workload(*fake(node, "probe"))
    assert status == 0
    result = lines[-1]
    assert result["ok"] is True and result["driver_version"] == 12080
    devices = result["devices"]
    assert [(d["ordinal"], d["name"], d["multiprocessors"]) for d in devices] == [
        (0, "Tesla T4", 40),
        (1, "NVIDIA L4", 58),
    ]
    assert devices[0]["memory_total"] == 15360 * MIB
    assert all(d["uuid"].startswith("GPU-") for d in devices)


def test_fake_sm_reports_kernels_and_windows(node: Path) -> None:
    start_at = time.time() + 0.5
    status, lines = run_workload(
        *fake(node, "sm", "--seconds", "1", "--device", "1", "--start-at", str(start_at))
    )
    assert status == 0
    ready, result = lines[0], lines[-1]
    assert ready["ready"] is True and ready["device_uuid"].startswith("GPU-")
    assert set(result) == {
        "ok",
        "kernels",
        "seconds",
        "rate",
        "iterations",
        "calibrated",
        "kernel_ms",
        "windows",
        "started_at",
    }
    assert result["ok"] is True
    assert result["kernels"] > 0 and result["rate"] > 0
    assert result["seconds"] >= 1
    assert result["started_at"] >= start_at
    assert len(result["windows"]) >= 2 and all(r >= 0 for r in result["windows"])
    assert FakeNvmlControl.from_config_file(node).state().processes == []  # unregistered


def test_fake_alloc_past_the_gpu_is_out_of_memory(node: Path) -> None:
    status, lines = run_workload(*fake(node, "alloc", "--bytes", "16GiB", "--chunk", "4GiB"))
    assert status == 0
    assert [line["allocated"] for line in lines[1:-1]] == [4 * GIB, 8 * GIB, 12 * GIB]
    result = lines[-1]
    assert result["ok"] is False
    assert result["error"].startswith("CUDA_ERROR_OUT_OF_MEMORY (2)")
    assert result["allocated"] == 12 * GIB <= result["total"] == 15360 * MIB


def test_fake_alloc_holds_what_it_allocated(node: Path) -> None:
    proc = subprocess.Popen(
        _command(*fake(node, "alloc", "--bytes", "1GiB", "--chunk", "512MiB", "--hold", "1")),
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = [json.loads(proc.stdout.readline()) for _ in range(3)]
    assert lines[-1] == {"allocated": GIB}
    [held] = FakeNvmlControl.from_config_file(node).processes()
    assert (held.pid, held.used_memory_bytes) == (proc.pid, GIB)
    result = json.loads(proc.stdout.read().strip())
    assert proc.wait(timeout=10) == 0
    assert result == {
        "ok": True,
        "allocated": GIB,
        "error": None,
        "free": 15360 * MIB - GIB,
        "total": 15360 * MIB,
    }


def test_wait_touches_nothing_before_its_line(node: Path) -> None:
    proc = subprocess.Popen(
        _command(*fake(node, "alloc", "--bytes", "1MiB", "--wait")),
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == {"waiting": True, "pid": proc.pid}
    time.sleep(0.3)
    assert proc.poll() is None
    assert FakeNvmlControl.from_config_file(node).processes() == []
    out, _ = proc.communicate("go\n", timeout=15)
    assert proc.returncode == 0
    lines = _parse(out)
    assert lines[0]["ready"] is True and lines[-1]["ok"] is True


def test_fake_context_failure_exits_3(node: Path) -> None:
    status, lines = run_workload(*fake(node, "alloc", "--bytes", "1MiB", "--device", "7"))
    assert status == 3
    assert lines[-1]["stage"] == "context"


# -- a real GPU -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_real_gpu_probe_sm_alloc() -> None:
    try:
        driver = cuda.CudaDriver()
        driver.init()
    except (cuda.CudaLibraryError, cuda.CudaError) as exc:
        pytest.skip(f"no NVIDIA GPU/driver: {exc}")
    status, lines = run_workload("probe", timeout=60)
    assert status == 0, lines
    devices = lines[-1]["devices"]
    assert devices and devices[0]["uuid"].startswith("GPU-")
    assert devices[0]["multiprocessors"] > 0 and devices[0]["memory_total"] > 0

    status, lines = run_workload("sm", "--seconds", "1", "--kernel-ms", "5", timeout=60)
    assert status == 0, lines
    assert lines[0]["device_uuid"] == devices[0]["uuid"]
    calibrated = lines[-1]
    assert calibrated["calibrated"] is True and calibrated["kernels"] > 0
    assert 1 < calibrated["kernel_ms"] < 25, calibrated

    iterations = str(calibrated["iterations"])
    status, lines = run_workload(
        "sm", "--seconds", "1", "--iterations", iterations, "--per-sync", "4", timeout=60
    )
    assert status == 0, lines
    fixed = lines[-1]
    assert fixed["iterations"] == calibrated["iterations"] and fixed["calibrated"] is False
    assert fixed["rate"] == pytest.approx(calibrated["rate"], rel=0.5)

    status, lines = run_workload("alloc", "--bytes", "512MiB", "--chunk", "128MiB", timeout=60)
    assert status == 0, lines
    result = lines[-1]
    assert result["ok"] is True and result["allocated"] == 512 * MIB and result["error"] is None
    assert 0 <= result["free"] <= result["total"]
