"""Activations -> q8_1 blocks on the GPU, once per layer input (shared by gate and up).

q8_1 per block of 32 values x, as llama.cpp's quantize.cu except for s:
    amax = max |x|,  d = amax / 127,  q = round(x / d) (half away from zero; 0 when amax == 0),
    s = d * sum(q), d and s stored as fp16.
The int8 dot kernels use d for the q * q sums and s where a weight type adds a per-block offset
(Q4_0's -8, Q5_0's -16, Q4_1/Q5_1's min). llama.cpp's CUDA backend takes s = sum(x) of the float
values; ggml's CPU q8_1 takes d * sum(q), so that the offset meets the same quantized x as the
quants do. The CPU's is the more accurate: with s = sum(x) the error of x's quantization is dotted
with the weights' unsigned quants (0..15, biased) instead of with the centred weights, and on
SmolLM2-135M's Q4_1 projections (small activations) that made each projection 3.5x farther from
float64 (4.4% vs 1.3% relative error for attn_v of layer 0) and the logits 28% from the CPU's.

Stored planar rather than as 36-byte blocks, so that the quants of any 16 values are one aligned
128-bit load:
    qs: int8    [R, K]          the quants
    ds: float32 [R, K/32, 2]    (d, s), each already rounded to fp16 (llama.cpp's half2), kept
                                as float32 so kernels need no half arithmetic

Legend: R = activation rows (tokens, or token x expert pairs for the down projection),
K = values per row (a multiple of 32).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .ptx import round_f16, warp_max, warp_sum
from .launch import launch

QK8_1 = 32
_U = np.uint32  # kernels index with unsigned values (store_q8_1)
_THREADS = 256  # 8 q8_1 blocks per thread block


@cuda.jit(device=True, inline=True)
def q8_1_quant(v, amax, valid):
    """The quant of v in a block whose max |x| is amax (0 for an invalid lane or amax 0): round
    half away from zero, as selects (no branch), so a thread's several blocks interleave."""
    ok = valid and amax != np.float32(0.0)
    y = v / (amax / np.float32(127.0)) if ok else np.float32(0.0)
    q = np.float32(int(y))  # toward zero
    frac = y - q  # exact: |y| <= 127
    return q + (np.float32(1.0) if frac >= np.float32(0.5) else
                (np.float32(-1.0) if frac <= np.float32(-0.5) else np.float32(0.0)))


@cuda.jit(device=True, inline=True)
def store_q8_1(q, amax, total, valid, qs, ds, r, c):
    """Lane c % 32 of the warp holding one q8_1 block of row r: its quant q into qs[r, c] and,
    from the block's first lane, (d, s) into ds[r, c // 32]; amax and total (the sum of the
    block's quants) are the warp's reductions. An invalid lane stores nothing. r and c are
    unsigned (np.uint32 arithmetic): signed indices cost each access a negative-index fix-up."""
    if valid:
        qs[r, c] = np.int8(q)
        if c % _U(QK8_1) == _U(0):
            d = amax / np.float32(127.0)
            b = c // _U(QK8_1)
            ds[r, b, _U(0)] = round_f16(d)
            ds[r, b, _U(1)] = round_f16(d * total)


@cuda.jit
def _quantize_q8_1(x, qs, ds, n):
    # x: float32 [R, K] -> qs: int8 [R, K], ds: float32 [R, K/32, 2]; one thread per value,
    # one warp per q8_1 block. Every thread reaches the warp reductions (none returns early).
    i = _U(cuda.grid(1))
    k = _U(x.shape[1])
    valid = i < _U(n)
    r = i // k if valid else _U(0)
    c = i - r * k if valid else _U(0)
    v = x[r, c] if valid else np.float32(0.0)
    amax = warp_max(abs(v), 32)
    q = q8_1_quant(v, amax, valid)
    total = warp_sum(q, 32)  # of the quants: exact in float32 (|total| <= 32 * 127)
    store_q8_1(q, amax, total, valid, qs, ds, r, c)


def quantize_q8_1(x, qs=None, ds=None, stream=0):
    """Quantize activation rows to q8_1 on the device.

    x: float32 device array [R, K], C-contiguous, K a multiple of 32.
    qs / ds: optional outputs (int8 [R, K], float32 [R, K/32, 2]) to reuse across steps.
    Returns (qs, ds)."""
    rows, k = x.shape
    if k % QK8_1:
        raise ValueError(f"q8_1 rows need a multiple of 32 values, got {k}")
    if qs is None:
        qs = cuda.device_array((rows, k), dtype=np.int8, stream=stream)
    if ds is None:
        ds = cuda.device_array((rows, k // QK8_1, 2), dtype=np.float32, stream=stream)
    n = rows * k
    if n:
        launch(_quantize_q8_1, (n + _THREADS - 1) // _THREADS, _THREADS, stream, x, qs, ds, n)
    return qs, ds
