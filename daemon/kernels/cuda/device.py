"""Device functions shared by the op kernels: float bit conversions and block reductions.

The bit conversions are ptx.py's (inline PTX on the GPU, Python twins under numba's CUDA
simulator, chosen once at import: the simulator is fixed when numba.cuda is first imported).

The reductions work on a shared-memory buffer with one slot per thread of a block whose size is a
power of two, in a fixed tree order: the same inputs give the same bits on every run (no atomics),
and they need no warp shuffles (which the simulator lacks).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

# one simulator flag and one set of bit conversions for every CUDA kernel: ptx.py's
from .ptx import SIMULATOR as SIM  # noqa: E402
from .ptx import bits_to_f32, f16_to_f32 as half_bits_to_f32  # noqa: E402,F401


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
