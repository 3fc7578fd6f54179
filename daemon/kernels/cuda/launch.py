"""Kernel launches without numba's dispatcher: launch(kernel, grid, block, stream, *args).

`kernel[grid, block, stream](*args)` costs tens to hundreds of microseconds of host time: the
dispatcher types every argument, wraps every device array in a cuda.core StridedMemoryView and
builds a LaunchConfig, at every launch. Eager steps (prefill, and any step that reads routing back
to the host) launch ~17 kernels a layer, so that cost, not the GPU, set their pace.

Here each (kernel, argument signature) is resolved once: the dispatcher compiles (or finds) the
overload, and we keep its kernel handle and the layout of its parameters as numba's kernel ABI
lays them out (as `_Kernel._prepare_args` does: an array is meminfo, parent, size, itemsize, data
pointer, shape..., strides..., 8 bytes each; scalars as the C type the kernel was compiled for):
a `struct.Struct`, a buffer it packs into and the array of pointers into that buffer that
cuLaunchKernel takes (the driver copies the values at the call, so the buffer is reused). A launch
is then one `pack_into` of the flattened arguments and one cuLaunchKernel; a tiled prefill matmul
has ~100 parameters, which cuda.core's `launch` converted one by one at every launch. The same
kernel runs on the same bytes, so results are the same bits; a capture sees an ordinary
cuLaunchKernel on the capturing stream. A failed launch raises numba's CudaAPIError (the backend
turns it into a DeviceError).

Resolving compiles, and compiling a prefill's kernels takes seconds, so what it yields (the cubin
and its entry name) is also kept on disk (kernel_cache.py): a new process loads the cubin with
cuda.core instead. The argument converters follow from the argument types alone. `COUNTS` says
how many overloads were compiled and how many loaded.

Under the simulator (no GPU), with stream 0, and while `FAST` is off (benchmarks compare the two)
this is the dispatcher launch itself, and nothing is cached.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import struct
import threading
import time

from . import kernel_cache
from .driver import check, drv
from .ptx import SIMULATOR

log = logging.getLogger(__name__)

FAST = True  # False: every launch through numba's dispatcher (benchmarks/gpu_launch.py compares)

_SIGS: dict = {}  # (kernel, argument key) -> _Signature
_DIMS: dict = {}  # (grid, block) -> (gx, gy, gz, bx, by, bz) (prefill grids vary: bounded)
_MAX_DIMS = 4096
_LOCK = threading.Lock()  # a signature's one parameter buffer, packed and launched by one thread at a time
COUNTS = {"compiled": 0, "cached": 0}  # fast-path overloads compiled here vs loaded from the disk cache
RESOLVED: collections.Counter = collections.Counter()  # kernel name -> overloads compiled or loaded
RECORD: list[str] | None = None  # a list: each launch appends its kernel's name (launches a step, tests)


def launch(kernel, grid, block, stream, *args) -> None:
    """kernel[grid, block, stream](*args), with the dispatcher's per-launch work done once."""
    if RECORD is not None:
        RECORD.append(kernel.py_func.__name__)
    if SIMULATOR or not FAST or not stream:
        kernel[grid, block, stream](*args)
        return
    key = (kernel, *map(_arg_key, args))
    sig = _SIGS.get(key)
    if sig is None:
        sig = _SIGS[key] = _Signature(*_resolve(kernel, args))
    flat = []
    for code, a in zip(sig.codes, args):
        if code is None:  # a device array
            flat += (0, 0, a.size, a.dtype.itemsize, int(a.gpu_data.device_pointer), *a.shape, *a.strides)
        else:
            flat.append(a)
    dims = _DIMS.get((grid, block)) or _dims(grid, block)
    with _LOCK:
        sig.params.pack_into(sig.buf, 0, *flat)
        err, = drv().cuLaunchKernel(sig.func, *dims, 0, int(stream.handle), sig.pointers, 0)
    if err:
        check((err,))


class _Signature:
    """One overload's launch: its kernel handle, each argument's struct code (None: an array),
    and the packed parameter buffer with the pointers into it that cuLaunchKernel reads."""

    def __init__(self, core_kernel, codes: tuple, ndims: tuple):
        self.codes = codes
        self.func = drv().CUfunction(int(core_kernel.handle))  # a CUkernel launches as one
        fields = []  # the flattened parameters' struct codes
        for code, ndim in zip(codes, ndims):
            fields += ["q"] * (5 + 2 * ndim) if code is None else [code]
        fmt, offsets, at = "=", [], 0
        for f in fields:
            size = struct.calcsize("=" + f)
            pad = -at % size  # each value at its natural alignment
            fmt += "x" * pad + f
            offsets.append(at + pad)
            at += pad + size
        self.params = struct.Struct(fmt)
        self.buf = ctypes.create_string_buffer(max(at, 1))
        base = ctypes.addressof(self.buf)
        self._array = (ctypes.c_void_p * max(len(offsets), 1))(*(base + o for o in offsets))
        self.pointers = ctypes.addressof(self._array)


def _dims(grid, block) -> tuple:
    if len(_DIMS) >= _MAX_DIMS:  # a long-lived daemon sees every prompt length
        _DIMS.clear()
    g = (grid, 1, 1) if isinstance(grid, int) else (*grid, 1, 1)[:3]
    b = (block, 1, 1) if isinstance(block, int) else (*block, 1, 1)[:3]
    dims = _DIMS[(grid, block)] = tuple(int(v) for v in (*g, *b))
    return dims


def _arg_key(a):
    """What picks a kernel overload: a C-contiguous array's dtype and rank (numba types it
    Array(dtype, ndim, "C")), another array's numba type (slower to make, and rare), a scalar's
    Python type."""
    dtype = getattr(a, "dtype", None)
    if dtype is None or not hasattr(a, "gpu_data"):
        return type(a)
    if _c_contiguous(a.shape, a.strides, dtype.itemsize):
        return dtype, a.ndim
    return a._numba_type_  # noqa: SLF001


def _c_contiguous(shape, strides, itemsize) -> bool:
    """numpy's rule, which numba's typing follows: dimensions of one element are ignored, an
    empty array is contiguous, a broadcast (0-stride) one is not."""
    if 0 in shape:
        return True
    expect = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if s != expect:
                return False
            expect *= n
    return True


def _resolve(kernel, args):
    """The overload the dispatcher would launch for these arguments, each argument's struct code
    and each array's rank: from the disk cache when it holds this (kernel, argument types,
    device), else compiled (and stored)."""
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    RESOLVED[getattr(kernel, "__name__", str(kernel))] += 1
    codes = _codes(argtypes)
    ndims = tuple(getattr(ty, "ndim", 0) for ty in argtypes)
    cached = _disk.load(kernel, argtypes)
    if cached is not None:
        COUNTS["cached"] += 1
        return cached, codes, ndims
    t0 = time.perf_counter()
    overload = kernel.compile(argtypes)
    COUNTS["compiled"] += 1
    log.debug("compiled %s in %.2f s", getattr(kernel, "__name__", kernel), time.perf_counter() - t0)
    _disk.store(kernel, argtypes, overload)
    return overload._codelibrary.get_cufunc().kernel, codes, ndims  # noqa: SLF001


_INT_CODES = {(8, True): "b", (8, False): "B", (16, True): "h", (16, False): "H", (32, True): "i", (32, False): "I",
              (64, True): "q", (64, False): "Q"}


def _codes(argtypes) -> tuple:
    """Per argument: None for an array (flattened in launch), else the struct code of the
    scalar's C type."""
    from numba.cuda import types

    codes = []
    for ty in argtypes:
        if isinstance(ty, types.Array):
            codes.append(None)
        elif isinstance(ty, types.Boolean):
            codes.append("?")
        elif isinstance(ty, types.Integer):
            codes.append(_INT_CODES[(ty.bitwidth, ty.signed)])
        elif ty == types.float32:
            codes.append("f")
        elif ty == types.float64:
            codes.append("d")
        else:
            raise TypeError(f"launch: no fast path for a {ty} argument (use the dispatcher)")
    return tuple(codes)


class _DiskCache:
    """kernel_cache.py's entries for the fast path: cubins loaded with cuda.core, never raising."""

    def __init__(self):
        self.dir = None  # resolved on first use: MOED_KERNEL_CACHE, or False when off/unusable
        self.fingerprints: dict = {}  # kernel -> fingerprint, or None (uncacheable)
        self.context = None  # (toolchain, source digest), once per process
        self.modules: list = []  # cuda.core ObjectCodes loaded here, kept alive with their kernels

    def _key(self, kernel, argtypes):
        if self.dir is None:
            try:
                self.dir = kernel_cache.cache_dir() or False
            except Exception as e:  # noqa: BLE001  (a bad MOED_KERNEL_CACHE: no cache, not a failed launch)
                log.warning("kernel cache off: %s", e)
                self.dir = False
        if not self.dir:
            return None
        if kernel not in self.fingerprints:
            try:
                self.fingerprints[kernel] = kernel_cache.fingerprint(kernel)
            except Exception as e:  # noqa: BLE001  (Uncacheable, or a shape fingerprint() does not know)
                log.debug("kernel cache: %s not cached: %s", getattr(kernel, "__name__", kernel), e)
                self.fingerprints[kernel] = None
        fp = self.fingerprints[kernel]
        if fp is None:
            return None
        if self.context is None:
            self.context = (kernel_cache.toolchain(), kernel_cache.source_digest())
        tools, sources = self.context
        return kernel_cache.entry_key(fp, argtypes, self.cc(), tools, sources)

    def cc(self):
        """The current device's compute capability (a process may use GPUs of two kinds)."""
        from numba import cuda

        return cuda.get_current_device().compute_capability

    def load(self, kernel, argtypes):
        """The cuda.core Kernel from a cached cubin, or None."""
        try:
            key = self._key(kernel, argtypes)
            entry = key and kernel_cache.read(self.dir, key)
            if not entry:
                return None
            code = _core.ObjectCode.from_cubin(entry.cubin)
            core_kernel = code.get_kernel(entry.entry_name)
        except Exception as e:  # noqa: BLE001  (a bad entry is a miss)
            log.debug("kernel cache: loading failed (%s); compiling", e)
            return None
        self.modules.append(code)
        return core_kernel

    def store(self, kernel, argtypes, overload) -> None:
        try:
            key = self._key(kernel, argtypes)
            lib = overload._codelibrary  # noqa: SLF001
            if (key is None or lib._setup_functions or lib._linking_files or lib.use_cooperative  # noqa: SLF001
                    or any(hasattr(o, "__cuda_array_interface__") for o in lib.referenced_objects.values())):
                return  # set-up at load (NRT, linked files) or a captured device array: numba's only
            code = lib.get_cubin()  # a cuda.core ObjectCode (numba-cuda 0.30), its bytes in .code
            kernel_cache.write(self.dir, key, lib._entry_name, getattr(code, "code", code))  # noqa: SLF001
        except Exception as e:  # noqa: BLE001  (not cached: the kernel still runs)
            log.debug("kernel cache: storing failed (%s)", e)


_disk = _DiskCache()


class _Core:
    """cuda.core (its ObjectCode loads cached cubins), imported on first use."""

    def __getattr__(self, name):
        import cuda.core as core

        self.ObjectCode = core.ObjectCode
        return getattr(core, name)


_core = _Core()

__all__ = ["launch", "COUNTS", "RESOLVED", "FAST"]
