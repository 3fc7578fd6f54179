"""Kernel launches without numba's dispatcher: launch(kernel, grid, block, stream, *args).

`kernel[grid, block, stream](*args)` costs tens to hundreds of microseconds of host time: the
dispatcher types every argument, wraps every device array in a cuda.core StridedMemoryView and
builds a LaunchConfig, at every launch. Eager steps (prefill, and any step that reads routing back
to the host) launch ~17 kernels a layer, so that cost, not the GPU, set their pace.

Here each (kernel, argument signature) is resolved once: the dispatcher compiles (or finds) the
overload, and we keep its cuda.core Kernel and one converter per argument. A launch then flattens
the arguments the way numba's kernel ABI lays them out (as `_Kernel._prepare_args` does: an array
is meminfo, parent, size, itemsize, data pointer, shape..., strides...; scalars as the C type the
kernel was compiled for) and calls cuda.core's `launch` with a LaunchConfig and a cuda.core Stream
made once. The same kernel runs on the same bytes, so results are the same bits; a capture sees an
ordinary cuLaunchKernel on the capturing stream.

Resolving compiles, and compiling a prefill's kernels takes seconds, so what it yields (the cubin
and its entry name) is also kept on disk (kernel_cache.py): a new process loads the cubin with
cuda.core instead. The argument converters follow from the argument types alone. `COUNTS` says
how many overloads were compiled and how many loaded.

Under the simulator (no GPU), with stream 0, and while `FAST` is off (benchmarks compare the two)
this is the dispatcher launch itself, and nothing is cached.
"""

from __future__ import annotations

import ctypes
import logging
import time

from . import kernel_cache
from .ptx import SIMULATOR

log = logging.getLogger(__name__)

FAST = True  # False: every launch through numba's dispatcher (benchmarks/gpu_launch.py compares)

_SIGS: dict = {}  # (kernel, argument key) -> (cuda.core Kernel, converters)
_CONFIGS: dict = {}  # (grid, block) -> cuda.core LaunchConfig (prefill grids vary: bounded)
_MAX_CONFIGS = 4096
_STREAMS: dict = {}  # stream handle -> cuda.core Stream (not owning: the backend owns its stream)
COUNTS = {"compiled": 0, "cached": 0}  # fast-path overloads compiled here vs loaded from the disk cache
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
        sig = _SIGS[key] = _resolve(kernel, args)
    core_kernel, converters = sig
    flat = []
    for conv, a in zip(converters, args):
        if conv is None:  # a device array
            flat += (0, 0, a.size, a.dtype.itemsize, int(a.gpu_data.device_pointer), *a.shape, *a.strides)
        else:
            flat.append(conv(a))
    _core.launch(_stream(stream), _config(grid, block), core_kernel, *flat)


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
    """The overload the dispatcher would launch for these arguments, and how to pass each one:
    from the disk cache when it holds this (kernel, argument types, device), else compiled (and
    stored)."""
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    converters = _converters(argtypes)
    cached = _disk.load(kernel, argtypes)
    if cached is not None:
        COUNTS["cached"] += 1
        return cached, converters
    t0 = time.perf_counter()
    overload = kernel.compile(argtypes)
    COUNTS["compiled"] += 1
    log.debug("compiled %s in %.2f s", getattr(kernel, "__name__", kernel), time.perf_counter() - t0)
    _disk.store(kernel, argtypes, overload)
    return overload._codelibrary.get_cufunc().kernel, converters  # noqa: SLF001


def _converters(argtypes) -> tuple:
    """Per argument: None for an array (flattened in launch), else the C type of the scalar."""
    from numba.cuda import types

    converters = []
    for ty in argtypes:
        if isinstance(ty, types.Array):
            converters.append(None)
        elif isinstance(ty, types.Boolean):
            converters.append(bool)
        elif isinstance(ty, types.Integer):
            converters.append(getattr(ctypes, f"c_{ty}"))
        elif ty == types.float32:
            converters.append(ctypes.c_float)
        elif ty == types.float64:
            converters.append(ctypes.c_double)
        else:
            raise TypeError(f"launch: no fast path for a {ty} argument (use the dispatcher)")
    return tuple(converters)


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


def _config(grid, block):
    key = (grid, block)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if len(_CONFIGS) >= _MAX_CONFIGS:  # a long-lived daemon sees every prompt length
            _CONFIGS.clear()
        cfg = _CONFIGS[key] = _core.LaunchConfig(grid=grid, block=block)
    return cfg


def _stream(stream):
    handle = int(stream.handle)
    s = _STREAMS.get(handle)
    if s is None:
        s = _STREAMS[handle] = _core.Stream.from_handle(handle)
    return s


def forget_stream(handle) -> None:
    """Drop the cuda.core wrapper of a stream handle about to be destroyed (it may be reused)."""
    _STREAMS.pop(int(handle), None)


class _Core:
    """cuda.core, imported on the first fast launch (the simulator never needs it)."""

    def __getattr__(self, name):
        import cuda.core as core

        for n in ("launch", "LaunchConfig", "Stream", "ObjectCode"):
            setattr(self, n, getattr(core, n))
        return getattr(core, name)


_core = _Core()

__all__ = ["launch", "COUNTS", "FAST", "forget_stream"]
