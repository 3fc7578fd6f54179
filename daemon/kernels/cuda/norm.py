"""RMSNorm on the device, over rows or per head, optionally fused with the residual add.

Legend: R = rows normalised (tokens, or tokens x heads for the per-head q/k norm), N = values per
row (D, or Dh per head), T = tokens, H = heads, D = hidden size.

As ops.rms_norm: scale = 1/sqrt(mean(x^2) + eps), y = (x*scale)*w. One block per row; the sum of
squares is a fixed-order tree over the block's threads in float32 (the CPU sums in float64; the
relative difference is ~1e-7 and does not vary between runs).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .device import block_sum

_MAX_THREADS = 256


@cuda.jit(device=True, inline=True)
def _normalise_row(x, w, eps, out, buf):
    """x, out: one row f32 [N]."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    N = x.shape[0]
    acc = np.float32(0.0)
    for i in range(tid, N, nt):
        v = x[i]
        acc += v * v
    buf[tid] = acc
    total = block_sum(buf, tid, nt)
    scale = np.float32(1.0) / math.sqrt(total / np.float32(N) + eps)
    for i in range(tid, N, nt):
        out[i] = (x[i] * scale) * w[i]


@cuda.jit
def _rms_norm(x, w, eps, out):
    """x, out: f32 [T, N]; w: f32 [N]. Grid T blocks."""
    buf = cuda.shared.array(_MAX_THREADS, np.float32)
    t = cuda.blockIdx.x
    _normalise_row(x[t], w, eps, out[t], buf)


@cuda.jit
def _rms_norm_heads(x, w, eps, out):
    """x, out: f32 [T, H, Dh]; w: f32 [Dh]. Grid (H, T) blocks."""
    buf = cuda.shared.array(_MAX_THREADS, np.float32)
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    _normalise_row(x[t, h], w, eps, out[t, h], buf)


@cuda.jit
def _add_rms_norm(x, delta, bias, has_bias, w, eps, out):
    """x += delta (+ bias), then out = rms_norm(x) * w. x, delta, out: f32 [R, N]; bias, w: [N]."""
    buf = cuda.shared.array(_MAX_THREADS, np.float32)
    r = cuda.blockIdx.x
    for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        d = delta[r, i]
        if has_bias:
            d += bias[i]
        x[r, i] += d
    cuda.syncthreads()
    _normalise_row(x[r], w, eps, out[r], buf)


def _threads(n: int) -> int:
    """A power of two in 32..256, about n."""
    t = 32
    while t < n and t < _MAX_THREADS:
        t *= 2
    return t


def rms_norm(x, weight, eps: float, out, stream=0) -> None:
    """out = rms_norm(x) * weight over the last axis of length N = weight.shape[0].

    x, out: device f32 [T, D] with weight [D], or [T, H, Dh] with weight [Dh] (q/k norm per head);
    out may be x."""
    N = weight.shape[0]
    if x.ndim not in (2, 3) or x.shape[x.ndim - 1] != N or out.shape != x.shape:
        raise ValueError(f"rms_norm: x {x.shape}, out {out.shape}, weight {weight.shape}")
    if x.size == 0:
        return
    if x.ndim == 2:
        _rms_norm[x.shape[0], _threads(N), stream](x, weight, np.float32(eps), out)
    else:
        _rms_norm_heads[(x.shape[1], x.shape[0]), _threads(N), stream](x, weight, np.float32(eps), out)


def add_rms_norm(x, delta, weight, eps: float, out, bias=None, stream=0) -> None:
    """The residual add and the next norm in one launch: x += delta (+ bias), out = rms_norm(x) * weight.

    x (updated in place), delta, out: device f32 [T, D]; weight, bias: [D] (bias: e.g. the attention
    output's bias, added before the residual as the CPU path does)."""
    T, D = x.shape
    if delta.shape != x.shape or out.shape != x.shape or weight.shape != (D,):
        raise ValueError(f"add_rms_norm: x {x.shape}, delta {delta.shape}, out {out.shape}, weight {weight.shape}")
    if T:
        _add_rms_norm[T, _threads(D), stream](x, delta, weight if bias is None else bias, bias is not None,
                                               weight, np.float32(eps), out)
