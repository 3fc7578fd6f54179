"""Fused dequant x activation matmuls on the CPU (numba): out[T, N] = x[T, K] @ W[N, K].T

Legend: T = tokens (rows of x), K = input features (ggml ne[0]), N = output rows of W,
B = 32-value blocks per row (K/32), S = 256-value super-blocks per row (K/256).

W is never materialized: `raw` is the uint8 [N, row_bytes] block data (an mmap view is fine; it
is only read). Rows are split over threads with `prange` (contiguous chunks of rows); a thread
takes one weight row at a time and applies it to all T tokens, four tokens per pass over the
row (each block is decoded once for the four), so weight bytes come from memory once per call
whatever T is, and the row stays in L1 between passes.

Two numerics modes:

* ``"float32"`` (reference): each row is dequantized to float32 exactly as `quants.dequantize`
  (bit-identical to gguf.quants) and dotted with x in float64; the float64 sum is rounded to
  float32 once. This equals ``(x.astype(f64) @ dequantize(W).astype(f64).T).astype(f32)`` up to
  summation order in float64.

* ``"ggml"`` (default): llama.cpp's CPU backend (ggml-cpu, x86). x is first converted to the
  weight type's vec_dot_type (ggml-cpu.c type_traits_cpu):

      F32 -> F32       plain float32 dot (float32 accumulation)
      F16 -> F16       x rounded to fp16 (round-to-nearest-even, as F16C), float32 accumulation
      BF16 -> BF16     x rounded to bf16 (GGML_FP32_TO_BF16: RNE, NaN quieted), float32 acc.
      Q4_0, Q5_0, Q8_0, MXFP4 -> Q8_0    Q4_1, Q5_1 -> Q8_1    Q4_K, Q5_K, Q6_K -> Q8_K

  Q8_0/Q8_1 follow the x86 AVX/AVX2 `quantize_row_q8_0/q8_1` (not the scalar _ref):
  amax = max|x|, d = amax/127 (stored fp16), id = 127/amax (0 if amax == 0),
  q = round-half-to-even(x*id) (_mm256_round_ps(_MM_ROUND_NEAREST)); Q8_1 also stores
  s = fp16(d * sum(q)). The _ref versions use id = 1/d and roundf (half away from zero); they
  differ only at exact ties and by an ulp in id.
  Q8_K follows quantize_row_q8_K_ref (which the x86 build also uses): max = the first element
  of largest |x|, iscale = -127/max, q = min(127, nearest_int(iscale*x)) (nearest-even),
  d = 1/iscale (float32), bsums = sums of q over groups of 16.

  The dot products then combine integer block dots with the block scales as
  ggml_vec_dot_<w>_<act> does:
      Q8_0/Q4_0/Q5_0:  sum_b (d_w*d_x)_b * sum_j w_j q_j
      MXFP4:           sum_b (d_x * e8m0_half(e))_b * sum_j kvalue_j q_j
      Q4_1/Q5_1:       sum_b (d_w*d_x)_b * sum_j w_j q_j  +  sum_b m_b * s_b
      Q4_K/Q5_K:       sum_S (d_w*d_x) * sumi - (dmin_w*d_x) * sum_g min_g*(bsum_2g + bsum_2g+1)
                       with sumi = sum_g scale_g * sum_j w_j q_j  (exact int32)
      Q6_K:            sum_S (d_w*d_x) * sum_g scale_g * sum_j (w_j - 32) q_j
  with the fp16 scales converted exactly to float32 and the float32 accumulation over blocks
  in block order, as ggml's generic C code. Every integer (per block, or per super-block
  including the sub-block scales) is exact. ggml's AVX2 code converts 8 lanes of partial
  integer sums to float and FMA-accumulates them, so it differs from this by float rounding
  only (~1e-7 relative).

  The integer block dot products are SIMD code written as LLVM vector IR (numba intrinsics,
  portable: no target-specific intrinsics): see "SIMD block dot products" below.

  Not emulated: llama.cpp's optional CPU "extra" buffer types (repacked Q4_0x8/Q4_Kx8 with
  AMX or the aarch64 repack) and llamafile's sgemm for prefill, which use other summation
  orders; their results agree with the vec_dot path to float rounding.

Speed: `python -m daemon.kernels.matmul` prints GB/s of weight bytes for 2048x2048 matrices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numba
import numpy as np
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir

from daemon.errors import UnsupportedError
from daemon.kernels import quants as Q
from daemon.kernels.quants import dequant_row, rd_f16, round_f16, u32_as_f32

NUMERICS = ("ggml", "float32")

# vec_dot_type of each supported weight type (ggml-cpu.c type_traits_cpu).
VEC_DOT_TYPE: dict[int, int] = {
    Q.F32: Q.F32,
    Q.F16: Q.F16,
    Q.BF16: Q.BF16,
    Q.Q4_0: Q.Q8_0,
    Q.Q5_0: Q.Q8_0,
    Q.Q8_0: Q.Q8_0,
    Q.MXFP4: Q.Q8_0,
    Q.Q4_1: Q.Q8_1,
    Q.Q5_1: Q.Q8_1,
    Q.Q4_K: Q.Q8_K,
    Q.Q5_K: Q.Q8_K,
    Q.Q6_K: Q.Q8_K,
}

# --------------------------------------------------------------------------------------------
# stack scratch arrays (`alloca`, not the heap: no allocation per call and no aliasing with
# the weights or activations)


@intrinsic
def _stack_ptr(typingctx, size, dtype):
    if not isinstance(size, types.IntegerLiteral):
        return None
    n = size.literal_value

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, context.get_value_type(dtype.dtype), size=n)

    return types.CPointer(dtype.dtype)(size, dtype), codegen


# --------------------------------------------------------------------------------------------
# activation quantizers (vec_dot_type conversions)


@numba.njit(cache=True, parallel=True)
def _quantize_q8_0_1(x, qs, d, s):
    """x f32 [T, K] -> qs int8 [T, K], d f32 [T, B] (fp16-rounded), s f32 [T, B] (Q8_1 sums)."""
    T, K = x.shape
    nb = K // 32
    for t in prange(T):
        for b in range(nb):
            o = b * 32
            amax = np.float32(0.0)
            for j in range(32):
                a = abs(x[t, o + j])
                if a > amax:
                    amax = a
            dd = amax / np.float32(127.0)
            idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            isum = 0
            for j in range(32):
                q = np.int32(np.rint(x[t, o + j] * idd))
                qs[t, o + j] = q
                isum += q
            d[t, b] = round_f16(dd)
            s[t, b] = round_f16(dd * np.float32(isum))


@numba.njit(cache=True, parallel=True)
def _quantize_q8_K(x, qs, d, bsums):
    """x f32 [T, K] -> qs int8 [T, K], d f32 [T, S], bsums int32 [T, K/16]."""
    T, K = x.shape
    for t in prange(T):
        for sb in range(K // 256):
            o = sb * 256
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            for j in range(256):
                v = x[t, o + j]
                if abs(v) > amax:
                    amax = abs(v)
                    mx = v
            if amax == 0:
                d[t, sb] = 0
                for j in range(256):
                    qs[t, o + j] = 0
                for g in range(16):
                    bsums[t, sb * 16 + g] = 0
                continue
            iscale = np.float32(-127.0) / mx
            for g in range(16):
                acc = 0
                for j in range(16):
                    q = np.int32(np.rint(iscale * x[t, o + g * 16 + j]))
                    if q > 127:
                        q = 127
                    qs[t, o + g * 16 + j] = q
                    acc += q
                bsums[t, sb * 16 + g] = acc
            d[t, sb] = np.float32(1.0) / iscale


def _round_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_BF16 then back to float32."""
    n = x.view(np.uint32)
    nan = (n & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = (n.astype(np.uint64) + (np.uint64(0x7FFF) + ((n >> np.uint32(16)) & np.uint32(1)))) >> np.uint64(16)
    r = np.where(nan, (n >> np.uint32(16)) | np.uint32(64), r).astype(np.uint32)
    return (r << np.uint32(16)).view(np.float32)


# --------------------------------------------------------------------------------------------
# SIMD block dot products, written as LLVM vector IR
#
# numba leaves LLVM's SLP vectorizer off (numba#8705) and the loop vectorizer cannot do much
# with 16/32-value blocks, so the integer work of one block is emitted directly as portable
# LLVM vector IR (no target intrinsics; on x86 it becomes vpmovsxbw + vpmaddwd + a reduction).
# Each intrinsic takes a weight row (uint8), a byte offset, int8 activation rows and their
# offset, and returns exact int32 dot products.

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def _vt(t, n):
    return ir.VectorType(t, n)


def _const_vec(t, vals):
    return ir.Constant(_vt(t, len(vals)), list(vals))


def _splat_const(t, n, v):
    return _const_vec(t, [v] * n)


def _splat(builder, v, n):
    vec = builder.insert_element(ir.Constant(_vt(v.type, n), ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(_vt(v.type, n), ir.Undefined), _splat_const(_I32, n, 0))


def _data_ptr(context, builder, arrty, arr, off):
    """Pointer to element `off` of a 1-D array."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [off])


def _at(builder, p, off):
    return builder.gep(p, [ir.Constant(_I64, off)]) if off else p


def _load(builder, p, off, vty):
    return builder.load(builder.bitcast(_at(builder, p, off), vty.as_pointer()), align=1)


def _cat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, _const_vec(_I32, range(2 * n)))


def _reduce_add(builder, v):
    fnty = ir.FunctionType(v.type.element, [v.type])
    name = f"llvm.vector.reduce.add.v{v.type.count}i{v.type.element.width}"
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [v])


def _dot_i8(builder, w, x):
    """<n x i8> . <n x i8> -> i32 (exact)."""
    n = w.type.count
    return _reduce_add(builder, builder.mul(builder.sext(w, _vt(_I32, n)), builder.sext(x, _vt(_I32, n))))


def _nibbles(builder, p, off):
    """16 bytes at p+off -> <32 x i8>: low nibbles (values 0..15), then high nibbles."""
    b = _load(builder, p, off, _vt(_I8, 16))
    return _cat(builder, builder.and_(b, _splat_const(_I8, 16, 15)), builder.lshr(b, _splat_const(_I8, 16, 4)))


def _qh_bits(builder, p, off):
    """The 32-bit qh at p+off -> <32 x i8> with bit j of qh as 16 in lane j (else 0)."""
    qh = builder.load(builder.bitcast(_at(builder, p, off), _I32.as_pointer()), align=1)
    v = builder.lshr(_splat(builder, qh, 32), _const_vec(_I32, range(32)))
    v = builder.trunc(builder.and_(v, _splat_const(_I32, 32, 1)), _vt(_I8, 32))
    return builder.shl(v, _splat_const(_I8, 32, 4))


def _e2m1x2(builder, nib):
    """kvalues_mxfp4[nib] for <32 x i8> nibbles: the magnitudes 0,1,2,3,4,6,8,12 of codes 0..7
    are looked up as 4-bit fields of the constant 0xC8643210 (a per-lane variable shift),
    bit 3 is the sign."""
    n = nib.type.count
    c = builder.zext(builder.and_(nib, _splat_const(_I8, n, 7)), _vt(_I32, n))
    mag = builder.lshr(_splat_const(_I32, n, 0xC8643210), builder.shl(c, _splat_const(_I32, n, 2)))
    mag = builder.trunc(builder.and_(mag, _splat_const(_I32, n, 15)), _vt(_I8, n))
    neg = builder.icmp_unsigned("!=", builder.and_(nib, _splat_const(_I8, n, 8)), _splat_const(_I8, n, 0))
    return builder.select(neg, builder.sub(_splat_const(_I8, n, 0), mag), mag)


# 32-value block types: bytes per block and the weight decoder (block pointer -> <32 x i8>)
_B32_BYTES = {8: 34, 2: 18, 3: 20, 6: 22, 7: 24, 39: 17}


def _dec_b32(kind, builder, bp):
    if kind == 8:  # Q8_0
        return _load(builder, bp, 2, _vt(_I8, 32))
    if kind == 2:  # Q4_0
        return builder.sub(_nibbles(builder, bp, 2), _splat_const(_I8, 32, 8))
    if kind == 3:  # Q4_1
        return _nibbles(builder, bp, 4)
    if kind == 6:  # Q5_0
        w = builder.or_(_nibbles(builder, bp, 6), _qh_bits(builder, bp, 2))
        return builder.sub(w, _splat_const(_I8, 32, 16))
    if kind == 7:  # Q5_1
        return builder.or_(_nibbles(builder, bp, 8), _qh_bits(builder, bp, 4))
    if kind == 39:  # MXFP4
        return _e2m1x2(builder, _nibbles(builder, bp, 1))
    raise AssertionError(kind)


def _literal_kind(kind, allowed):
    if not isinstance(kind, types.IntegerLiteral) or kind.literal_value not in allowed:
        return None
    return kind.literal_value


@intrinsic
def _b32dot(typingctx, kind, row, o, xr, ox):
    """<weights of the block at row[o:]>, xr[ox:ox+32]> as exact int32."""
    k = _literal_kind(kind, _B32_BYTES)
    if k is None:
        return None

    def codegen(context, builder, sig, args):
        bp = _data_ptr(context, builder, sig.args[1], args[1], args[2])
        xp = _data_ptr(context, builder, sig.args[3], args[3], args[4])
        return _dot_i8(builder, _dec_b32(k, builder, bp), _load(builder, xp, 0, _vt(_I8, 32)))

    return types.int32(kind, row, o, xr, ox), codegen


@intrinsic
def _b32dot4(typingctx, kind, row, o, x0, x1, x2, x3, ox):
    """As _b32dot for four activation rows, decoding the block once."""
    k = _literal_kind(kind, _B32_BYTES)
    if k is None:
        return None

    def codegen(context, builder, sig, args):
        bp = _data_ptr(context, builder, sig.args[1], args[1], args[2])
        w = _dec_b32(k, builder, bp)
        sums = []
        for i in range(4):
            xp = _data_ptr(context, builder, sig.args[3 + i], args[3 + i], args[7])
            sums.append(_dot_i8(builder, w, _load(builder, xp, 0, _vt(_I8, 32))))
        return context.make_tuple(builder, sig.return_type, sums)

    return types.UniTuple(types.int32, 4)(kind, row, o, x0, x1, x2, x3, ox), codegen


# K-quants: the super-block at row[o:] times 256 Q8_K values. Weights are multiplied by their
# sub-block scale in int16 (exact: at most 31*63 for Q5_K, 32*128 for Q6_K), so the whole
# super-block is one int32 dot sum_g scale_g * <w_g, q_g>, as ggml's integer `sumi`.


def _dec_kq(kind, builder, bp, scp):
    """-> 8 vectors <32 x i16>: weights times their sub-block scales. scp: int16 [8] scales
    (Q4_K/Q5_K, computed by the caller); Q6_K reads its int8 scales from the block."""
    out = []
    if kind in (12, 13):
        qs = 16 if kind == 12 else 48
        qh = _load(builder, bp, 16, _vt(_I8, 32)) if kind == 13 else None
        scv = _load(builder, scp, 0, _vt(_I16, 8))
        for j in range(8):
            c, hi = divmod(j, 2)
            b = _load(builder, bp, qs + 32 * c, _vt(_I8, 32))
            w = builder.lshr(b, _splat_const(_I8, 32, 4)) if hi else builder.and_(b, _splat_const(_I8, 32, 15))
            if kind == 13:
                h = builder.and_(builder.lshr(qh, _splat_const(_I8, 32, j)), _splat_const(_I8, 32, 1))
                w = builder.or_(w, builder.shl(h, _splat_const(_I8, 32, 4)))
            sc = builder.shuffle_vector(scv, scv, _splat_const(_I32, 32, j))
            out.append(builder.mul(builder.zext(w, _vt(_I16, 32)), sc))
        return out
    scv = builder.sext(_load(builder, bp, 192, _vt(_I8, 16)), _vt(_I16, 16))
    for half in range(2):
        for grp in range(4):
            ql = _load(builder, bp, half * 64 + (grp & 1) * 32, _vt(_I8, 32))
            ql = builder.and_(builder.lshr(ql, _splat_const(_I8, 32, 4 * (grp >> 1))), _splat_const(_I8, 32, 15))
            qh = _load(builder, bp, 128 + half * 32, _vt(_I8, 32))
            qh = builder.and_(builder.lshr(qh, _splat_const(_I8, 32, 2 * grp)), _splat_const(_I8, 32, 3))
            q = builder.sub(builder.or_(ql, builder.shl(qh, _splat_const(_I8, 32, 4))), _splat_const(_I8, 32, 32))
            g = half * 8 + grp * 2  # 16-value groups g, g+1
            sc = builder.shuffle_vector(scv, scv, _const_vec(_I32, [g] * 16 + [g + 1] * 16))
            out.append(builder.mul(builder.sext(q, _vt(_I16, 32)), sc))
    return out


def _dot_kq(builder, ws, xp):
    acc = None
    for j, w in enumerate(ws):
        x = builder.sext(_load(builder, xp, 32 * j, _vt(_I8, 32)), _vt(_I32, 32))
        p = builder.mul(builder.sext(w, _vt(_I32, 32)), x)
        acc = p if acc is None else builder.add(acc, p)
    return _reduce_add(builder, acc)


@intrinsic
def _kqdot(typingctx, kind, row, o, sc, xr, ox):
    k = _literal_kind(kind, (12, 13, 14))
    if k is None:
        return None

    def codegen(context, builder, sig, args):
        bp = _data_ptr(context, builder, sig.args[1], args[1], args[2])
        scp = _data_ptr(context, builder, sig.args[3], args[3], ir.Constant(_I64, 0))
        xp = _data_ptr(context, builder, sig.args[4], args[4], args[5])
        return _dot_kq(builder, _dec_kq(k, builder, bp, scp), xp)

    return types.int32(kind, row, o, sc, xr, ox), codegen


@intrinsic
def _kqdot4(typingctx, kind, row, o, sc, x0, x1, x2, x3, ox):
    k = _literal_kind(kind, (12, 13, 14))
    if k is None:
        return None

    def codegen(context, builder, sig, args):
        bp = _data_ptr(context, builder, sig.args[1], args[1], args[2])
        scp = _data_ptr(context, builder, sig.args[3], args[3], ir.Constant(_I64, 0))
        ws = _dec_kq(k, builder, bp, scp)
        sums = [_dot_kq(builder, ws, _data_ptr(context, builder, sig.args[4 + i], args[4 + i], args[8]))
                for i in range(4)]
        return context.make_tuple(builder, sig.return_type, sums)

    return types.UniTuple(types.int32, 4)(kind, row, o, sc, x0, x1, x2, x3, ox), codegen


# --------------------------------------------------------------------------------------------
# ggml numerics: 32-value block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4) against Q8_0/Q8_1
#
# Per token: sumf = sum_b float(sumi_b) * (d_w,b * d_x,b) (+ sum_b m_w,b * s_x,b), accumulated
# block by block in float32 like ggml's generic code. The helpers are inlined at the numba
# level and called with a constant type id, so each type's loop is straight-line code.


@numba.njit(cache=True, inline="always")
def _hdr_b32(qt, row, o):
    """(d, m) of the block at row[o:]."""
    if qt == 39:
        return Q._E8M0_HALF[row[o]], np.float32(0.0)
    if qt == 3 or qt == 7:
        return rd_f16(row, o), rd_f16(row, o + 2)
    return rd_f16(row, o), np.float32(0.0)


@numba.njit(cache=True, inline="always")
def _bdot(qt, row, o, xr, ox):
    if qt == 8:
        return _b32dot(8, row, o, xr, ox)
    if qt == 2:
        return _b32dot(2, row, o, xr, ox)
    if qt == 3:
        return _b32dot(3, row, o, xr, ox)
    if qt == 6:
        return _b32dot(6, row, o, xr, ox)
    if qt == 7:
        return _b32dot(7, row, o, xr, ox)
    return _b32dot(39, row, o, xr, ox)


@numba.njit(cache=True, inline="always")
def _bdot4(qt, row, o, x0, x1, x2, x3, ox):
    if qt == 8:
        return _b32dot4(8, row, o, x0, x1, x2, x3, ox)
    if qt == 2:
        return _b32dot4(2, row, o, x0, x1, x2, x3, ox)
    if qt == 3:
        return _b32dot4(3, row, o, x0, x1, x2, x3, ox)
    if qt == 6:
        return _b32dot4(6, row, o, x0, x1, x2, x3, ox)
    if qt == 7:
        return _b32dot4(7, row, o, x0, x1, x2, x3, ox)
    return _b32dot4(39, row, o, x0, x1, x2, x3, ox)


@numba.njit(cache=True, inline="always")
def _rows_b32(qt, raw, n0, n1, xq, xd, xs, out):
    T = xq.shape[0]
    nb = xd.shape[1]
    bb = 34 if qt == 8 else (18 if qt == 2 else (20 if qt == 3 else (22 if qt == 6 else (24 if qt == 7 else 17))))
    has_min = qt == 3 or qt == 7
    T4 = T - T % 4
    for n in range(n0, n1):
        row = raw[n]
        # four tokens at a time: each block decoded once; per token the same operations, in
        # the same order, as the one-token loop below (batch invariance)
        for t in range(0, T4, 4):
            x0, x1, x2, x3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            m0 = m1 = m2 = m3 = np.float32(0.0)
            for b in range(nb):
                o = b * bb
                dw, mw = _hdr_b32(qt, row, o)
                s0, s1, s2, s3 = _bdot4(qt, row, o, x0, x1, x2, x3, b * 32)
                a0 += np.float32(s0) * (dw * xd[t, b])
                a1 += np.float32(s1) * (dw * xd[t + 1, b])
                a2 += np.float32(s2) * (dw * xd[t + 2, b])
                a3 += np.float32(s3) * (dw * xd[t + 3, b])
                if has_min:
                    m0 += mw * xs[t, b]
                    m1 += mw * xs[t + 1, b]
                    m2 += mw * xs[t + 2, b]
                    m3 += mw * xs[t + 3, b]
            out[t, n] = a0 + m0
            out[t + 1, n] = a1 + m1
            out[t + 2, n] = a2 + m2
            out[t + 3, n] = a3 + m3
        for t in range(T4, T):
            xr = xq[t]
            a = np.float32(0.0)
            m = np.float32(0.0)
            for b in range(nb):
                o = b * bb
                dw, mw = _hdr_b32(qt, row, o)
                a += np.float32(_bdot(qt, row, o, xr, b * 32)) * (dw * xd[t, b])
                if has_min:
                    m += mw * xs[t, b]
            out[t, n] = a + m


@numba.njit(cache=True, parallel=True)
def _mm_b32(qt, raw, xq, xd, xs, out, nchunks):
    N = raw.shape[0]
    for c in prange(nchunks):
        n0 = c * N // nchunks
        n1 = (c + 1) * N // nchunks
        if qt == 8:
            _rows_b32(8, raw, n0, n1, xq, xd, xs, out)
        elif qt == 2:
            _rows_b32(2, raw, n0, n1, xq, xd, xs, out)
        elif qt == 3:
            _rows_b32(3, raw, n0, n1, xq, xd, xs, out)
        elif qt == 6:
            _rows_b32(6, raw, n0, n1, xq, xd, xs, out)
        elif qt == 7:
            _rows_b32(7, raw, n0, n1, xq, xd, xs, out)
        else:
            _rows_b32(39, raw, n0, n1, xq, xd, xs, out)


# --------------------------------------------------------------------------------------------
# ggml numerics: K-quants (Q4_K, Q5_K, Q6_K) against Q8_K
#
# Per token and super-block: sumf += (d_w*d_x) * sumi - (dmin_w*d_x) * summ, with
# sumi = sum_g scale_g <w_g, q_g> (exact int32) and summ = sum_g min_g * (bsum_2g + bsum_2g+1).


@numba.njit(cache=True, inline="always")
def _kdot(qt, row, o, sc, xr, ox):
    if qt == 12:
        return _kqdot(12, row, o, sc, xr, ox)
    if qt == 13:
        return _kqdot(13, row, o, sc, xr, ox)
    return _kqdot(14, row, o, sc, xr, ox)


@numba.njit(cache=True, inline="always")
def _kdot4(qt, row, o, sc, x0, x1, x2, x3, ox):
    if qt == 12:
        return _kqdot4(12, row, o, sc, x0, x1, x2, x3, ox)
    if qt == 13:
        return _kqdot4(13, row, o, sc, x0, x1, x2, x3, ox)
    return _kqdot4(14, row, o, sc, x0, x1, x2, x3, ox)


@numba.njit(cache=True, inline="always")
def _kq_summ(mins, bs, s):
    summ = np.int32(0)
    for g in range(8):
        summ += mins[g] * (bs[s * 16 + 2 * g] + bs[s * 16 + 2 * g + 1])
    return summ


@numba.njit(cache=True, inline="always")
def _rows_kq(qt, raw, n0, n1, xq, xd, xbs, out):
    T = xq.shape[0]
    ns = xd.shape[1]
    bb = 144 if qt == 12 else (176 if qt == 13 else 210)
    sc = numba.carray(_stack_ptr(8, np.int16), (8,))
    mins = numba.carray(_stack_ptr(8, np.int32), (8,))
    T4 = T - T % 4
    for n in range(n0, n1):
        row = raw[n]
        for t in range(0, T4, 4):
            x0, x1, x2, x3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for s in range(ns):
                o = s * bb
                if qt == 14:
                    dw = rd_f16(row, o + 208)
                    dmw = np.float32(0.0)
                else:
                    dw = rd_f16(row, o)
                    dmw = rd_f16(row, o + 2)
                    for g in range(8):
                        scg, mg = Q._scale_min_k4(row, o + 4, g)
                        sc[g] = scg
                        mins[g] = mg
                s0, s1, s2, s3 = _kdot4(qt, row, o, sc, x0, x1, x2, x3, s * 256)
                a0 += (dw * xd[t, s]) * np.float32(s0)
                a1 += (dw * xd[t + 1, s]) * np.float32(s1)
                a2 += (dw * xd[t + 2, s]) * np.float32(s2)
                a3 += (dw * xd[t + 3, s]) * np.float32(s3)
                if qt != 14:
                    a0 -= (dmw * xd[t, s]) * np.float32(_kq_summ(mins, xbs[t], s))
                    a1 -= (dmw * xd[t + 1, s]) * np.float32(_kq_summ(mins, xbs[t + 1], s))
                    a2 -= (dmw * xd[t + 2, s]) * np.float32(_kq_summ(mins, xbs[t + 2], s))
                    a3 -= (dmw * xd[t + 3, s]) * np.float32(_kq_summ(mins, xbs[t + 3], s))
            out[t, n] = a0
            out[t + 1, n] = a1
            out[t + 2, n] = a2
            out[t + 3, n] = a3
        for t in range(T4, T):
            xr = xq[t]
            a = np.float32(0.0)
            for s in range(ns):
                o = s * bb
                if qt == 14:
                    dw = rd_f16(row, o + 208)
                    dmw = np.float32(0.0)
                else:
                    dw = rd_f16(row, o)
                    dmw = rd_f16(row, o + 2)
                    for g in range(8):
                        scg, mg = Q._scale_min_k4(row, o + 4, g)
                        sc[g] = scg
                        mins[g] = mg
                a += (dw * xd[t, s]) * np.float32(_kdot(qt, row, o, sc, xr, s * 256))
                if qt != 14:
                    a -= (dmw * xd[t, s]) * np.float32(_kq_summ(mins, xbs[t], s))
            out[t, n] = a


@numba.njit(cache=True, parallel=True)
def _mm_kq(qt, raw, xq, xd, xbs, out, nchunks):
    N = raw.shape[0]
    for c in prange(nchunks):
        n0 = c * N // nchunks
        n1 = (c + 1) * N // nchunks
        if qt == 12:
            _rows_kq(12, raw, n0, n1, xq, xd, xbs, out)
        elif qt == 13:
            _rows_kq(13, raw, n0, n1, xq, xd, xbs, out)
        else:
            _rows_kq(14, raw, n0, n1, xq, xd, xbs, out)


# --------------------------------------------------------------------------------------------
# float weights (F32, F16, BF16), both numerics


@intrinsic
def _half_to_f32(typingctx, h):
    """IEEE half bits (low 16 bits of an integer) -> float32 with LLVM's fpext (exact;
    vcvtph2ps on x86, vectorizable)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if h.bitwidth > 16:
            v = builder.trunc(v, _I16)
        elif h.bitwidth < 16:
            v = builder.zext(v, _I16)
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@numba.njit(cache=True)
def _row_to_f32(w, qt, fb):
    """One row of F32 (uint32 bits), F16 or BF16 (uint16 bits) -> float32 fb, exactly."""
    if qt == 0:
        for k in range(w.shape[0]):
            fb[k] = u32_as_f32(w[k])
    elif qt == 30:
        for k in range(w.shape[0]):
            fb[k] = u32_as_f32(np.uint32(w[k]) << np.uint32(16))
    else:
        for k in range(w.shape[0]):
            fb[k] = _half_to_f32(w[k])


@numba.njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _dot32(a, b):
    s = np.float32(0.0)
    for k in range(a.shape[0]):
        s += a[k] * b[k]
    return s


@numba.njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _dot64(a, b):
    s = 0.0
    for k in range(a.shape[0]):
        s += np.float64(a[k]) * np.float64(b[k])
    return s


@numba.njit(cache=True, parallel=True)
def _mm_float(w, qt, x, out, nchunks, acc64):
    N, K = w.shape
    T = x.shape[0]
    for c in prange(nchunks):
        fb = np.empty(K, np.float32)
        for n in range(c * N // nchunks, (c + 1) * N // nchunks):
            _row_to_f32(w[n], qt, fb)
            for t in range(T):
                out[t, n] = _dot64(fb, x[t]) if acc64 else _dot32(fb, x[t])


# --------------------------------------------------------------------------------------------
# float32 numerics for block types: exact dequant per row, float64 dot


@numba.njit(cache=True, parallel=True)
def _mm_ref(raw, qt, K, x, out, nchunks):
    N = raw.shape[0]
    T = x.shape[0]
    for c in prange(nchunks):
        buf = np.empty(K, np.float32)
        for n in range(c * N // nchunks, (c + 1) * N // nchunks):
            dequant_row(raw[n], qt, K, buf)
            for t in range(T):
                out[t, n] = _dot64(buf, x[t])


# --------------------------------------------------------------------------------------------
# Python API


@dataclass(frozen=True)
class Prepared:
    """Activations converted once for every weight of one vec_dot_type.

    numerics: "ggml" or "float32"; vec_dot_type: ggml type id the activations were converted to
    (for "float32" numerics: F32, x untouched). x: float32 [T, K] (for F16/BF16, the rounded
    values). For Q8_0/Q8_1: qs int8 [T, K], d f32 [T, B], s f32 [T, B] (Q8_1 only). For Q8_K:
    qs int8 [T, K], d f32 [T, S], bsums int32 [T, K/16].
    """

    numerics: str
    vec_dot_type: int
    x: np.ndarray
    qs: np.ndarray | None = None
    d: np.ndarray | None = None
    s: np.ndarray | None = None
    bsums: np.ndarray | None = None

    @property
    def T(self) -> int:
        return self.x.shape[0]

    @property
    def K(self) -> int:
        return self.x.shape[1]


def _check_x(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {x.shape}")
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    return np.ascontiguousarray(x)


def prepare(x: np.ndarray, ggml_type: int, numerics: str = "ggml") -> Prepared:
    """Convert activations x [T, K] for weights of ggml_type (and any type sharing its
    vec_dot_type), e.g. once for the gate and up projections of all experts of a layer."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if ggml_type not in Q.SUPPORTED_TYPES:
        raise UnsupportedError(f"unsupported quant type {Q.type_name(ggml_type)}")
    x = _check_x(x)
    T, K = x.shape
    Q.row_bytes(ggml_type, K)  # K must be whole blocks
    if numerics == "float32":
        return Prepared("float32", Q.F32, x)
    vt = VEC_DOT_TYPE[ggml_type]
    if vt == Q.F32:
        return Prepared("ggml", vt, x)
    if vt == Q.F16:
        return Prepared("ggml", vt, _round_f16(x))
    if vt == Q.BF16:
        return Prepared("ggml", vt, _round_bf16(x))
    qs = np.empty((T, K), np.int8)
    if vt == Q.Q8_K:
        d = np.empty((T, K // 256), np.float32)
        bsums = np.empty((T, K // 16), np.int32)
        if T:
            _quantize_q8_K(x, qs, d, bsums)
        return Prepared("ggml", vt, x, qs=qs, d=d, bsums=bsums)
    d = np.empty((T, K // 32), np.float32)
    s = np.empty((T, K // 32), np.float32)
    if T:
        _quantize_q8_0_1(x, qs, d, s)
    return Prepared("ggml", vt, x, qs=qs, d=d, s=s if vt == Q.Q8_1 else None)


def _nchunks(n: int) -> int:
    return max(1, min(n, 4 * numba.get_num_threads()))


def _weight_view(raw: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise TypeError(f"raw must be a 2-D uint8 array, got {raw.dtype} {raw.shape}")
    rb = Q.row_bytes(ggml_type, k)
    if raw.shape[1] != rb:
        raise ValueError(
            f"{Q.type_name(ggml_type)} rows of {k} values are {rb} bytes, raw has {raw.shape[1]}"
        )
    if not raw.flags.c_contiguous:
        raw = np.ascontiguousarray(raw)  # only for odd strided views; slices stacked[e] are not
    if ggml_type == Q.F32:
        raw = raw.view(np.uint32)
    elif ggml_type in (Q.F16, Q.BF16):
        raw = raw.view(np.uint16)
    return Q._readonly(raw)


def linear_prepared(xp: Prepared, raw: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    """out float32 [T, N] = x @ W.T for prepared activations xp and weight raw [N, row_bytes]."""
    if ggml_type not in Q.SUPPORTED_TYPES:
        raise UnsupportedError(f"unsupported quant type {Q.type_name(ggml_type)}")
    if xp.K != k:
        raise ValueError(f"activations have K={xp.K}, weight has k={k}")
    if xp.numerics == "ggml" and VEC_DOT_TYPE[ggml_type] != xp.vec_dot_type:
        raise ValueError(
            f"activations were prepared as {Q.type_name(xp.vec_dot_type)}, "
            f"{Q.type_name(ggml_type)} needs {Q.type_name(VEC_DOT_TYPE[ggml_type])}"
        )
    w = _weight_view(raw, ggml_type, k)
    N = w.shape[0]
    T = xp.T
    out = np.empty((T, N), np.float32)
    if T == 0 or N == 0:
        return out
    nc = _nchunks(N)
    qt = int(ggml_type)
    if ggml_type in Q.FLOAT_TYPES:
        _mm_float(w, qt, xp.x, out, nc, xp.numerics == "float32")
    elif xp.numerics == "float32":
        _mm_ref(w, qt, k, xp.x, out, nc)
    elif ggml_type in Q.KQUANT_TYPES:
        _mm_kq(qt, w, xp.qs, xp.d, xp.bsums, out, nc)
    else:
        xs = xp.s if xp.s is not None else xp.d  # read only for Q8_1
        _mm_b32(qt, w, xp.qs, xp.d, xs, out, nc)
    return out


def linear(
    x: np.ndarray, raw: np.ndarray, ggml_type: int, k: int, numerics: str = "ggml"
) -> np.ndarray:
    """out float32 [T, N] = x [T, K] @ W.T, W given as ggml blocks raw uint8 [N, row_bytes]."""
    return linear_prepared(prepare(x, ggml_type, numerics), raw, ggml_type, k)


# --------------------------------------------------------------------------------------------
# benchmark


def bench(
    types=("Q8_0", "Q4_0", "Q4_1", "Q5_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"),
    n: int = 2048,
    k: int = 2048,
    tokens=(1, 32),
    numerics: str = "ggml",
    seconds: float = 0.5,
) -> list[tuple[str, int, float, float]]:
    """GB/s of weight bytes processed by linear_prepared (activation prep excluded) for n x k
    matrices of random blocks. Returns and prints (type, T, ms per call, GB/s)."""
    rng = np.random.default_rng(0)
    results = []
    print(f"threads={numba.get_num_threads()} N={n} K={k} numerics={numerics}")
    for name in types:
        qt = int(getattr(Q, name))
        rb = Q.row_bytes(qt, k)
        raw = rng.integers(0, 256, size=(n, rb), dtype=np.uint8)
        if qt in Q.FLOAT_TYPES:
            raw = rng.standard_normal((n, k)).astype(np.float32)
            raw = {Q.F32: raw, Q.F16: raw.astype(np.float16)}.get(qt, raw.astype(np.float16))
            raw = np.ascontiguousarray(raw).view(np.uint8)
        else:
            _fix_scales(raw, qt, rng)
        for T in tokens:
            x = rng.standard_normal((T, k)).astype(np.float32)
            xp = prepare(x, qt, numerics)
            linear_prepared(xp, raw, qt, k)  # compile / warm
            reps, t0 = 0, time.perf_counter()
            best = float("inf")
            while time.perf_counter() - t0 < seconds or reps < 3:
                t1 = time.perf_counter()
                linear_prepared(xp, raw, qt, k)
                best = min(best, time.perf_counter() - t1)
                reps += 1
            gbs = raw.nbytes / best / 1e9
            results.append((name, T, best * 1e3, gbs))
            print(f"{name:6s} T={T:4d} {best * 1e3:8.3f} ms  {gbs:6.2f} GB/s  "
                  f"{2 * T * n * k / best / 1e9:7.1f} GOP/s")
    return results


def _fix_scales(raw: np.ndarray, qt: int, rng: np.random.Generator) -> None:
    """Overwrite the fp16 scale fields of random blocks with small finite values (in place)."""
    qk, bb = Q.block_size(qt)
    blk = raw.reshape(raw.shape[0], -1, bb)
    offs = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2),
            Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}.get(qt, ())
    for o in offs:
        v = rng.uniform(1e-3, 1e-1, blk.shape[:-1]).astype(np.float16)
        blk[..., o:o + 2] = v.view(np.uint8).reshape(blk.shape[:-1] + (2,))
    if qt == Q.MXFP4:
        blk[..., 0] = rng.integers(118, 128, blk.shape[:-1], dtype=np.uint8)


if __name__ == "__main__":
    import sys

    nt = int(sys.argv[1]) if len(sys.argv) > 1 else numba.get_num_threads()
    numba.set_num_threads(nt)
    bench()
