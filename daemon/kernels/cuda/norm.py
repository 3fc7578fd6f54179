"""RMSNorm on the device, over rows or per head, optionally fused with the residual add.

Legend: R = rows normalised (tokens, or tokens x heads for the per-head q/k norm), N = values per
row (D, or Dh per head), T = tokens, H = heads, D = hidden size.

As ops.rms_norm: scale = 1/sqrt(mean(x^2) + eps), y = (x*scale)*w. One block per row, each thread
holding up to 8 of its values (loaded together); the sum of squares is a fixed-order tree of warp
butterflies in float32 (the CPU sums in float64; the
relative difference is ~1e-7 and does not vary between runs).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .device import block_sum
from .launch import launch

_MAX_THREADS = 1024
_HELD = 8  # values of a row each thread holds (loaded together): rows up to 8192 values


@cuda.jit(device=True, inline=True)
def _normalise_held(xs, w, eps, out, buf):
    """xs: this thread's values of one row (element tid + u*threads is xs[u]); out: the row f32 [N]
    -> (x*scale)*w."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    N = out.shape[0]
    acc = np.float32(0.0)
    for u in range(_HELD):
        if tid + u * nt < N:
            acc += xs[u] * xs[u]
    ws = cuda.local.array(_HELD, np.float32)  # loaded before any store: out may alias w for all numba knows
    for u in range(_HELD):
        i = tid + u * nt
        ws[u] = w[i] if i < N else np.float32(0.0)
    total = block_sum(acc, buf, tid, nt)
    scale = np.float32(1.0) / math.sqrt(total / np.float32(N) + eps)
    for u in range(_HELD):
        i = tid + u * nt
        if i < N:
            out[i] = (xs[u] * scale) * ws[u]


@cuda.jit(device=True, inline=True)
def _normalise_row(x, w, eps, out, buf):
    """x, out: one row f32 [N]."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    N = x.shape[0]
    xs = cuda.local.array(_HELD, np.float32)
    for u in range(_HELD):
        i = tid + u * nt
        xs[u] = x[i] if i < N else np.float32(0.0)
    _normalise_held(xs, w, eps, out, buf)


@cuda.jit
def _rms_norm(x, w, eps, out):
    """x, out: f32 [T, N]; w: f32 [N]. Grid T blocks."""
    buf = cuda.shared.array(32, np.float32)
    t = cuda.blockIdx.x
    _normalise_row(x[t], w, eps, out[t], buf)


@cuda.jit
def _rms_norm_heads(x, w, eps, out):
    """x, out: f32 [T, H, Dh]; w: f32 [Dh]. Grid (H, T) blocks."""
    buf = cuda.shared.array(32, np.float32)
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    _normalise_row(x[t, h], w, eps, out[t, h], buf)


@cuda.jit
def _add_rms_norm(x, delta, bias, has_bias, w, eps, x_out, out):
    """x_out = x + delta (+ bias), then out = rms_norm(x_out) * w. x, delta, x_out, out: f32
    [R, N] (x_out may be x); bias, w: [N]."""
    buf = cuda.shared.array(32, np.float32)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    N = x.shape[1]
    xs = cuda.local.array(_HELD, np.float32)
    for u in range(_HELD):  # every load before the first store, so they are in flight together
        i = tid + u * nt
        v = np.float32(0.0)
        if i < N:
            d = delta[r, i]
            if has_bias:
                d += bias[i]
            v = x[r, i] + d
        xs[u] = v
    for u in range(_HELD):
        i = tid + u * nt
        if i < N:
            x_out[r, i] = xs[u]
    _normalise_held(xs, w, eps, out[r], buf)


def _threads(n: int) -> int:
    """A power of two in 32..1024 holding n values at _HELD per thread."""
    t = 32
    while t * _HELD < n and t < _MAX_THREADS:
        t *= 2
    if t * _HELD < n:
        raise ValueError(f"rms_norm: rows of {n} values exceed {_MAX_THREADS * _HELD}")
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
        launch(_rms_norm, x.shape[0], _threads(N), stream, x, weight, np.float32(eps), out)
    else:
        launch(_rms_norm_heads, (x.shape[1], x.shape[0]), _threads(N), stream, x, weight, np.float32(eps), out)


def add_rms_norm(x, delta, weight, eps: float, out, bias=None, x_out=None, stream=0) -> None:
    """The residual add and the next norm in one launch: x_out = x + delta (+ bias), out =
    rms_norm(x_out) * weight.

    x, delta, out, x_out: device f32 [T, D] (x_out None: x, updated in place); weight, bias: [D]
    (bias: e.g. the attention output's bias, added before the residual as the CPU path does)."""
    T, D = x.shape
    x_out = x if x_out is None else x_out
    if delta.shape != x.shape or out.shape != x.shape or x_out.shape != x.shape or weight.shape != (D,):
        raise ValueError(f"add_rms_norm: x {x.shape}, delta {delta.shape}, out {out.shape}, weight {weight.shape}")
    if T:
        launch(_add_rms_norm, T, _threads(D), stream, x, delta, weight if bias is None else bias, bias is not None,
                                               weight, np.float32(eps), x_out, out)

