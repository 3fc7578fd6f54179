"""RMSNorm on the device, over rows or per head, optionally fused with the residual add and with
the q8_1 quantization of its output.

Legend: R = rows normalised (tokens, or tokens x heads for the per-head q/k norm), N = values per
row (D, or Dh per head), T = tokens, H = heads, D = hidden size.

As ops.rms_norm: scale = 1/sqrt(mean(x^2) + eps), y = (x*scale)*w. One block per row, each thread
holding `held` of its values (element tid + u * threads), about two (_threads); the sum of squares
is a fixed-order tree of warp butterflies in float32 (the CPU sums in float64; the relative
difference is ~1e-7 and does not vary between runs). The order depends on N alone, so a row's
result does not depend on the other rows of the call.

A decode step's norm is one block: its time is the length of each warp's instruction stream, not
memory. Under Nsight Compute on the H200 a one-row add + norm + q8_1 of 2,048 values took 8.1 us
at 8 values a thread: 1,869 instructions a warp, most of them signed 64-bit index arithmetic
(numba fixes up negative indices on every access). So the threads hold two values each and
index with unsigned values (np.uint32 arithmetic stays unsigned).

Every load of a row is issued before any use or store, at an index clamped into the row (no load
behind a branch). With q8_1 blocks asked for, the norm also quantizes y as quantize.py does (the
same device function, so the same bits): a warp's 32 lanes hold one q8_1 block of y for each u,
since the threads are a multiple of 32 and so is N.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from .device import SIM, block_sum, placeholder
from .launch import launch
from .ptx import warp_max, warp_sum
from .quantize import QK8_1, q8_1_quant, store_q8_1

_MAX_THREADS = 1024
_MAX_HELD = 8  # rows up to 8192 values
_U = np.uint32


@functools.cache
def _make(add: bool, quant: bool, held: int):
    """The row kernel: out = rms_norm(x (+ delta + bias)) * w, with x_out = x + delta (+ bias)
    when `add`, and out's q8_1 blocks when `quant`; `held` values a thread (a constant: they stay
    in registers)."""

    def row_norm(x, delta, bias, has_bias, w, eps, x_out, out, qs, ds):
        """x, delta, x_out, out: f32 [R, N] (x_out and out may be x); bias, w: f32 [N]; qs: int8
        [R, N] and ds: f32 [R, N/32, 2] (read only when quant). Grid R blocks."""
        buf = cuda.shared.array(32, np.float32)
        r = _U(cuda.blockIdx.x)
        tid = _U(cuda.threadIdx.x)
        nt = _U(cuda.blockDim.x)
        N = _U(w.shape[0])
        last = N - _U(1)
        xs = cuda.local.array(held, np.float32)
        ws = cuda.local.array(held, np.float32)
        for u in range(held):  # clamped: every load issued before any is used (module doc)
            i = min(tid + _U(u) * nt, last)
            xs[u] = x[r, i]
            ws[u] = w[i]
        if add:
            dv = cuda.local.array(held, np.float32)
            for u in range(held):
                dv[u] = delta[r, min(tid + _U(u) * nt, last)]
            if has_bias:
                for u in range(held):
                    dv[u] += bias[min(tid + _U(u) * nt, last)]
            for u in range(held):
                xs[u] += dv[u]
                i = tid + _U(u) * nt
                if i < N:
                    x_out[r, i] = xs[u]
        acc = np.float32(0.0)
        for u in range(held):
            if tid + _U(u) * nt < N:
                acc += xs[u] * xs[u]
        total = block_sum(acc, buf, cuda.threadIdx.x, cuda.blockDim.x)
        scale = np.float32(1.0) / math.sqrt(total / np.float32(w.shape[0]) + eps)
        for u in range(held):
            i = tid + _U(u) * nt
            xs[u] = (xs[u] * scale) * ws[u] if i < N else np.float32(0.0)  # y
            if i < N:
                out[r, i] = xs[u]
        if quant:
            # each step over all u before the next, without branches, so the blocks' shuffles
            # interleave; every lane reaches them (a warp's lanes are all valid or none)
            amax = cuda.local.array(held, np.float32)
            for u in range(held):
                amax[u] = warp_max(abs(xs[u]), 32)
            for u in range(held):
                ws[u] = q8_1_quant(xs[u], amax[u], tid + _U(u) * nt < N)  # the quants
            sums = cuda.local.array(held, np.float32)  # of each block's quants
            for u in range(held):
                sums[u] = warp_sum(ws[u], 32)
            for u in range(held):
                i = tid + _U(u) * nt
                store_q8_1(ws[u], amax[u], sums[u], i < N, qs, ds, r, i)

    if SIM:
        return cuda.jit(row_norm)
    # at most 64 registers a thread, so that 1,024 threads fit an SM
    return cuda.jit(row_norm, launch_bounds=(_MAX_THREADS,))


def _shape(n: int) -> tuple[int, int]:
    """(threads, values each holds) for rows of n values: threads a power of two in 32..1024
    holding about two values each, the values a power of two."""
    t = 32
    while 2 * t < n and t < _MAX_THREADS:
        t *= 2
    held = 1
    while t * held < n:
        held *= 2
    if held > _MAX_HELD:
        raise ValueError(f"rms_norm: rows of {n} values exceed {_MAX_THREADS * _MAX_HELD}")
    return t, held


def _q8_args(q8, T: int, N: int, what: str):
    """(qs, ds, quant) for a launch: q8 = (qs int8 [T, N], ds f32 [T, N/32, 2]) or None."""
    if q8 is None:
        return placeholder(np.int8, 2), placeholder(np.float32, 3), False
    qs, ds = q8
    if N % QK8_1 or qs.shape != (T, N) or ds.shape != (T, N // QK8_1, 2):
        raise ValueError(f"{what}: q8_1 blocks qs {qs.shape}, ds {ds.shape} for rows [{T}, {N}]")
    return qs, ds, True


def rms_norm(x, weight, eps: float, out, q8=None, stream=0) -> None:
    """out = rms_norm(x) * weight over the last axis of length N = weight.shape[0].

    x, out: device f32 [T, D] with weight [D], or C-contiguous [T, H, Dh] with weight [Dh] (q/k norm
    per head); out may be x. q8: (qs int8 [T, D], ds f32 [T, D/32, 2]) to take out's q8_1 blocks too (rows
    only), the bits of quantize_q8_1(out)."""
    N = weight.shape[0]
    if x.ndim not in (2, 3) or x.shape[x.ndim - 1] != N or out.shape != x.shape:
        raise ValueError(f"rms_norm: x {x.shape}, out {out.shape}, weight {weight.shape}")
    if x.ndim == 3 and q8 is not None:
        raise ValueError("rms_norm: q8_1 blocks are made for rows [T, D] only")
    if x.size == 0:
        return
    rows = x.size // N
    if x.ndim == 3:  # each (token, head) a row of Dh
        x, out = x.reshape(rows, N), out.reshape(rows, N)
    qs, ds, quant = _q8_args(q8, rows, N, "rms_norm")
    threads, held = _shape(N)
    launch(_make(False, quant, held), rows, threads, stream, x, x, weight, False, weight, np.float32(eps), x, out,
           qs, ds)


def add_rms_norm(x, delta, weight, eps: float, out, bias=None, x_out=None, q8=None, stream=0) -> None:
    """The residual add and the next norm in one launch: x_out = x + delta (+ bias), out =
    rms_norm(x_out) * weight.

    x, delta, out, x_out: device f32 [T, D] (x_out None: x, updated in place); weight, bias: [D]
    (bias: e.g. the attention output's bias, added before the residual as the CPU path does);
    q8: out's q8_1 blocks too, as for rms_norm."""
    T, D = x.shape
    x_out = x if x_out is None else x_out
    if delta.shape != x.shape or out.shape != x.shape or x_out.shape != x.shape or weight.shape != (D,):
        raise ValueError(f"add_rms_norm: x {x.shape}, delta {delta.shape}, out {out.shape}, weight {weight.shape}")
    qs, ds, quant = _q8_args(q8, T, D, "add_rms_norm")
    if T:
        threads, held = _shape(D)
        launch(_make(True, quant, held), T, threads, stream, x, delta, weight if bias is None else bias,
               bias is not None, weight, np.float32(eps), x_out, out, qs, ds)
