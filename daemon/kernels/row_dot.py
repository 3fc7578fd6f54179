"""One weight row against one activation row, and one activation row quantized, for any quantized
type given as a compile-time literal: the building blocks of the fused decode calls
(moe_decode.py, decode_linears.py); and `tiles_any`, spans of rows against spans of weight rows
for a type known at run time, the compiled step's matmuls (decode_step.py). `dot_row` picks matmul_quant's row intrinsic of the type's
family with one token, so a fused call computes what a one-row call of the separate kernels
computes (llama.cpp's vec_dot); `quantize_row` picks the activation quantizer of a vec_dot type.

Legend: E = weight matrices in a stack, N = rows of one, K = input length, T = activation rows.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from daemon.kernels import matmul_activations, matmul_float, matmul_quant, ops, simd_ir
from daemon.kernels import quants as Q
from daemon.kernels.matmul_activations import quantize_row_q8_0_1, quantize_row_q8_K
from daemon.kernels.matmul_float import float_span
from daemon.kernels.matmul_quant import (BLOCK32_KINDS, KQUANT_KINDS, block32_rows, block32_span, kquant_rows,
                                          kquant_span)

QUANTIZED = (*BLOCK32_KINDS, *KQUANT_KINDS)
# What a fused call inlines from other files (numba's cache watches only the caller's file): its
# kernels keep this in their closure, so an edit to any of them compiles them again.
SOURCES = matmul_quant._SOURCES + simd_ir.source_stamp(__file__, matmul_activations.__file__, matmul_float.__file__,
                                                      ops.__file__)


def dot_row(kind, stack, e, n, xq, t, xd, xaux):
    """Row n of matrix e of stack uint8 [E, N, row bytes] against row t of the quantized
    activations (xq int8 [T, K], xd their scales, xaux the Q8_1 sums or Q8_K block sums), as a
    one-row vec_dot. kind: the weight type, a literal."""


@overload(dot_row, inline="always", prefer_literal=True)
def _dot_row(kind, stack, e, n, xq, t, xd, xaux):
    if not isinstance(kind, types.IntegerLiteral):
        return None
    if kind.literal_value in KQUANT_KINDS:
        def impl(kind, stack, e, n, xq, t, xd, xaux):
            return kquant_rows(kind, 1, 0, stack, e, n, xq, t, xd, xaux)[0]
        return impl
    if kind.literal_value in BLOCK32_KINDS:
        def impl(kind, stack, e, n, xq, t, xd, xaux):
            return block32_rows(kind, 1, stack, e, n, xq, t, xd, xaux)[0]
        return impl
    return None


def quantize_row(vec_dot_type, x, qs, d, aux):
    """One row x f32 [K] quantized for weights of this vec_dot_type (a literal): Q8_0/Q8_1 (d, aux:
    the block scales and sums) or Q8_K (d, aux: the super-block scales and block sums)."""


@overload(quantize_row, inline="always", prefer_literal=True)
def _quantize_row(vec_dot_type, x, qs, d, aux):
    if not isinstance(vec_dot_type, types.IntegerLiteral):
        return None
    if vec_dot_type.literal_value == Q.Q8_K:
        def impl(vec_dot_type, x, qs, d, aux):
            quantize_row_q8_K(x, qs, d, aux)
        return impl

    def impl(vec_dot_type, x, qs, d, aux):
        quantize_row_q8_0_1(x, qs, d, aux)
    return impl


def _tiles_any_kernel():
    """tiles_any, a closure over the types (compile-time literals) and SOURCES (numba's cache key
    then changes with the files it inlines)."""
    spec = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.MXFP4, Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16, SOURCES)

    @numba.njit(cache=True)
    def tiles_any(kind, path, w, e, n0, n1, x, xh, xb, q32, d32, s32, qk, dk, bk, t0, t1, out):
        """out[t, n] for activation rows t0..t1-1 against rows n0..n1-1 of matrix e of w uint8
        [E, N, row bytes], for a weight type known only at run time (the compiled step's layers
        differ), the rows computed together as one call of the separate kernels computes them:
        path 1 takes llama.cpp's tiled K-quant kernel or tinyBLAS for float weights (which_path),
        0 vec_dot. The activation rows come in every form a type may need: x f32 [T, K] (F32
        weights), xh / xb the same rounded to f16 / bf16 values (F16 / BF16 weights),
        q32/d32/s32 (Q8_0 and Q8_1: int8 values, scales, sums), qk/dk/bk (Q8_K: values,
        super-block scales, block sums). A call per span of rows, not per row: a call passes a
        dozen arrays, and their reference counts are atomics every thread shares."""
        q8_0, q4_0, q5_0, mxfp4, q4_1, q5_1, q4_k, q5_k, q6_k, f32, f16, bf16 = (
            spec[0], spec[1], spec[2], spec[3], spec[4], spec[5], spec[6], spec[7], spec[8], spec[9], spec[10],
            spec[11])
        if kind == q8_0:
            block32_span(q8_0, w, e, n0, n1, q32, d32, s32, t0, t1, out)
        elif kind == q4_0:
            block32_span(q4_0, w, e, n0, n1, q32, d32, s32, t0, t1, out)
        elif kind == q5_0:
            block32_span(q5_0, w, e, n0, n1, q32, d32, s32, t0, t1, out)
        elif kind == mxfp4:
            block32_span(mxfp4, w, e, n0, n1, q32, d32, s32, t0, t1, out)
        elif kind == q4_1:
            block32_span(q4_1, w, e, n0, n1, q32, d32, s32, t0, t1, out)
        elif kind == q5_1:
            block32_span(q5_1, w, e, n0, n1, q32, d32, s32, t0, t1, out)
        elif kind == q4_k:
            kquant_span(q4_k, path, w, e, n0, n1, qk, dk, bk, t0, t1, out)
        elif kind == q5_k:
            kquant_span(q5_k, path, w, e, n0, n1, qk, dk, bk, t0, t1, out)
        elif kind == q6_k:
            kquant_span(q6_k, path, w, e, n0, n1, qk, dk, bk, t0, t1, out)
        elif kind == f32:
            float_span(f32, path, w[e].view(np.uint32), n0, n1, x, t0, t1, out)
        elif kind == f16:
            float_span(f16, path, w[e].view(np.uint16), n0, n1, xh, t0, t1, out)
        elif kind == bf16:
            float_span(bf16, path, w[e].view(np.uint16), n0, n1, xb, t0, t1, out)
        else:  # the plan admits no other type (DECODE_STEP_TYPES)
            out[t0:t1, n0:n1] = np.nan

    return tiles_any


tiles_any = _tiles_any_kernel()


@numba.njit(cache=True)
def is_kquant(kind):
    """Whether the weight type (known at run time) is a K-quant (its activations: Q8_K)."""
    return kind == Q.Q4_K or kind == Q.Q5_K or kind == Q.Q6_K


@numba.njit(cache=True)
def which_path(kind, rows, n, k, expert):
    """The path llama.cpp's CPU takes for an op of this many activation rows (matmul.py's "Path
    choice"): 1 for the tiled K-quant kernel (8 rows or more) or tinyBLAS (float weights, an
    ordinary matmul of 2 rows or more, n % 4 == 0, k % 8 == 0), else 0 (vec_dot)."""
    if is_kquant(kind):
        return 1 if rows >= 8 else 0
    if kind == Q.F32 or kind == Q.F16 or kind == Q.BF16:
        return 1 if (not expert and rows >= 2 and n % 4 == 0 and k % 8 == 0) else 0
    return 0


DECODE_STEP_TYPES = frozenset(QUANTIZED) | {Q.F32, Q.F16, Q.BF16}  # what tiles_any computes


def aux_of(xp):
    """The third activation array the row intrinsics read: the Q8_K block sums, the Q8_1 sums, or
    (Q8_0, never read) the scales again."""
    return xp.bsums if xp.vec_dot_type == Q.Q8_K else (xp.s if xp.s is not None else xp.d)
