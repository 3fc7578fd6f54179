"""One weight row against one activation row, and one activation row quantized, for any quantized
type given as a compile-time literal: the building blocks of the fused decode calls
(moe_decode.py, decode_linears.py). `dot_row` picks matmul_quant's row intrinsic of the type's
family with one token, so a fused call computes what a one-row call of the separate kernels
computes (llama.cpp's vec_dot); `quantize_row` picks the activation quantizer of a vec_dot type.

Legend: E = weight matrices in a stack, N = rows of one, K = input length, T = activation rows.
"""

from __future__ import annotations

from numba import types
from numba.extending import overload

from daemon.kernels import matmul_activations, matmul_quant, ops, simd_ir
from daemon.kernels import quants as Q
from daemon.kernels.matmul_activations import quantize_row_q8_0_1, quantize_row_q8_K
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


def aux_of(xp):
    """The third activation array the row intrinsics read: the Q8_K block sums, the Q8_1 sums, or
    (Q8_0, never read) the scales again."""
    return xp.bsums if xp.vec_dot_type == Q.Q8_K else (xp.s if xp.s is not None else xp.d)
