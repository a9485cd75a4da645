"""The GPU stage's workload: a CUDA program that needs nothing but the NVIDIA driver.

    python -m e2e.gpustage.workload probe
    python -m e2e.gpustage.workload sm --seconds 5 [--start-at EPOCH] [--kernel-ms 20]
                                       [--per-sync 1] [--iterations I]
    python -m e2e.gpustage.workload alloc --bytes 4GiB [--chunk 256MiB] [--hold 2]

Common options: ``--device N`` (CUDA ordinal; the GPU index on the fake backend), ``--wait``
(read one line from stdin before touching CUDA: the runner first moves the process into its
cgroups and tells the enforcer, as a container's createContainer hook does), ``--backend
cuda|fake`` and ``--fake-nvml-config PATH``. Options come after the command. There are no
environment variables: the runner passes everything, and the environment is the CUDA
driver's (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_VISIBLE_DEVICES``).

Every line on stdout is one JSON object, flushed; the last one is the result:

* with ``--wait``, first ``{"waiting": true, "pid": …}``;
* ``sm`` and ``alloc``: ``{"ready": true, "pid": …, "device_uuid": "GPU-…"}`` once the context
  exists, before the work; ``alloc`` then ``{"allocated": bytes}`` after each chunk;
* the result, ``{"ok": …, …}`` (shapes in the command docstrings below).

Exit status: 0 when the command ran to its result (an ``alloc`` that stopped at
``CUDA_ERROR_OUT_OF_MEMORY`` included: that is what the memory-limit check wants to see), 1
when a CUDA call failed during the work (``"stage": "work"``), 2 for bad arguments (``"stage":
"arguments"``, the message names the option), 3 when CUDA cannot be initialised or the context
cannot be made (``"stage": "context"``: no driver, no device, or a GPU in EXCLUSIVE_PROCESS
mode held by an MPS server refusing a process that is not its client).

The fake backend runs the same commands on gpuslice's fake NVML node, so the stage runs in CI:
the process registers itself as a real process of the fake GPU, ``sm`` spins at ``SCHED_IDLE``
and reports the fake's runnable-time accounting (one "kernel" = 10 ms of the whole GPU), and
``alloc`` allocates through ``FakeNvmlControl.allocate_memory``. Only that backend imports
gpuslice packages; the CUDA one is stdlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn, Protocol

from e2e.gpustage.cuda import (
    MAX_ITERATIONS,
    MULTIPROCESSOR_COUNT,
    CudaDriver,
    CudaError,
    CudaLibraryError,
    Device,
    DevicePtr,
    SpinKernel,
)

if TYPE_CHECKING:
    from gpuslice_nvml.fake import FakeNvmlControl

EXIT_OK = 0
EXIT_WORK_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_CONTEXT = 3

#: Width of the windows ``sm`` reports its rate in.
WINDOW_S = 0.5
#: The fake's "kernel": 10 ms of the whole GPU.
FAKE_KERNEL_S = 0.01
#: What the fake reports as ``iterations`` when none is given (it runs no kernel).
FAKE_ITERATIONS = 1
#: CUDA's ``CUDA_ERROR_NO_DEVICE``: ``probe`` reports it as an empty device list.
_NO_DEVICE = 100

Result = dict[str, object]


def emit(obj: Mapping[str, object]) -> None:
    print(json.dumps(obj), flush=True)


# -- arguments ----------------------------------------------------------------------------
_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB|TiB)?")


def parse_bytes(text: str) -> int:
    """``4GiB``, ``512MiB``, ``1.5GiB`` or a plain integer; more than 0."""
    match = _BYTES.fullmatch(text.strip())
    if match is None or (not match.group(2) and "." in match.group(1)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte count (an integer, or a number with KiB, MiB, GiB or TiB)"
        )
    value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 bytes")
    return value


def _in_range(
    kind: type[int] | type[float], low: float, high: float = math.inf, *, above: bool = False
) -> Callable[[str], float]:
    """An argparse type: an int or float at least ``low`` (more than it, with ``above``)."""
    what = "an integer" if kind is int else "a number"
    bound = f"more than {low:g}" if above else f"at least {low:g}"
    if high < math.inf:
        bound += f" and at most {high:.0f}" if kind is int else f" and at most {high:g}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if not ((value > low if above else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {bound}")
        return value

    return parse


_positive = _in_range(float, 0, above=True)
_seconds = _in_range(float, 0)


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors are also the JSON result the runner reads."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        emit({"ok": False, "stage": "arguments", "error": message})
        sys.exit(EXIT_USAGE)


def build_parser() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--device",
        type=_in_range(int, 0, 1 << 16),
        default=0,
        help="The CUDA device ordinal to use (default 0).",
    )
    common.add_argument(
        "--wait",
        action="store_true",
        help="Read one line from stdin before touching CUDA (the runner's go-ahead).",
    )
    common.add_argument(
        "--backend",
        choices=("cuda", "fake"),
        default="cuda",
        help="Run on the GPU through libcuda.so.1, or on a fake NVML node.",
    )
    common.add_argument(
        "--fake-nvml-config",
        type=Path,
        help="The fake node's YAML config; required with --backend fake.",
    )
    parser = _Parser(
        prog="python -m e2e.gpustage.workload",
        description="A CUDA workload for the GPU stage (see the module docstring).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "probe", parents=[common], help="Print the driver version and the GPUs this process sees."
    )
    sm = commands.add_parser("sm", parents=[common], help="Keep the SMs busy and count kernels.")
    sm.add_argument("--seconds", type=_positive, required=True, help="How long to launch kernels.")
    sm.add_argument(
        "--start-at",
        type=_in_range(float, 0, 1e11),
        help="Start launching at this time (seconds since the epoch), so processes start together.",
    )
    sm.add_argument(
        "--kernel-ms",
        type=_positive,
        default=20.0,
        help="Calibrate one kernel to take about this many milliseconds (default 20).",
    )
    sm.add_argument(
        "--iterations",
        type=_in_range(int, 1, MAX_ITERATIONS),
        help="Use this kernel size instead of calibrating (the result's iterations of a run).",
    )
    sm.add_argument(
        "--per-sync",
        type=_in_range(int, 1, 1 << 20),
        default=1,
        help="Synchronise after this many kernels.",
    )
    alloc = commands.add_parser("alloc", parents=[common], help="Allocate and touch device memory.")
    alloc.add_argument(
        "--bytes", type=parse_bytes, required=True, help="How much to allocate (4GiB, 512MiB)."
    )
    alloc.add_argument(
        "--chunk", type=parse_bytes, default=256 << 20, help="Allocation size (default 256MiB)."
    )
    alloc.add_argument(
        "--hold", type=_seconds, default=0.0, help="Seconds to hold the memory before the result."
    )
    return parser


@dataclass(frozen=True)
class SmOptions:
    seconds: float
    start_at: float | None
    kernel_ms: float
    iterations: int | None
    per_sync: int


@dataclass(frozen=True)
class AllocOptions:
    total: int
    chunk: int
    hold: float


class ContextError(Exception):
    """CUDA cannot be initialised, or this process cannot have a context on the device."""


class Workload(Protocol):
    """One process on one GPU, its context made."""

    device_uuid: str

    def sm(self, options: SmOptions) -> Result: ...

    def alloc(self, options: AllocOptions) -> Result: ...


# -- the CUDA backend -----------------------------------------------------------------------
def _driver() -> CudaDriver:
    try:
        cuda = CudaDriver()
        cuda.init()
    except (CudaLibraryError, CudaError) as exc:
        raise ContextError(str(exc)) from exc
    return cuda


def cuda_probe() -> Result:
    """``{"ok": true, "driver_version": 13000, "devices": [{"ordinal", "uuid", "name",
    "multiprocessors", "memory_total"}]}``: the GPUs this process can see, no context made."""
    try:
        cuda = CudaDriver()
    except CudaLibraryError as exc:
        raise ContextError(str(exc)) from exc
    version = cuda.driver_version()
    try:
        cuda.init()
    except CudaError as exc:
        if exc.code != _NO_DEVICE:
            raise ContextError(str(exc)) from exc
        return {"ok": True, "driver_version": version, "devices": []}
    devices: list[Result] = []
    for ordinal in range(cuda.device_count()):
        device = cuda.device(ordinal)
        devices.append(
            {
                "ordinal": ordinal,
                "uuid": cuda.device_uuid(device),
                "name": cuda.device_name(device),
                "multiprocessors": cuda.attribute(device, MULTIPROCESSOR_COUNT),
                "memory_total": cuda.total_memory(device),
            }
        )
    return {"ok": True, "driver_version": version, "devices": devices}


class CudaWorkload:
    def __init__(self, ordinal: int) -> None:
        cuda = _driver()
        try:
            self.device: Device = cuda.device(ordinal)
            self.device_uuid = cuda.device_uuid(self.device)
            cuda.use_primary_context(self.device)
        except (CudaLibraryError, CudaError) as exc:
            raise ContextError(str(exc)) from exc
        self.cuda = cuda

    def sm(self, options: SmOptions) -> Result:
        kernel = SpinKernel(self.cuda, self.device)
        kernel.launch(1)  # the first launch pays for lazy loading
        self.cuda.synchronize()
        iterations = options.iterations or self._calibrate(kernel, options.kernel_ms)
        _wait_until(options.start_at)
        started_at = time.time()
        start = time.perf_counter()
        counts = _Windows(options.seconds)
        kernels, last = 0, start
        while True:
            for _ in range(options.per_sync):
                kernel.launch(iterations)
            self.cuda.synchronize()
            now = time.perf_counter()
            if now - start > options.seconds:
                break  # only kernels whose sync completed inside the window count
            kernels += options.per_sync
            counts.add(now - start, options.per_sync)
            last = now
        return _sm_result(
            kernels=kernels,
            seconds=options.seconds,
            iterations=iterations,
            calibrated=options.iterations is None,
            kernel_ms=(last - start) * 1000 / kernels if kernels else None,
            windows=counts.rates(),
            started_at=started_at,
        )

    def _calibrate(self, kernel: SpinKernel, target_ms: float) -> int:
        """Kernel size for about ``target_ms`` as this process gets the GPU now: grow until a
        kernel takes a quarter of the target, then scale linearly twice."""
        iterations = 256
        elapsed = self._time_kernel(kernel, iterations)
        while elapsed < target_ms / 4 and iterations < MAX_ITERATIONS:
            iterations = min(MAX_ITERATIONS, iterations * 4)
            elapsed = self._time_kernel(kernel, iterations)
        for _ in range(2):
            iterations = max(1, min(MAX_ITERATIONS, round(iterations * target_ms / elapsed)))
            elapsed = self._time_kernel(kernel, iterations)
        return iterations

    def _time_kernel(self, kernel: SpinKernel, iterations: int) -> float:
        start = time.perf_counter()
        kernel.launch(iterations)
        self.cuda.synchronize()
        return max((time.perf_counter() - start) * 1000, 1e-3)

    def alloc(self, options: AllocOptions) -> Result:
        held: list[DevicePtr] = []
        allocated, error = 0, None
        while allocated < options.total:
            size = min(options.chunk, options.total - allocated)
            try:
                held.append(self.cuda.mem_alloc(size))
                self.cuda.memset(held[-1], 0xA5, size)  # commit the pages
                self.cuda.synchronize()
            except CudaError as exc:
                error = str(exc)
                break
            allocated += size
            emit({"allocated": allocated})
        time.sleep(options.hold)
        free, total = self.cuda.mem_info()
        return _alloc_result(options, allocated, error, free, total)


# -- the fake backend -----------------------------------------------------------------------
def fake_probe(config: Path) -> Result:
    """The same shape as :func:`cuda_probe`, listing the fake node's GPUs."""
    from gpuslice_nvml.errors import NvmlError
    from gpuslice_nvml.fake import FakeConfigError, FakeNvml

    try:
        nvml = FakeNvml.from_config_file(config)
        devices: list[Result] = [
            {
                "ordinal": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "multiprocessors": gpu.multiprocessors,
                "memory_total": gpu.memory_total_bytes,
            }
            for gpu in nvml.gpus()
        ]
        version = nvml.system_info().cuda_driver_version
    except (FakeConfigError, NvmlError, OSError) as exc:
        raise ContextError(f"fake NVML node {config}: {exc}") from exc
    return {"ok": True, "driver_version": version, "devices": devices}


def _register(
    control: FakeNvmlControl,
    device: int,
    *,
    sm_percent: int,
    accounting: str,
    mps_pipe_dir: str | None,
) -> None:
    """Register this process on the fake GPU, as making a CUDA context does on a real one: an
    MPS client where a daemon serving the GPU answers at ``mps_pipe_dir``, else a context of
    its own, which the GPU's compute mode may refuse (``NvmlInUse``)."""
    control.add_process(
        os.getpid(),
        device,
        used_memory_bytes=0,
        sm_percent=sm_percent,
        real=True,
        accounting=accounting,
        mps_pipe_dir=mps_pipe_dir,
    )


class FakeWorkload:
    def __init__(self, config: Path, device: int, command: str) -> None:
        from gpuslice_nvml.errors import NvmlError
        from gpuslice_nvml.fake import FakeConfigError, FakeNvml, FakeNvmlControl

        self.device = device
        self.pid = os.getpid()
        try:
            self.nvml = FakeNvml.from_config_file(config)
            self.control = FakeNvmlControl.from_config_file(config)
            self.device_uuid = self.nvml.gpu(device).uuid
            _register(
                self.control,
                device,
                sm_percent=100 if command == "sm" else 0,
                accounting="runnable" if command == "sm" else "constant",
                mps_pipe_dir=os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
            )
        except (FakeConfigError, NvmlError, OSError) as exc:
            raise ContextError(f"fake NVML node {config}: {exc}") from exc

    def close(self) -> None:
        self.control.remove_process(self.pid)

    def _busy(self) -> float:
        return self.control.sm_accounting(self.pid).busy_seconds

    def sm(self, options: SmOptions) -> Result:
        """Spin (runnable whenever not frozen) and read the fake's accounting every window."""
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        _wait_until(options.start_at)
        started_at = time.time()
        start = time.monotonic()
        first = previous = self._busy()
        window_start, rates = start, []
        now = start
        while now - start < options.seconds:
            now = time.monotonic()
            if now - window_start >= WINDOW_S or now - start >= options.seconds:
                busy = self._busy()
                rates.append((busy - previous) / FAKE_KERNEL_S / (now - window_start))
                previous, window_start = busy, now
        elapsed = now - start
        kernels = int((previous - first) / FAKE_KERNEL_S)
        return _sm_result(
            kernels=kernels,
            seconds=elapsed,
            iterations=options.iterations or FAKE_ITERATIONS,
            calibrated=options.iterations is None,
            kernel_ms=elapsed * 1000 / kernels if kernels else None,
            windows=rates,
            started_at=started_at,
        )

    def alloc(self, options: AllocOptions) -> Result:
        from gpuslice_nvml.errors import NvmlError, NvmlInsufficientMemory

        allocated, error = 0, None
        while allocated < options.total:
            size = min(options.chunk, options.total - allocated)
            try:
                self.control.allocate_memory(self.pid, self.device, size)
            except NvmlInsufficientMemory as exc:
                error = f"CUDA_ERROR_OUT_OF_MEMORY (2): {exc}"
                break
            except NvmlError as exc:
                error = str(exc)
                break
            allocated += size
            emit({"allocated": allocated})
        time.sleep(options.hold)
        info = self.nvml.memory_info(self.device)
        return _alloc_result(options, allocated, error, info.free, info.total)


# -- results --------------------------------------------------------------------------------
class _Windows:
    """Kernels completed per :data:`WINDOW_S` window of the run, as rates."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.counts = [0] * max(1, math.ceil(seconds / WINDOW_S))

    def add(self, at: float, kernels: int) -> None:
        self.counts[min(int(at / WINDOW_S), len(self.counts) - 1)] += kernels

    def rates(self) -> list[float]:
        widths = [WINDOW_S] * len(self.counts)
        widths[-1] = self.seconds - WINDOW_S * (len(self.counts) - 1)
        return [count / width for count, width in zip(self.counts, widths, strict=True)]


def _sm_result(
    *,
    kernels: int,
    seconds: float,
    iterations: int,
    calibrated: bool,
    kernel_ms: float | None,
    windows: list[float],
    started_at: float,
) -> Result:
    """``{"ok": true, "kernels", "seconds", "rate", "iterations", "calibrated", "kernel_ms",
    "windows": [rate per 0.5 s window], "started_at": epoch seconds}``."""
    return {
        "ok": True,
        "kernels": kernels,
        "seconds": round(seconds, 6),
        "rate": kernels / seconds,
        "iterations": iterations,
        "calibrated": calibrated,
        "kernel_ms": kernel_ms,
        "windows": [round(r, 3) for r in windows],
        "started_at": started_at,
    }


def _alloc_result(
    options: AllocOptions, allocated: int, error: str | None, free: int, total: int
) -> Result:
    """``{"ok": reached --bytes, "allocated", "error": text or null, "free", "total"}``."""
    return {
        "ok": allocated >= options.total,
        "allocated": allocated,
        "error": error,
        "free": free,
        "total": total,
    }


def _wait_until(epoch: float | None) -> None:
    if epoch is not None:
        time.sleep(max(0.0, epoch - time.time()))


# -- main -----------------------------------------------------------------------------------
@contextlib.contextmanager
def open_workload(args: argparse.Namespace) -> Iterator[Workload]:
    """The context on ``--device``; :class:`ContextError` where there can be none."""
    if args.backend == "cuda":
        yield CudaWorkload(args.device)  # the process's exit releases the context
        return
    fake = FakeWorkload(args.fake_nvml_config, args.device, args.command)
    try:
        yield fake
    finally:
        fake.close()


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds, so the fake backend unregisters


def run(args: argparse.Namespace) -> tuple[int, Result]:
    if args.wait:
        emit({"waiting": True, "pid": os.getpid()})
        sys.stdin.readline()
    try:
        if args.command == "probe":
            if args.backend == "cuda":
                return EXIT_OK, cuda_probe()
            return EXIT_OK, fake_probe(args.fake_nvml_config)
        with open_workload(args) as workload:
            emit({"ready": True, "pid": os.getpid(), "device_uuid": workload.device_uuid})
            if args.command == "sm":
                options = SmOptions(
                    args.seconds, args.start_at, args.kernel_ms, args.iterations, args.per_sync
                )
                return EXIT_OK, workload.sm(options)
            return EXIT_OK, workload.alloc(AllocOptions(args.bytes, args.chunk, args.hold))
    except ContextError as exc:
        return EXIT_NO_CONTEXT, {"ok": False, "stage": "context", "error": str(exc)}
    except CudaError as exc:
        return EXIT_WORK_FAILED, {"ok": False, "stage": "work", "error": str(exc)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend == "fake" and args.fake_nvml_config is None:
        parser.error("argument --fake-nvml-config: required with --backend fake")
    signal.signal(signal.SIGTERM, _terminate)
    status, result = run(args)
    emit(result)
    return status


if __name__ == "__main__":
    sys.exit(main())
