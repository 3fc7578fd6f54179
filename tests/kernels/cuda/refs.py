"""Float64 references for the CUDA matmul tests, written from the ggml / llama.cpp definitions
(gguf.quants.dequantize for weights, llama.cpp's q8_1 for activations), never from the kernels."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gq

from daemon.kernels import quants as Q
from tests.kernels.test_quants import random_blocks

QUANT = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOAT = [Q.F32, Q.F16, Q.BF16]
ALL = QUANT + FLOAT
NAMES = {t: Q.type_name(t) for t in ALL}
QK_K_TYPES = {Q.Q4_K, Q.Q5_K, Q.Q6_K}


def weights(qt: int, shape: tuple[int, ...], k: int, rng) -> np.ndarray:
    """Random raw ggml rows uint8 [*shape, row_bytes] with sane scales (finite values)."""
    if qt == Q.BF16:
        return (rng.standard_normal(shape + (k,)).astype(np.float32).view(np.uint32)
                >> np.uint32(16)).astype(np.uint16).view(np.uint8).reshape(shape + (2 * k,))
    return random_blocks(qt, shape, k, rng)


def dequant(raw: np.ndarray, qt: int) -> np.ndarray:
    """float64 [..., K] through gguf.quants.dequantize."""
    return gq.dequantize(raw, GGMLQuantizationType(qt)).astype(np.float64)


def q8_1(x: np.ndarray):
    """q8_1 of float32 rows [R, K] -> (q int8 [R, K], d [R, K/32], s [R, K/32]) with d and s
    rounded to fp16 (as stored), float32. s = d * sum(q), as ggml's CPU q8_1 (quantize.py says why
    not llama.cpp CUDA's sum(x))."""
    r, k = x.shape
    b = x.reshape(r, k // 32, 32)
    amax = np.abs(b).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = (b / d[..., None]).astype(np.float32)
    q = np.sign(y) * np.floor(np.abs(y.astype(np.float64)) + 0.5)  # roundf: half away from 0
    q = np.where(amax[..., None] == 0, 0, q).astype(np.int8).reshape(r, k)
    s = d.astype(np.float64) * q.reshape(r, k // 32, 32).astype(np.float64).sum(axis=2)
    return q, d.astype(np.float16).astype(np.float32), s.astype(np.float16).astype(np.float32)


def _f16_field(raw_blocks: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(raw_blocks[..., off:off + 2]).view(np.float16)[..., 0].astype(
        np.float64)


def block_offsets(raw: np.ndarray, qt: int) -> np.ndarray | None:
    """Per-block constant part of the weights that llama.cpp dots with the q8_1 block sum s
    instead of with the quantized values: Q4_0 -8d, Q5_0 -16d, Q4_1/Q5_1 m. [..., B] or None."""
    if qt not in (Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1):
        return None
    qk, bb = Q.block_size(qt)
    blocks = raw.reshape(raw.shape[:-1] + (raw.shape[-1] // bb, bb))
    if qt == Q.Q4_0:
        return -8 * _f16_field(blocks, 0)
    if qt == Q.Q5_0:
        return -16 * _f16_field(blocks, 0)
    return _f16_field(blocks, 2)


def matvec(raw: np.ndarray, qt: int, x: np.ndarray, act=None, exact_sums=False) -> np.ndarray:
    """Expected out[R, N] = x[R, K] . W[N, K]^T as the kernels define it, in float64.
    Float weights take x as is; quantized ones its q8_1 form `act` = q8_1(x), the offset terms
    of the 32-value types dotted with the stored block sums s as llama.cpp's GEMV does, or with
    the quantized activations themselves (exact_sums: the tiled kernel)."""
    w = dequant(raw, qt)
    if qt in FLOAT:
        return x.astype(np.float64) @ w.T
    q, d, s = act if act is not None else q8_1(x)
    r, k = q.shape
    qb = q.reshape(r, k // 32, 32).astype(np.float64)
    xq = (qb * d[..., None].astype(np.float64)).reshape(r, k)
    out = xq @ w.T
    off = None if exact_sums else block_offsets(raw, qt)
    if off is not None:  # [N, B]: s instead of sum(q) d for the offsets
        out += (s.astype(np.float64) - qb.sum(axis=2) * d) @ off.T
    return out


def magnitude(raw: np.ndarray, qt: int, x: np.ndarray) -> np.ndarray:
    """sum_j |w_j x_j| per output [R, N]: the scale of float32 rounding in a dot product."""
    return np.abs(x.astype(np.float64)) @ np.abs(dequant(raw, qt)).T
