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

Under the simulator (no GPU), with stream 0, and while `FAST` is off (benchmarks compare the two)
this is the dispatcher launch itself.
"""

from __future__ import annotations

import ctypes

from .ptx import SIMULATOR

FAST = True  # False: every launch through numba's dispatcher (benchmarks/gpu_launch.py compares)

_SIGS: dict = {}  # (kernel, argument key) -> (cuda.core Kernel, converters)
_CONFIGS: dict = {}  # (grid, block) -> cuda.core LaunchConfig (prefill grids vary: bounded)
_MAX_CONFIGS = 4096
_STREAMS: dict = {}  # stream handle -> cuda.core Stream (not owning: the backend owns its stream)


def launch(kernel, grid, block, stream, *args) -> None:
    """kernel[grid, block, stream](*args), with the dispatcher's per-launch work done once."""
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
    """The overload the dispatcher would launch for these arguments, and how to pass each one."""
    from numba.cuda import types

    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    overload = kernel.compile(argtypes)
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
    return overload._codelibrary.get_cufunc().kernel, tuple(converters)  # noqa: SLF001


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

        for n in ("launch", "LaunchConfig", "Stream"):
            setattr(self, n, getattr(core, n))
        return getattr(core, name)


_core = _Core()

__all__ = ["launch", "FAST", "forget_stream"]
