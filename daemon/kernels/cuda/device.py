"""Device functions shared by the op kernels: float bit conversions and block reductions.

The bit conversions are ptx.py's (inline PTX on the GPU, Python twins under numba's CUDA
simulator, chosen once at import: the simulator is fixed when numba.cuda is first imported).

The block reduction is warp butterflies (ptx.warp_sum, which has a simulator twin) in a fixed
order: the same inputs give the same bits on every run (no atomics).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

# one simulator flag and one set of bit conversions for every CUDA kernel: ptx.py's
from .ptx import SIMULATOR as SIM  # noqa: E402
from .ptx import bits_to_f32, f16_to_f32 as half_bits_to_f32  # noqa: E402,F401
from .ptx import warp_sum  # noqa: E402


@cuda.jit(device=True, inline=True)
def f16_at(row, o):
    """The fp16 at byte offset o of a uint8 row, as float32 (ggml block scales)."""
    return half_bits_to_f32(np.int32(row[o]) | (np.int32(row[o + 1]) << 8))


@cuda.jit(device=True, inline=True)
def sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + math.exp(-x))


@cuda.jit(device=True)
def block_sum(v, buf, tid, n):
    """Sum of every thread's v over a block of n threads (a multiple of 32) -> the sum, read by
    every thread. buf: shared f32 [>= n/32]. Warp butterflies, then one over the warps' sums: a
    fixed order, so the same inputs give the same bits on every run. Leaves buf free for reuse."""
    v = warp_sum(v, 32)
    if tid % 32 == 0:
        buf[tid // 32] = v
    cuda.syncthreads()
    lane = tid % 32
    x = buf[lane] if lane < n // 32 else np.float32(0.0)
    total = warp_sum(x, 32)
    cuda.syncthreads()
    return total


def upload(host: np.ndarray, stream=None):
    """host copied into a new device array, ordered before the work later queued on `stream`
    (stream None: complete on return, for every stream).

    The backend's stream is non-blocking, so it does not wait for the legacy default stream that
    a plain cuda.to_device uses, and that copy, from pageable memory, may return before its DMA
    lands: a kernel queued next could read the memory's previous contents (freed memory of an
    earlier model: garbage indices, illegal addresses)."""
    if stream is not None:
        return cuda.to_device(host, stream=stream)
    dev = cuda.to_device(host)
    if not SIM:
        cuda.default_stream().synchronize()
    return dev


def zero_fill(arr, stream=None) -> None:
    """arr's bytes set to 0, in `stream`'s order (None: complete on return; a memset on the legacy
    stream is asynchronous to the host and unordered with non-blocking streams)."""
    if not arr.size:
        return
    if SIM:
        arr.copy_to_device(np.zeros(arr.shape, arr.dtype))
        return
    from numba.cuda.cudadrv.driver import device_memset

    device_memset(arr, 0, int(arr.nbytes), 0 if stream is None else stream)
    if stream is None:
        cuda.default_stream().synchronize()


_PLACEHOLDERS: dict = {}


def placeholder(dtype, ndim: int = 1):
    """A one-element device array passed for an absent optional argument (kernels read it only
    behind a flag). Allocated once per (dtype, ndim): slicing or reshaping a device array on every
    launch costs tens of microseconds of host time."""
    key = (np.dtype(dtype).str, ndim)
    a = _PLACEHOLDERS.get(key)
    if a is None:
        a = _PLACEHOLDERS[key] = upload(np.zeros((1,) * ndim, dtype))
    return a
