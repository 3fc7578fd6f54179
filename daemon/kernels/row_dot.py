"""One weight row against one activation row, and one activation row quantized, for any quantized
type given as a compile-time literal: the building blocks of the fused decode calls
(moe_decode.py, decode_linears.py). `dot_row` picks matmul_quant's row intrinsic of the type's
family with one token, so a fused call computes what a one-row call of the separate kernels
computes (llama.cpp's vec_dot); `quantize_row` picks the activation quantizer of a vec_dot type.

Legend: E = weight matrices in a stack, N = rows of one, K = input length, T = activation rows.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from daemon.kernels import matmul_activations, matmul_quant, ops, simd_ir
from daemon.kernels import quants as Q
from daemon.kernels.matmul_activations import quantize_row_q8_0_1, quantize_row_q8_K
from daemon.kernels.matmul_float import float_rows
from daemon.kernels.matmul_quant import BLOCK32_KINDS, KQUANT_KINDS, block32_rows, kquant_rows

QUANTIZED = (*BLOCK32_KINDS, *KQUANT_KINDS)
# What a fused call inlines from other files (numba's cache watches only the caller's file): its
# kernels keep this in their closure, so an edit to any of them compiles them again.
SOURCES = matmul_quant._SOURCES + simd_ir.source_stamp(__file__, matmul_activations.__file__, ops.__file__)


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


def _rows_any_kernel():
    """rows_any, a closure over the types (compile-time literals) and SOURCES (numba's cache key
    then changes with the files it inlines)."""
    spec = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.MXFP4, Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16, SOURCES)

    @numba.njit(cache=True)
    def rows_any(kind, w, e, n0, n1, x, xh, xb, q32, d32, s32, qk, dk, bk, t, out):
        """out[n] = dot_row of rows n0..n1-1 of matrix e of w uint8 [E, N, row bytes] against
        activation row t, for a weight type known only at run time (the compiled decode step's
        layers differ). The activation row comes in every form a type may need: x f32 [T, K]
        (F32 weights), xh / xb the same rounded to f16 / bf16 values (F16 / BF16 weights),
        q32/d32/s32 (Q8_0 and Q8_1: int8 values, scales, sums), qk/dk/bk (Q8_K: values,
        super-block scales, block sums). A call per span of rows, not per row: a call
        passes a dozen arrays, and their reference counts are atomics every thread shares."""
        q8_0, q4_0, q5_0, mxfp4, q4_1, q5_1, q4_k, q5_k, q6_k, f32, f16, bf16 = (
            spec[0], spec[1], spec[2], spec[3], spec[4], spec[5], spec[6], spec[7], spec[8], spec[9], spec[10],
            spec[11])
        if kind == q8_0:
            for n in range(n0, n1):
                out[n] = dot_row(q8_0, w, e, n, q32, t, d32, s32)
        elif kind == q4_0:
            for n in range(n0, n1):
                out[n] = dot_row(q4_0, w, e, n, q32, t, d32, s32)
        elif kind == q5_0:
            for n in range(n0, n1):
                out[n] = dot_row(q5_0, w, e, n, q32, t, d32, s32)
        elif kind == mxfp4:
            for n in range(n0, n1):
                out[n] = dot_row(mxfp4, w, e, n, q32, t, d32, s32)
        elif kind == q4_1:
            for n in range(n0, n1):
                out[n] = dot_row(q4_1, w, e, n, q32, t, d32, s32)
        elif kind == q5_1:
            for n in range(n0, n1):
                out[n] = dot_row(q5_1, w, e, n, q32, t, d32, s32)
        elif kind == q4_k:
            for n in range(n0, n1):
                out[n] = dot_row(q4_k, w, e, n, qk, t, dk, bk)
        elif kind == q5_k:
            for n in range(n0, n1):
                out[n] = dot_row(q5_k, w, e, n, qk, t, dk, bk)
        elif kind == q6_k:
            for n in range(n0, n1):
                out[n] = dot_row(q6_k, w, e, n, qk, t, dk, bk)
        elif kind == f32:  # vec_dot's order: a one-row call's
            wf = w[e].view(np.uint32)
            for n in range(n0, n1):
                out[n] = float_rows(f32, 0, 1, wf, n, x, t)[0]
        elif kind == f16:
            wh = w[e].view(np.uint16)
            for n in range(n0, n1):
                out[n] = float_rows(f16, 0, 1, wh, n, xh, t)[0]
        elif kind == bf16:
            wb = w[e].view(np.uint16)
            for n in range(n0, n1):
                out[n] = float_rows(bf16, 0, 1, wb, n, xb, t)[0]
        else:  # the plan admits no other type (DECODE_STEP_TYPES)
            for n in range(n0, n1):
                out[n] = np.nan

    return rows_any


rows_any = _rows_any_kernel()


DECODE_STEP_TYPES = frozenset(QUANTIZED) | {Q.F32, Q.F16, Q.BF16}  # what rows_any computes


def aux_of(xp):
    """The third activation array the row intrinsics read: the Q8_K block sums, the Q8_1 sums, or
    (Q8_0, never read) the scales again."""
    return xp.bsums if xp.vec_dot_type == Q.Q8_K else (xp.s if xp.s is not None else xp.d)
