"""Device functions shared by the op kernels: float bit conversions and block reductions.

The bit conversions go through libdevice on the GPU. libdevice does not exist under numba's CUDA
simulator, so each has a numpy twin there, chosen once at import (the simulator is fixed when
numba.cuda is first imported).

The reductions work on a shared-memory buffer with one slot per thread of a block whose size is a
power of two, in a fixed tree order: the same inputs give the same bits on every run (no atomics),
and they need no warp shuffles (which the simulator lacks).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

try:  # numba-cuda 0.30 keeps its own config; without it, numba's
    from numba.cuda.core import config as _cuda_config
except ImportError:  # pragma: no cover
    from numba.core import config as _cuda_config

SIM = bool(_cuda_config.ENABLE_CUDASIM)

if SIM:

    @cuda.jit(device=True)
    def half_bits_to_f32(h):
        """IEEE half bits (low 16 bits of an int) -> float32, exact."""
        return np.float32(np.array(int(h) & 0xFFFF, dtype=np.uint16).view(np.float16)[()])

    @cuda.jit(device=True)
    def bits_to_f32(u):
        """The low 32 bits of an int reinterpreted as float32."""
        return np.array(int(u) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def half_bits_to_f32(h):
        """IEEE half bits (low 16 bits of an int) -> float32, exact."""
        return libdevice.half2float(np.int16(h))

    @cuda.jit(device=True, inline=True)
    def bits_to_f32(u):
        """The low 32 bits of an int reinterpreted as float32."""
        return libdevice.int_as_float(np.int32(u))


@cuda.jit(device=True, inline=True)
def f16_at(row, o):
    """The fp16 at byte offset o of a uint8 row, as float32 (ggml block scales)."""
    return half_bits_to_f32(np.int32(row[o]) | (np.int32(row[o + 1]) << 8))


@cuda.jit(device=True, inline=True)
def sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + math.exp(-x))


@cuda.jit(device=True)
def block_sum(buf, tid, n):
    """Sum of buf[0:n] (n = threads of the block, a power of two; each thread has written its own
    slot) -> the sum, read by every thread. Fixed tree order. Leaves the buffer free for reuse."""
    cuda.syncthreads()
    stride = n // 2
    while stride > 0:
        if tid < stride:
            buf[tid] += buf[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def block_max(buf, tid, n):
    """Maximum of buf[0:n], as block_sum."""
    cuda.syncthreads()
    stride = n // 2
    while stride > 0:
        if tid < stride:
            buf[tid] = max(buf[tid], buf[tid + stride])
        cuda.syncthreads()
        stride //= 2
    m = buf[0]
    cuda.syncthreads()
    return m


_PLACEHOLDERS: dict = {}


def placeholder(dtype, ndim: int = 1):
    """A one-element device array passed for an absent optional argument (kernels read it only
    behind a flag). Allocated once per (dtype, ndim): slicing or reshaping a device array on every
    launch costs tens of microseconds of host time."""
    key = (np.dtype(dtype).str, ndim)
    a = _PLACEHOLDERS.get(key)
    if a is None:
        a = _PLACEHOLDERS[key] = cuda.to_device(np.zeros((1,) * ndim, dtype))
    return a
