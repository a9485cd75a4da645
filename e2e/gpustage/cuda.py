"""A small typed binding of the CUDA driver API (``libcuda.so.1``) through ctypes.

The GPU stage's workload needs nothing but the NVIDIA driver: no CUDA toolkit, no torch, no
numpy. Its kernel is PTX text (:data:`SPIN_PTX`) that the driver JIT-compiles for whatever GPU
it finds (Volta and newer), and this module binds only the calls the workload makes.

Contexts are made the way runtime-API programs make them: ``cuDevicePrimaryCtxRetain`` then
``cuCtxSetCurrent``. That is also the moment a process becomes an MPS client, when
``CUDA_MPS_PIPE_DIRECTORY`` names the pipe directory of a running MPS control daemon; a GPU in
EXCLUSIVE_PROCESS compute mode held by an MPS server refuses a process that is not one there.

Every call that returns a ``CUresult`` other than ``CUDA_SUCCESS`` raises :class:`CudaError`,
whose text names the call and the error (``cuCtxSetCurrent: CUDA_ERROR_DEVICES_UNAVAILABLE
(46)``). A machine without the driver raises :class:`CudaLibraryError` naming the library.

The PTX was checked with ptxas V12.9.86 (the ``nvidia-cuda-nvcc-cu12`` wheel) for sm_70, sm_80
and sm_90, and with ptxas V13.0.88 (``nvidia-cuda-nvcc``, the toolkit of driver 580) for sm_75,
sm_90 and sm_100: it assembles with 8 registers and no spills. CUDA 13's ptxas no longer
targets sm_70, which is why the older one checks the floor.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any, NewType

LIBRARY = "libcuda.so.1"

#: ``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT``.
MULTIPROCESSOR_COUNT = 16

#: ``CUjit_option`` values for the JIT error log of ``cuModuleLoadDataEx``.
_JIT_ERROR_LOG_BUFFER = 5
_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6
_JIT_LOG_SIZE = 4096

#: A ``CUdevice``: the handle ``cuDeviceGet`` returns for an ordinal.
Device = NewType("Device", int)
#: A ``CUcontext``, ``CUmodule``, ``CUfunction``: opaque pointers.
Context = NewType("Context", int)
Module = NewType("Module", int)
Function = NewType("Function", int)
#: A ``CUdeviceptr``: a device address.
DevicePtr = NewType("DevicePtr", int)

#: Names of the ``CUresult`` codes the stage may meet, for when ``cuGetErrorName`` itself fails.
ERROR_NAMES: dict[int, str] = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    36: "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
    46: "CUDA_ERROR_DEVICES_UNAVAILABLE",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    200: "CUDA_ERROR_INVALID_IMAGE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
    216: "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
    218: "CUDA_ERROR_INVALID_PTX",
    221: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
    222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE",
    500: "CUDA_ERROR_NOT_FOUND",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    702: "CUDA_ERROR_LAUNCH_TIMEOUT",
    719: "CUDA_ERROR_LAUNCH_FAILED",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    802: "CUDA_ERROR_SYSTEM_NOT_READY",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
    805: "CUDA_ERROR_MPS_CONNECTION_FAILED",
    806: "CUDA_ERROR_MPS_RPC_FAILURE",
    807: "CUDA_ERROR_MPS_SERVER_NOT_READY",
    808: "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
    809: "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
    810: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    999: "CUDA_ERROR_UNKNOWN",
}

OUT_OF_MEMORY = 2

_P = ctypes.POINTER
_size_t = ctypes.c_size_t
#: argtypes of every call bound; the restype is always ``CUresult`` (int).
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (ctypes.c_uint,),
    "cuDriverGetVersion": (_P(ctypes.c_int),),
    "cuDeviceGetCount": (_P(ctypes.c_int),),
    "cuDeviceGet": (_P(ctypes.c_int), ctypes.c_int),
    "cuDeviceGetName": (ctypes.c_char_p, ctypes.c_int, ctypes.c_int),
    "cuDeviceGetUuid_v2": (ctypes.c_void_p, ctypes.c_int),
    "cuDeviceGetUuid": (ctypes.c_void_p, ctypes.c_int),
    "cuDeviceGetAttribute": (_P(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuDeviceTotalMem_v2": (_P(_size_t), ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (_P(ctypes.c_void_p), ctypes.c_int),
    "cuCtxSetCurrent": (ctypes.c_void_p,),
    "cuCtxSynchronize": (),
    "cuModuleLoadDataEx": (
        _P(ctypes.c_void_p),
        ctypes.c_char_p,
        ctypes.c_uint,
        _P(ctypes.c_int),
        _P(ctypes.c_void_p),
    ),
    "cuModuleGetFunction": (_P(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p),
    "cuLaunchKernel": (
        ctypes.c_void_p,
        *(ctypes.c_uint,) * 6,
        ctypes.c_uint,
        ctypes.c_void_p,
        _P(ctypes.c_void_p),
        _P(ctypes.c_void_p),
    ),
    "cuMemAlloc_v2": (_P(ctypes.c_uint64), _size_t),
    "cuMemFree_v2": (ctypes.c_uint64,),
    "cuMemGetInfo_v2": (_P(_size_t), _P(_size_t)),
    "cuMemsetD8_v2": (ctypes.c_uint64, ctypes.c_ubyte, _size_t),
    "cuGetErrorName": (ctypes.c_int, _P(ctypes.c_char_p)),
}
#: Calls a driver may lack: the UUID has a fallback, the error name a table.
_UUID_CALLS = ("cuDeviceGetUuid_v2", "cuDeviceGetUuid")
_OPTIONAL = {*_UUID_CALLS, "cuGetErrorName"}


class CudaError(Exception):
    """A driver call returned an error ``CUresult``."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call = call
        self.code = code
        self.name = name
        self.detail = detail
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.call}: {self.name} ({self.code})"
        return f"{text}: {self.detail}" if self.detail else text


class CudaLibraryError(Exception):
    """The driver library cannot be loaded, or lacks a call the workload needs."""


class CudaDriver:
    """``libcuda.so.1``, loaded and typed. Methods raise :class:`CudaError` on failure."""

    def __init__(self, library: str | None = None) -> None:
        library = library or LIBRARY
        try:
            lib = ctypes.CDLL(library)
        except OSError as exc:
            raise CudaLibraryError(
                f"{library} could not be loaded ({exc}): the NVIDIA driver is not installed "
                "here, or not mounted into this container"
            ) from exc
        self._fns: dict[str, Callable[..., int]] = {}
        for name, argtypes in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                if name in _OPTIONAL:
                    continue
                raise CudaLibraryError(
                    f"{library} has no {name}: the NVIDIA driver is too old for the GPU stage"
                ) from None
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            self._fns[name] = fn

    def _call(self, name: str, *args: Any) -> None:
        code = int(self._fns[name](*args))
        if code != 0:
            raise CudaError(name, code, self.error_name(code))

    def error_name(self, code: int) -> str:
        """``cuGetErrorName``, or the table where the driver cannot say."""
        fn = self._fns.get("cuGetErrorName")
        text = ctypes.c_char_p()
        if fn is not None and fn(code, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode(errors="replace")
        return ERROR_NAMES.get(code, "CUDA_ERROR_UNRECOGNIZED")

    # -- driver and devices ---------------------------------------------------------------
    def init(self) -> None:
        self._call("cuInit", 0)

    def driver_version(self) -> int:
        """The CUDA version the driver supports, encoded as 1000·major + 10·minor (13000)."""
        value = ctypes.c_int()
        self._call("cuDriverGetVersion", ctypes.byref(value))
        return value.value

    def device_count(self) -> int:
        value = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(value))
        return value.value

    def device(self, ordinal: int) -> Device:
        value = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(value), ordinal)
        return Device(value.value)

    def device_name(self, device: Device) -> str:
        buf = ctypes.create_string_buffer(256)
        self._call("cuDeviceGetName", buf, len(buf), device)
        return buf.value.decode(errors="replace")

    def device_uuid(self, device: Device) -> str:
        """The UUID formatted as NVML does: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
        raw = ctypes.create_string_buffer(16)
        name = next((n for n in _UUID_CALLS if n in self._fns), None)
        if name is None:
            raise CudaLibraryError(f"{LIBRARY} has neither {' nor '.join(_UUID_CALLS)}")
        self._call(name, raw, device)
        return format_uuid(raw.raw)

    def attribute(self, device: Device, attribute: int) -> int:
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), attribute, device)
        return value.value

    def total_memory(self, device: Device) -> int:
        value = _size_t()
        self._call("cuDeviceTotalMem_v2", ctypes.byref(value), device)
        return value.value

    # -- context --------------------------------------------------------------------------
    def use_primary_context(self, device: Device) -> Context:
        """Retain the device's primary context and make it current, as the runtime API does."""
        handle = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(handle), device)
        self._call("cuCtxSetCurrent", handle)
        return Context(handle.value or 0)

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize")

    # -- modules and kernels --------------------------------------------------------------
    def load_module(self, ptx: str) -> Module:
        """JIT-compile PTX text for the current context's GPU (``cuModuleLoadDataEx``, which is
        ``cuModuleLoadData`` plus the JIT's error log, added to the error's text)."""
        handle = ctypes.c_void_p()
        log = ctypes.create_string_buffer(_JIT_LOG_SIZE)
        options = (ctypes.c_int * 2)(_JIT_ERROR_LOG_BUFFER, _JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        values = (ctypes.c_void_p * 2)(ctypes.addressof(log), _JIT_LOG_SIZE)
        image = ptx.encode() + b"\0"
        try:
            self._call("cuModuleLoadDataEx", ctypes.byref(handle), image, 2, options, values)
        except CudaError as exc:
            exc.detail = log.value.decode(errors="replace").strip()
            raise
        return Module(handle.value or 0)

    def function(self, module: Module, name: str) -> Function:
        handle = ctypes.c_void_p()
        self._call("cuModuleGetFunction", ctypes.byref(handle), module, name.encode())
        return Function(handle.value or 0)

    def launch(
        self,
        function: Function,
        grid: int,
        block: int,
        params: Sequence[ctypes.c_uint32 | ctypes.c_uint64],
    ) -> None:
        """Launch a 1-D grid on the default stream; ``params`` in the kernel's order."""
        pointers = (ctypes.c_void_p * len(params))(*(ctypes.addressof(p) for p in params))
        self._call("cuLaunchKernel", function, grid, 1, 1, block, 1, 1, 0, None, pointers, None)

    # -- memory ---------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> DevicePtr:
        value = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(value), nbytes)
        return DevicePtr(value.value)

    def mem_free(self, ptr: DevicePtr) -> None:
        self._call("cuMemFree_v2", ptr)

    def memset(self, ptr: DevicePtr, value: int, nbytes: int) -> None:
        self._call("cuMemsetD8_v2", ptr, value, nbytes)

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` as CUDA reports them to this process (an MPS client sees its
        pinned memory limit as the total)."""
        free, total = _size_t(), _size_t()
        self._call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


def format_uuid(raw: bytes) -> str:
    """16 UUID bytes as NVML prints a GPU's UUID."""
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# -- the spin kernel --------------------------------------------------------------------------
SPIN_KERNEL = "gpuslice_spin"
#: Each thread runs a chain of dependent f32 FMAs (4 per iteration, so the loop's own
#: instructions stay a minority) and stores its result, so nothing is optimised away. The
#: chain's latency is hidden by the other resident warps: the kernel is bound by FMA issue,
#: so its duration is proportional to the SMs the process gets.
SPIN_PTX = f"""\
//
// gpuslice GPU stage: {SPIN_KERNEL}(u32 iterations, u64 out)
//
.version 7.0
.target sm_70
.address_size 64

.visible .entry {SPIN_KERNEL}(
\t.param .u32 {SPIN_KERNEL}_iterations,
\t.param .u64 {SPIN_KERNEL}_out
)
{{
\t.reg .pred \t%p<2>;
\t.reg .b32 \t%r<7>;
\t.reg .f32 \t%f<4>;
\t.reg .b64 \t%rd<5>;

\tld.param.u32 \t%r1, [{SPIN_KERNEL}_iterations];
\tld.param.u64 \t%rd1, [{SPIN_KERNEL}_out];
\tmov.u32 \t%r2, %ctaid.x;
\tmov.u32 \t%r3, %ntid.x;
\tmov.u32 \t%r4, %tid.x;
\tmad.lo.s32 \t%r5, %r2, %r3, %r4;
\tcvt.rn.f32.u32 \t%f1, %r5;
\tmov.f32 \t%f2, 0f3F7FF972;
\tmov.f32 \t%f3, 0f3C23D70A;
\tmov.u32 \t%r6, 0;
\tsetp.eq.u32 \t%p1, %r1, 0;
\t@%p1 bra \t$L_done;
$L_loop:
\tfma.rn.f32 \t%f1, %f1, %f2, %f3;
\tfma.rn.f32 \t%f1, %f1, %f2, %f3;
\tfma.rn.f32 \t%f1, %f1, %f2, %f3;
\tfma.rn.f32 \t%f1, %f1, %f2, %f3;
\tadd.u32 \t%r6, %r6, 1;
\tsetp.lt.u32 \t%p1, %r6, %r1;
\t@%p1 bra \t$L_loop;
$L_done:
\tcvta.to.global.u64 \t%rd2, %rd1;
\tmul.wide.u32 \t%rd3, %r5, 4;
\tadd.s64 \t%rd4, %rd2, %rd3;
\tst.global.f32 \t[%rd4], %f1;
\tret;
}}
"""
#: The spin kernel's grid: the same work per kernel whatever share of the SMs a context gets.
GRID_BLOCKS = 1024
THREADS_PER_BLOCK = 256
MAX_ITERATIONS = 2**32 - 1


class SpinKernel:
    """The spin kernel loaded into the current context, with the buffer it writes.

    The grid is a fixed :data:`GRID_BLOCKS` blocks of 256 threads, not sized from the SM count
    the context reports: under MPS that count is the client's share of the SMs (40 of 132 at
    30 % on an H100), and a grid sized from it does less work per kernel, so every share ran at
    "100 %" on the first GPU run. 1,024 blocks fill an H100 in one wave (8 resident per SM)
    and keep every SM's FMA pipes busy on any GPU the stage targets.
    """

    def __init__(self, cuda: CudaDriver, device: Device) -> None:
        self._cuda = cuda
        self.grid = GRID_BLOCKS
        self.block = THREADS_PER_BLOCK
        self._function = cuda.function(cuda.load_module(SPIN_PTX), SPIN_KERNEL)
        self._out = cuda.mem_alloc(self.grid * self.block * 4)

    def launch(self, iterations: int) -> None:
        """Queue one kernel (returns before it runs; :meth:`CudaDriver.synchronize` waits)."""
        params: list[ctypes.c_uint32 | ctypes.c_uint64] = [
            ctypes.c_uint32(iterations),
            ctypes.c_uint64(self._out),
        ]
        self._cuda.launch(self._function, self.grid, self.block, params)
