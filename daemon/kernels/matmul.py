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

  The dot products then reproduce llama.cpp's x86 (AVX2 + FMA) kernels bit for bit: the
  integer parts are exact, and the float32 products, FMAs and summation ORDER are ggml's, so
  the results are identical to llama.cpp's, not merely close (the 8-bit activation rounding of
  the next layer amplifies any last-bit difference). "Lanes of 4": lane r (0..7) holds the
  exact integer sum of the block's elements 4r..4r+3 (maddubs + madd); hsum8(l) =
  ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) (hsum_float_8, tinyBLAS hsum).

      Q8_0/Q4_0/Q5_0   (ggml_vec_dot_<w>_q8_0 and tinyBLAS_Q0_AVX, the same order)
                       lanes = fma(d_w*d_x, float(lanes of 4), lanes) block after block;
                       result hsum8(lanes)
      Q4_1/Q5_1        the same, plus summs = fma(m_w, s_x, summs) block after block;
                       result hsum8(lanes) + summs
      MXFP4            even blocks in one set of lanes, odd blocks in another
                       (scale d_x * e8m0_half(e)); result hsum8(acc1 + acc2); an odd last
                       block is added as fma(d, float(block sum), result)
      Q4_K/Q5_K/Q6_K   two paths, chosen as llama.cpp does by the op's number of rows (see
                       "Path choice"):
        vec_dot (< 8 rows): per super-block lanes of 4 weighted by the sub-block scales,
            summed as integers (Q6_K: unsigned codes, lane r minus
            32*(sc_2r bsum_2r + sc_2r+1 bsum_2r+1)); acc = fma(d_x*d_w, float(lanes), acc);
            Q4_K: four min lanes m_l = fma(-d_x*dmin, min_2l q8s_2l + min_2l+1 q8s_2l+1, m_l),
            result hsum8(acc) + ((m0+m2)+(m1+m3)); Q5_K: summs = fma(-d_x*dmin,
            sum_g min_g q8s_g, summs), result hsum8(acc) + summs; Q6_K: hsum8(acc)
            (q8s_g = bsum_2g + bsum_2g+1).
        tiled (ggml-cpu/tiled, >= 8 rows): per super-block the integers s1 = sum_g scale_g
            sum_j w_j q_j and s2 = sum_g min_g q8s_g; res = fma(-dmin, s2, d_w*s1) (Q6_K:
            d_w*s1); out = fma(res, d_x, out) super-block after super-block.
      F32/F16/BF16     tinyBLAS (llamafile_sgemm) for ordinary matmuls with >= 2 rows,
                       N % 4 == 0 and K % 8 == 0: lane k % 8 = fma(w_k, x_k, lane), hsum8.
                       Otherwise ggml_vec_dot_f32/f16/bf16: four 8-lane FMA accumulators over
                       steps of 32, (a0+a2)+(a1+a3), then two hadd (F32, F16) or hsum8 (BF16);
                       the K % 32 leftovers in float32 with FMA (F32) or in double (F16/BF16).
                       (F16/BF16 products are exact in float32, so FMA = multiply + add.)

  Path choice and batch invariance: llama.cpp's own result for a token depends, for some
  types, on how many rows the op has, and this module mirrors it:
    * K-quants: tiled when the op has >= 8 rows (ggml_tiled_min_batch): all tokens of an
      ordinary matmul, or, for MoE experts (MUL_MAT_ID), the tokens routed to that expert;
      vec_dot otherwise. Since moe.py calls linear once per expert with exactly its routed
      tokens, "rows" is always the T of the call.
    * F32/F16/BF16: tinyBLAS only for ordinary matmuls (not MUL_MAT_ID, which has no sgemm
      path: pass expert=True) with T >= 2, N % 4 == 0, K % 8 == 0; vec_dot otherwise.
    * the 32-value block types use one order in all paths: batch invariant.
  So with "ggml" numerics a token's output can legitimately differ (in the last bits) between
  a call with T < 8 and one with T >= 8 (K-quants), or T = 1 and T >= 2 (float weights), just
  as in llama.cpp (e.g. prompt processing vs one-token decoding). `solo=True` picks the paths of
  a one-row call for every row: a decode batch of independent sequences then gives each one
  exactly its solo result (batch invariance; Transformer.forward_batch). Within one path a token's
  result never depends on the other tokens (the four-token kernels only share the weight
  decoding). The "float32" numerics are fully batch invariant.

  Not emulated: llama.cpp's optional CPU "extra" buffer types (repacked Q4_0x8/Q4_Kx8 with
  AMX or the aarch64 repack), AVX512/VNNI builds, other tinyBLAS variants (e.g. ARM).

The row loops are SIMD code emitted as LLVM IR by numba intrinsics ("SIMD row kernels"
below): portable vector IR with llvm.fma, plus the AVX2 vpmaddwd/vpshufb intrinsics where the
CPU has AVX2, and with AVX512-VNNI two tokens per 512-bit vector in the four-token block kernels
(same results either way; tests check both).

Speed: `python -m daemon.kernels.matmul [threads]` prints GB/s of weight bytes processed and
GOP/s for 2048x2048 matrices at T=1 and T=32 (and a larger, memory-bound case).

Threading: the kernels run numba parallel regions; with numba's "workqueue" threading layer
they must not be called from two Python threads at once (the "omp" and "tbb" layers allow it).
"""

from __future__ import annotations

import functools
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
from daemon.kernels.quants import dequant_row, round_f16, u32_as_f32

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
# SIMD row kernels, written as LLVM vector IR
#
# numba leaves LLVM's SLP vectorizer off (numba#8705), and its loop vectorizer can do little
# with 16- and 32-value blocks, so the dot product of one weight row with one or four
# activation rows is emitted directly as LLVM IR by numba intrinsics: a loop over blocks whose
# body works on vectors (portable IR, no target intrinsics; on x86 the integer part becomes
# vpmovsxbw + vpmaddwd, fp16 scales become vcvtph2ps). The kernels below only pick the rows.
#
# Per block the integer parts are exact int32 lanes as ggml's AVX2 code has them; they are
# scaled and accumulated with ggml's FMAs in ggml's order (see the module docstring). The
# four-token kernels decode each weight block once and then run the very same per-token
# operations for each of the four tokens, so a token's result does not depend on the tokens
# next to it (only on the path, see "Path choice").

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()


def _vt(t, n):
    return ir.VectorType(t, n)


def _const_vec(t, vals):
    return ir.Constant(_vt(t, len(vals)), list(vals))


def _splat_const(t, n, v):
    return _const_vec(t, [v] * n)


def _c64(v):
    return ir.Constant(_I64, v)


def _splat(builder, v, n):
    vec = builder.insert_element(ir.Constant(_vt(v.type, n), ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(_vt(v.type, n), ir.Undefined), _splat_const(_I32, n, 0))


def _shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, _const_vec(_I32, idx))


def _arr(context, builder, aryty, val):
    return context.make_array(aryty)(context, builder, val)


def _bytes(builder, p, off=None):
    """p as i8*, advanced by off bytes (int or i64 value)."""
    q = builder.bitcast(p, _I8.as_pointer())
    if off is None or (isinstance(off, int) and off == 0):
        return q
    return builder.gep(q, [_c64(off) if isinstance(off, int) else off])


def _load(builder, p, off, ty, align=1):
    """Load a value of type ty at byte offset off of pointer p."""
    return builder.load(builder.bitcast(_bytes(builder, p, off), ty.as_pointer()), align=align)


def _f16(builder, p, off):
    """fp16 at byte offset off -> float32 (fpext: exact)."""
    return builder.fpext(builder.bitcast(_load(builder, p, off, _I16), ir.HalfType()), _F32)


def _e8m0_half(builder, p, off):
    """ggml_e8m0_to_fp32_half of the byte at p+off."""
    e = builder.zext(_load(builder, p, off, _I8), _I32)
    den = builder.shl(ir.Constant(_I32, 0x00200000), e)
    nor = builder.shl(builder.sub(e, ir.Constant(_I32, 1)), ir.Constant(_I32, 23))
    bits = builder.select(builder.icmp_unsigned("<", e, ir.Constant(_I32, 2)), den, nor)
    return builder.bitcast(bits, _F32)


def _cat(builder, a, b):
    return _shuffle(builder, a, b, range(2 * a.type.count))


def _nibbles(builder, p, off):
    """16 bytes at p+off -> <32 x i8>: the low nibbles (0..15), then the high nibbles."""
    b = _load(builder, p, off, _vt(_I8, 16))
    return _cat(builder, builder.and_(b, _splat_const(_I8, 16, 15)), builder.lshr(b, _splat_const(_I8, 16, 4)))


def _qh_bits(builder, p, off):
    """The 32-bit qh at p+off -> <32 x i8> holding 16 in lane j where bit j of qh is set
    (byte j//8 of qh spread over 8 lanes, tested against 1 << (j % 8))."""
    qh = builder.bitcast(_load(builder, p, off, _I32), _vt(_I8, 4))
    spread = _shuffle(builder, qh, qh, [j // 8 for j in range(32)])
    bit = builder.and_(spread, _const_vec(_I8, [1 << (j % 8) for j in range(32)]))
    on = builder.icmp_unsigned("!=", bit, _splat_const(_I8, 32, 0))
    return builder.select(on, _splat_const(_I8, 32, 16), _splat_const(_I8, 32, 0))


def _e2m1x2(context, builder, nib):
    """kvalues_mxfp4[nib] for <32 x i8> nibbles. With AVX2 a table lookup (vpshufb); else
    computed: codes 0..7 are the magnitudes 0,1,2,3 (c < 4), 4,6 (= (2 + (c & 1)) << 1) and
    8,12 (= (2 + (c & 1)) << 2), bit 3 is the sign."""
    n = nib.type.count
    if _has_avx2(context) and n == 32:
        fnty = ir.FunctionType(_vt(_I8, 32), [_vt(_I8, 32), _vt(_I8, 32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx2.pshuf.b")
        table = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12] * 2
        return builder.call(fn, [_const_vec(_I8, [v & 0xFF for v in table]), nib])

    def k(v):
        return _splat_const(_I8, n, v)

    c = builder.and_(nib, k(7))
    m = builder.add(k(2), builder.and_(c, k(1)))
    big = builder.select(builder.icmp_unsigned("!=", builder.and_(c, k(2)), k(0)),
                         builder.shl(m, k(2)), builder.shl(m, k(1)))
    mag = builder.select(builder.icmp_unsigned("<", c, k(4)), c, big)
    neg = builder.icmp_unsigned("!=", builder.and_(nib, k(8)), k(0))
    return builder.select(neg, builder.sub(k(0), mag), mag)


def _has_avx2(context):
    return "+avx2" in getattr(context.codegen(), "_tm_features", "")


def _has_avx512_vnni(context):
    """512-bit integer dot products (vpdpbusd on zmm): two tokens' blocks per instruction."""
    f = getattr(context.codegen(), "_tm_features", "")
    return all(x in f for x in ("+avx512f", "+avx512bw", "+avx512vnni"))



def _fma(builder, a, b, c):
    """llvm.fma (one rounding, as x86 vfmadd) on float32 scalars or vectors."""
    t = a.type
    name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), name)
    return builder.call(fn, [a, b, c])


def _lane(builder, v, i):
    return builder.extract_element(v, ir.Constant(_I32, i))


def _hsum8f(builder, v):
    """<8 x float> -> float as hsum_float_8 / tinyBLAS hsum: high half + low half, movehl,
    movehdup: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    h = builder.fadd(_shuffle(builder, v, v, [4, 5, 6, 7]), _shuffle(builder, v, v, [0, 1, 2, 3]))
    return builder.fadd(builder.fadd(_lane(builder, h, 0), _lane(builder, h, 2)),
                        builder.fadd(_lane(builder, h, 1), _lane(builder, h, 3)))


def _hadd8f(builder, v):
    """<8 x float> -> float as the end of GGML_F32x8_REDUCE (low + high half, two hadd_ps):
    ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7))."""
    h = builder.fadd(_shuffle(builder, v, v, [0, 1, 2, 3]), _shuffle(builder, v, v, [4, 5, 6, 7]))
    return builder.fadd(builder.fadd(_lane(builder, h, 0), _lane(builder, h, 1)),
                        builder.fadd(_lane(builder, h, 2), _lane(builder, h, 3)))


def _pairadd(builder, v):
    """<2n x iN> -> <n x iN>: lane j = v[2j] + v[2j+1]."""
    n = v.type.count
    return builder.add(_shuffle(builder, v, v, range(0, n, 2)), _shuffle(builder, v, v, range(1, n, 2)))


def _avx2_fn(builder, name, ret, *args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def _quads(context, builder, w, x, unsigned):
    """<32 x i8> w (unsigned: 0..127 codes, else signed) . <32 x i8> x -> <8 x i32>, lane r =
    sum_{e=4r..4r+3} w_e x_e, exact (as ggml's maddubs + madd). With AVX2 vpmaddubsw (after
    the vpsignb trick for signed w: no pair exceeds 2*128*127, no saturation) + vpmaddwd with
    ones; else portable multiplies and pairwise adds."""
    if _has_avx2(context):
        v16 = _vt(_I16, 16)
        if not unsigned:
            x = _avx2_fn(builder, "llvm.x86.avx2.psign.b", w.type, x, w)
            w = _avx2_fn(builder, "llvm.x86.avx2.psign.b", w.type, w, w)
        p16 = _avx2_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, w, x)
        return _avx2_fn(builder, "llvm.x86.avx2.pmadd.wd", _vt(_I32, 8), p16, _splat_const(_I16, 16, 1))
    ext = builder.zext if unsigned else builder.sext
    p = builder.mul(ext(w, _vt(_I32, 32)), builder.sext(x, _vt(_I32, 32)))
    return _pairadd(builder, _pairadd(builder, p))


def _hsum(builder, v):
    fnty = ir.FunctionType(v.type.element, [v.type])
    name = f"llvm.vector.reduce.add.v{v.type.count}i{v.type.element.width}"
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [v])


def _literal(kind, allowed):
    if not isinstance(kind, types.IntegerLiteral) or kind.literal_value not in allowed:
        return None
    return kind.literal_value


def _is_c(*arrs):
    return all(isinstance(a, types.Array) and a.layout == "C" for a in arrs)


def _rows_of(context, builder, aryty, ary, t0, m):
    """Data pointers (i8*) of rows t0 .. t0+m-1 of a C-contiguous 2-D array."""
    a = _arr(context, builder, aryty, ary)
    s0 = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    return [_bytes(builder, a.data, builder.mul(builder.add(t0, _c64(i)), s0)) for i in range(m)], a


def _ldf(builder, p, idx):
    """float32 element idx (i64) of the float array at i8* p."""
    return _load(builder, p, builder.mul(idx, _c64(4)), _F32, 4)


# ---- 32-value block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 (activations Q8_0 / Q8_1) ----
#
# As ggml_vec_dot_<w>_q8_0/q8_1 (AVX2) and tinyBLAS_Q0_AVX (same order): per block eight int32
# lanes, lane r = the exact sum of w_e q_e over e = 4r..4r+3 (maddubs + madd with ones), then
# acc = fma(splat(d_w*d_x), float(lanes), acc) in eight float lanes, block after block;
# result hsum_float_8(acc). Q4_1/Q5_1: + summs, summs = fma(m_w, s_x, summs) block after block
# (GCC contracts `summs += m*s`). MXFP4: even blocks in one accumulator, odd ones in another,
# hsum_float_8(acc1 + acc2); an odd last block is added as fma(d, float(sumi), sum).

_B32_BYTES = {8: 34, 2: 18, 3: 20, 6: 22, 7: 24, 39: 17}


def _dec_b32(k, context, builder, bp):
    """The 32 weights of the block at bp as <32 x i8>."""
    if k == 8:  # Q8_0
        return _load(builder, bp, 2, _vt(_I8, 32))
    if k == 2:  # Q4_0
        return builder.sub(_nibbles(builder, bp, 2), _splat_const(_I8, 32, 8))
    if k == 3:  # Q4_1
        return _nibbles(builder, bp, 4)
    if k == 6:  # Q5_0
        w = builder.or_(_nibbles(builder, bp, 6), _qh_bits(builder, bp, 2))
        return builder.sub(w, _splat_const(_I8, 32, 16))
    if k == 7:  # Q5_1
        return builder.or_(_nibbles(builder, bp, 8), _qh_bits(builder, bp, 4))
    return _e2m1x2(context, builder, _nibbles(builder, bp, 1))  # MXFP4


def _hdr_b32(k, builder, bp):
    """(d, m) of the block at bp; m is None for types without a min."""
    if k == 39:
        return _e8m0_half(builder, bp, 0), None
    if k in (3, 7):
        return _f16(builder, bp, 0), _f16(builder, bp, 2)
    return _f16(builder, bp, 0), None


def _block_pairs(builder, k, w, dw, b, xrows, drows, accs):
    """Block b of tokens (2p, 2p+1) for each pair p: acc_p = fma(dw*d_x as 8+8 lanes, the two
    tokens' exact int32 lanes, acc_p). The lanes are those of _quads (vpdpbusd with |w| and x
    negated where w < 0, i.e. the vpsignb trick; lanes where w == 0 multiply by 0 either way)."""
    v64 = _vt(_I8, 64)
    if k in (3, 7):  # unsigned codes
        w2 = _cat(builder, w, w)
        neg2 = None
    else:
        neg = builder.icmp_signed("<", w, ir.Constant(w.type, [0] * 32))
        wa = _avx2_fn(builder, "llvm.x86.avx2.psign.b", w.type, w, w)
        w2 = _cat(builder, wa, wa)
        neg2 = _cat(builder, neg, neg)
    zero16 = ir.Constant(_vt(_I32, 16), [0] * 16)
    off = builder.mul(b, _c64(32))
    for p, acc in enumerate(accs):
        x2 = _cat(builder, _load(builder, xrows[2 * p], off, _vt(_I8, 32)),
                  _load(builder, xrows[2 * p + 1], off, _vt(_I8, 32)))
        if neg2 is not None:
            x2 = builder.select(neg2, builder.sub(ir.Constant(v64, [0] * 64), x2), x2)
        lanes = builder.sitofp(_avx2_fn(builder, "llvm.x86.avx512.vpdpbusd.512", zero16.type, zero16, w2, x2),
                               _vt(_F32, 16))
        s0 = builder.fmul(dw, _ldf(builder, drows[2 * p], b))
        s1 = builder.fmul(dw, _ldf(builder, drows[2 * p + 1], b))
        two = builder.insert_element(builder.insert_element(ir.Constant(_vt(_F32, 2), ir.Undefined), s0,
                                                            ir.Constant(_I32, 0)), s1, ir.Constant(_I32, 1))
        sc = _shuffle(builder, two, two, [0] * 8 + [1] * 8)
        builder.store(_fma(builder, sc, lanes, builder.load(acc)), acc)


def _per_token(builder, accs, pairs):
    """Accumulators -> one <8 x float> per token (pairs: each <16 x float> holds two tokens)."""
    if not pairs:
        return accs
    return [h for v in accs for h in (_shuffle(builder, v, v, range(8)), _shuffle(builder, v, v, range(8, 16)))]


@intrinsic
def _b32_rows(typingctx, kind, ntok, row, xq, t0, xd, xs):
    """Tokens t0 .. t0+ntok-1 (ntok 1, 2, 4 or 8) against one weight row, each as ggml's vec_dot
    (the tokens share the weight decoding only). row: uint8 [row_bytes]; xq: int8 [T, K];
    xd, xs: float32 [T, B] (xs read for Q4_1/Q5_1 only)."""
    k = _literal(kind, _B32_BYTES)
    m = _literal(ntok, (1, 2, 4, 8))
    if k is None or m is None or not _is_c(row, xq, xd, xs) or not isinstance(t0, types.Integer):
        return None
    sig = types.UniTuple(types.float32, m)(kind, ntok, row, xq, t0, xd, xs)

    def codegen(context, builder, sig, args):
        _, _, row, xq, t0, xd, xs = args
        rp = _arr(context, builder, sig.args[2], row).data
        t0 = context.cast(builder, t0, sig.args[4], types.int64)
        xrows, _ = _rows_of(context, builder, sig.args[3], xq, t0, m)
        drows, da = _rows_of(context, builder, sig.args[5], xd, t0, m)
        srows, _ = _rows_of(context, builder, sig.args[6], xs, t0, m)
        nb = cgutils.unpack_tuple(builder, da.shape, 2)[1]
        zero8 = ir.Constant(_vt(_F32, 8), [0.0] * 8)
        npar = 2 if k == 39 else 1
        # pairs: tokens 2p and 2p+1 share <16 x float> accumulators (lanes 0-7: token 2p), their
        # integer dots one 512-bit vpdpbusd; lane for lane the same operations as one token alone
        pairs = m > 1 and _has_avx512_vnni(context)
        if pairs:
            zero16 = ir.Constant(_vt(_F32, 16), [0.0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero16) for _ in range(npar)] for _ in range(m // 2)]
        else:
            accs = [[cgutils.alloca_once_value(builder, zero8) for _ in range(npar)] for _ in range(m)]
        maccs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(m)]

        def block(b, par):
            bp = _bytes(builder, rp, builder.mul(b, _c64(_B32_BYTES[k])))
            w = _dec_b32(k, context, builder, bp)
            dw, mw = _hdr_b32(k, builder, bp)
            if pairs:
                _block_pairs(builder, k, w, dw, b, xrows, drows, [a[par] for a in accs])
            for i in range(m):
                if not pairs:
                    x = _load(builder, xrows[i], builder.mul(b, _c64(32)), _vt(_I8, 32))
                    lanes = builder.sitofp(_quads(context, builder, w, x, k in (3, 7)), _vt(_F32, 8))
                    sc = builder.fmul(dw, _ldf(builder, drows[i], b))
                    acc = accs[i][par]
                    builder.store(_fma(builder, _splat(builder, sc, 8), lanes, builder.load(acc)), acc)
                if mw is not None:
                    builder.store(_fma(builder, mw, _ldf(builder, srows[i], b), builder.load(maccs[i])), maccs[i])

        if k == 39:
            with cgutils.for_range(builder, builder.ashr(nb, _c64(1))) as loop:
                b = builder.mul(loop.index, _c64(2))
                block(b, 0)
                block(builder.add(b, _c64(1)), 1)
            sums = [builder.fadd(builder.load(a[0]), builder.load(a[1])) for a in accs]
            res = [cgutils.alloca_once_value(builder, _hsum8f(builder, v)) for v in _per_token(builder, sums, pairs)]
            odd = builder.icmp_signed("!=", builder.and_(nb, _c64(1)), _c64(0))
            with builder.if_then(odd, likely=False):
                b = builder.sub(nb, _c64(1))
                bp = _bytes(builder, rp, builder.mul(b, _c64(_B32_BYTES[k])))
                w = _dec_b32(k, context, builder, bp)
                dw, _ = _hdr_b32(k, builder, bp)
                for i in range(m):
                    x = _load(builder, xrows[i], builder.mul(b, _c64(32)), _vt(_I8, 32))
                    sumi = builder.sitofp(_hsum(builder, _quads(context, builder, w, x, False)), _F32)
                    d = builder.fmul(_ldf(builder, drows[i], b), dw)
                    builder.store(_fma(builder, d, sumi, builder.load(res[i])), res[i])
            out = [builder.load(r) for r in res]
        else:
            with cgutils.for_range(builder, nb) as loop:
                block(loop.index, 0)
            out = [_hsum8f(builder, v) for v in _per_token(builder, [builder.load(a[0]) for a in accs], pairs)]
            if k in (3, 7):
                out = [builder.fadd(o, builder.load(mc)) for o, mc in zip(out, maccs)]
        return context.make_tuple(builder, sig.return_type, out)

    return sig, codegen


# ---- K-quants: Q4_K, Q5_K, Q6_K (activations Q8_K) ----
#
# The unsigned codes are dotted with the activations by pairs (vpmaddubsw: at most
# 2*63*127, no saturation) and the pairs weighted by their sub-block scale (vpmaddwd), as
# ggml's AVX2 code, so per super-block we get ggml's eight exact int32 lanes, lane r = sum over the 32-value sub-blocks (16-value pairs
# for Q6_K) of scale * sum_{e = 4r..4r+3} w_e q_e. For Q6_K the weights are the unsigned 6-bit
# codes and lane r then loses 32 * (scale_2r bsum_2r + scale_2r+1 bsum_2r+1), as its AVX2 code.
# Min terms use q8s_g = bsum_2g + bsum_2g+1 (Q4_K/Q5_K). Two float epilogues, as llama.cpp:
#
# * vec_dot (ggml_vec_dot_<w>_q8_K AVX2; ops with fewer than 8 rows): acc = fma(splat(d_x*d_w),
#   float(lanes), acc) super-block after super-block, result hsum_float_8(acc), plus for Q4_K
#   four min lanes m_l = fma(-d_x*dmin, float(min_2l q8s_2l + min_2l+1 q8s_2l+1), m_l) added
#   as (m0+m2)+(m1+m3); for Q5_K summs = fma(-d_x*dmin, float(sum_g min_g q8s_g), summs).
# * tiled (ggml-cpu/tiled, ops with >= 8 rows): s1 = sum of the lanes, s2 = sum_g min_g q8s_g
#   (integers); res = fma(-dmin, float(s2), d_w*float(s1)) (Q6_K: d_w*float(s1));
#   out = fma(res, d_x, out) super-block after super-block.

_KQ_BYTES = {12: 144, 13: 176, 14: 210}


def _scales_k4(builder, bp):
    """The 8 six-bit (scale, min) pairs of a Q4_K/Q5_K block (get_scale_min_k4):
    -> scales <8 x i16>, mins <8 x i32>."""
    q = [builder.zext(_load(builder, bp, 4 + i, _I8), _I32) for i in range(12)]

    def c(v):
        return ir.Constant(_I32, v)

    sc = ir.Constant(_vt(_I16, 8), ir.Undefined)
    mn = ir.Constant(_vt(_I32, 8), ir.Undefined)
    for j in range(8):
        if j < 4:
            d = builder.and_(q[j], c(63))
            m = builder.and_(q[j + 4], c(63))
        else:
            d = builder.or_(builder.and_(q[j + 4], c(15)), builder.shl(builder.lshr(q[j - 4], c(6)), c(4)))
            m = builder.or_(builder.lshr(q[j + 4], c(4)), builder.shl(builder.lshr(q[j], c(6)), c(4)))
        sc = builder.insert_element(sc, builder.trunc(d, _I16), c(j))
        mn = builder.insert_element(mn, m, c(j))
    return sc, mn


def _dec_kq(k, builder, bp):
    """-> (8 pairs (unsigned codes <32 x i8>, their scales <16 x i16>: lane p for elements 2p,
    2p+1), mins <8 x i32> or None, d, dmin or None, Q6_K scales <16 x i32> or None)."""
    ws = []
    if k in (12, 13):
        qs = 16 if k == 12 else 48
        qh = _load(builder, bp, 16, _vt(_I8, 32)) if k == 13 else None
        scv, mins = _scales_k4(builder, bp)
        for j in range(8):
            c, hi = divmod(j, 2)
            b = _load(builder, bp, qs + 32 * c, _vt(_I8, 32))
            w = builder.lshr(b, _splat_const(_I8, 32, 4)) if hi else builder.and_(b, _splat_const(_I8, 32, 15))
            if k == 13:
                h = builder.and_(builder.lshr(qh, _splat_const(_I8, 32, j)), _splat_const(_I8, 32, 1))
                w = builder.or_(w, builder.shl(h, _splat_const(_I8, 32, 4)))
            ws.append((w, _shuffle(builder, scv, scv, [j] * 16)))
        return ws, mins, _f16(builder, bp, 0), _f16(builder, bp, 2), None
    sc8 = _load(builder, bp, 192, _vt(_I8, 16))
    scv = builder.sext(sc8, _vt(_I16, 16))
    for half in range(2):
        qh = _load(builder, bp, 128 + half * 32, _vt(_I8, 32))
        for grp in range(4):
            ql = _load(builder, bp, half * 64 + (grp & 1) * 32, _vt(_I8, 32))
            ql = builder.and_(builder.lshr(ql, _splat_const(_I8, 32, 4 * (grp >> 1))), _splat_const(_I8, 32, 15))
            h = builder.and_(builder.lshr(qh, _splat_const(_I8, 32, 2 * grp)), _splat_const(_I8, 32, 3))
            q = builder.or_(ql, builder.shl(h, _splat_const(_I8, 32, 4)))  # 0..63, unsigned
            g = half * 8 + grp * 2  # 16-value groups g and g+1
            ws.append((q, _shuffle(builder, scv, scv, [g] * 8 + [g + 1] * 8)))
    return ws, None, _f16(builder, bp, 208), None, builder.sext(sc8, _vt(_I32, 16))


def _kq_lanes(context, builder, ws, xp, xo):
    """ggml's eight int32 lanes of one super-block (see above), exact: with AVX2
    sum_j vpmaddwd(vpmaddubsw(codes_j, x_j), scales_j); else portable."""
    if _has_avx2(context):
        acc = None
        for j, (q, sc16) in enumerate(ws):
            x = _load(builder, xp, builder.add(xo, _c64(32 * j)), _vt(_I8, 32))
            p16 = _avx2_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _vt(_I16, 16), q, x)
            v = _avx2_fn(builder, "llvm.x86.avx2.pmadd.wd", _vt(_I32, 8), p16, sc16)
            acc = v if acc is None else builder.add(acc, v)
        return acc
    acc = None
    for j, (q, sc16) in enumerate(ws):
        x = _load(builder, xp, builder.add(xo, _c64(32 * j)), _vt(_I8, 32))
        sc = builder.sext(_shuffle(builder, sc16, sc16, [e // 2 for e in range(32)]), _vt(_I32, 32))
        p = builder.mul(builder.mul(builder.zext(q, _vt(_I32, 32)), sc), builder.sext(x, _vt(_I32, 32)))
        acc = p if acc is None else builder.add(acc, p)
    return _pairadd(builder, _pairadd(builder, acc))


@intrinsic
def _kq_rows(typingctx, kind, ntok, tiled, row, xq, t0, xd, xbs):
    """Tokens t0 .. t0+ntok-1 (ntok 1 or 4) against one weight row, with ggml's vec_dot
    (tiled=0) or tiled (tiled=1) float epilogue. row: uint8 [row_bytes]; xq: int8 [T, K];
    xd: float32 [T, S]; xbs: int32 [T, K/16]."""
    k = _literal(kind, _KQ_BYTES)
    m = _literal(ntok, (1, 4))
    tl = _literal(tiled, (0, 1))
    if k is None or m is None or tl is None or not _is_c(row, xq, xd, xbs) or not isinstance(t0, types.Integer):
        return None
    sig = types.UniTuple(types.float32, m)(kind, ntok, tiled, row, xq, t0, xd, xbs)

    def codegen(context, builder, sig, args):
        _, _, _, row, xq, t0, xd, xbs = args
        rp = _arr(context, builder, sig.args[3], row).data
        t0 = context.cast(builder, t0, sig.args[5], types.int64)
        xrows, _ = _rows_of(context, builder, sig.args[4], xq, t0, m)
        drows, da = _rows_of(context, builder, sig.args[6], xd, t0, m)
        brows, _ = _rows_of(context, builder, sig.args[7], xbs, t0, m)
        ns = cgutils.unpack_tuple(builder, da.shape, 2)[1]
        acc = [cgutils.alloca_once_value(builder, ir.Constant(_vt(_F32, 8), [0.0] * 8)) for _ in range(m)]
        macc = [cgutils.alloca_once_value(builder, ir.Constant(_vt(_F32, 4), [0.0] * 4)) for _ in range(m)]
        sacc = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(m)]
        with cgutils.for_range(builder, ns) as loop:
            s = loop.index
            bp = _bytes(builder, rp, builder.mul(s, _c64(_KQ_BYTES[k])))
            ws, mins, d, dmin, sc16 = _dec_kq(k, builder, bp)
            xo = builder.mul(s, _c64(256))
            for i in range(m):
                lanes = _kq_lanes(context, builder, ws, xrows[i], xo)  # <8 x i32>
                bs = _load(builder, brows[i], builder.mul(s, _c64(64)), _vt(_I32, 16), 4)
                if sc16 is not None:
                    corr = builder.shl(_pairadd(builder, builder.mul(bs, sc16)), _splat_const(_I32, 8, 5))
                    lanes = builder.sub(lanes, corr)
                mprod = builder.mul(mins, _pairadd(builder, bs)) if mins is not None else None  # <8 x i32>
                dx = _ldf(builder, drows[i], s)
                if tl:
                    res = builder.fmul(d, builder.sitofp(_hsum(builder, lanes), _F32))
                    if mins is not None:
                        res = _fma(builder, builder.fneg(dmin), builder.sitofp(_hsum(builder, mprod), _F32), res)
                    builder.store(_fma(builder, res, dx, builder.load(sacc[i])), sacc[i])
                else:
                    dd = builder.fmul(dx, d)
                    builder.store(_fma(builder, _splat(builder, dd, 8), builder.sitofp(lanes, _vt(_F32, 8)),
                                       builder.load(acc[i])), acc[i])
                    if mins is not None:
                        dm = builder.fmul(builder.fneg(dx), dmin)
                        if k == 12:
                            m4 = builder.sitofp(_pairadd(builder, mprod), _vt(_F32, 4))
                            builder.store(_fma(builder, _splat(builder, dm, 4), m4, builder.load(macc[i])), macc[i])
                        else:
                            sm = builder.sitofp(_hsum(builder, mprod), _F32)
                            builder.store(_fma(builder, dm, sm, builder.load(sacc[i])), sacc[i])
        out = []
        for i in range(m):
            if tl:
                out.append(builder.load(sacc[i]))
                continue
            r = _hsum8f(builder, builder.load(acc[i]))
            if k == 12:
                mv = builder.load(macc[i])
                r = builder.fadd(r, builder.fadd(builder.fadd(_lane(builder, mv, 0), _lane(builder, mv, 2)),
                                                 builder.fadd(_lane(builder, mv, 1), _lane(builder, mv, 3))))
            elif k == 13:
                r = builder.fadd(r, builder.load(sacc[i]))
            out.append(r)
        return context.make_tuple(builder, sig.return_type, out)

    return sig, codegen


# ---- the kernels: rows split over threads, tokens by four, then one by one ----


# ---- selected experts: out[a, n] = row n of expert sel[a] . activation row xrow[a] ----
# One parallel call for all experts of a decode step; each output is computed by the same
# one-token row code as _mm_b32_grp / _mm_kq_grp (vec_dot path), so results equal separate calls.


@numba.njit(cache=True, parallel=True)
def _mm_b32_sel(qt, stack, sel, xrow, xq, xd, xs, out, nchunks):
    A = sel.shape[0]
    N = stack.shape[1]
    total = A * N
    for c in prange(nchunks):
        for i in range(c * total // nchunks, (c + 1) * total // nchunks):
            a = i // N
            n = i % N
            row = stack[sel[a], n]
            t = xrow[a]
            if qt == 8:
                r1 = _b32_rows(8, 1, row, xq, t, xd, xs)
            elif qt == 2:
                r1 = _b32_rows(2, 1, row, xq, t, xd, xs)
            elif qt == 3:
                r1 = _b32_rows(3, 1, row, xq, t, xd, xs)
            elif qt == 6:
                r1 = _b32_rows(6, 1, row, xq, t, xd, xs)
            elif qt == 7:
                r1 = _b32_rows(7, 1, row, xq, t, xd, xs)
            else:
                r1 = _b32_rows(39, 1, row, xq, t, xd, xs)
            out[a, n] = r1[0]


@numba.njit(cache=True, parallel=True)
def _mm_kq_sel(qt, stack, sel, xrow, xq, xd, xbs, out, nchunks):
    A = sel.shape[0]
    N = stack.shape[1]
    total = A * N
    for c in prange(nchunks):
        for i in range(c * total // nchunks, (c + 1) * total // nchunks):
            a = i // N
            n = i % N
            row = stack[sel[a], n]
            t = xrow[a]
            if qt == 12:
                r1 = _kq_rows(12, 1, 0, row, xq, t, xd, xbs)
            elif qt == 13:
                r1 = _kq_rows(13, 1, 0, row, xq, t, xd, xbs)
            else:
                r1 = _kq_rows(14, 1, 0, row, xq, t, xd, xbs)
            out[a, n] = r1[0]


# ---- grouped rows: out[p, n] = row n of expert experts[j] . activation row p, for the rows
# p in offs[j]..offs[j+1] (the tokens routed to expert j, gathered). One parallel call for every
# expert of a layer (llama.cpp's MUL_MAT_ID); an ordinary matmul is the case of one expert. A
# thread takes one weight row and applies it to the expert's rows eight (block types) or four at
# a time, then one by one (the block is decoded once per tile); tiled[j] picks the K-quant path
# as a separate call with those rows would.


@numba.njit(cache=True, inline="always")
def _b32_tile8(qt, row, xq, t, xd, xs, out, n):
    """out[t:t+8, n] = rows t..t+7 of the activations against weight row `row`."""
    if qt == 8:
        r = _b32_rows(8, 8, row, xq, t, xd, xs)
    elif qt == 2:
        r = _b32_rows(2, 8, row, xq, t, xd, xs)
    elif qt == 3:
        r = _b32_rows(3, 8, row, xq, t, xd, xs)
    elif qt == 6:
        r = _b32_rows(6, 8, row, xq, t, xd, xs)
    elif qt == 7:
        r = _b32_rows(7, 8, row, xq, t, xd, xs)
    else:
        r = _b32_rows(39, 8, row, xq, t, xd, xs)
    for i in range(8):
        out[t + i, n] = r[i]


@numba.njit(cache=True, inline="always")
def _b32_tile4(qt, row, xq, t, xd, xs, out, n):
    """out[t:t+4, n] = rows t..t+3 of the activations against weight row `row`."""
    if qt == 8:
        r = _b32_rows(8, 4, row, xq, t, xd, xs)
    elif qt == 2:
        r = _b32_rows(2, 4, row, xq, t, xd, xs)
    elif qt == 3:
        r = _b32_rows(3, 4, row, xq, t, xd, xs)
    elif qt == 6:
        r = _b32_rows(6, 4, row, xq, t, xd, xs)
    elif qt == 7:
        r = _b32_rows(7, 4, row, xq, t, xd, xs)
    else:
        r = _b32_rows(39, 4, row, xq, t, xd, xs)
    for i in range(4):
        out[t + i, n] = r[i]


@numba.njit(cache=True, inline="always")
def _b32_tile2(qt, row, xq, t, xd, xs, out, n):
    """out[t:t+2, n] = rows t..t+1 of the activations against weight row `row`."""
    if qt == 8:
        r = _b32_rows(8, 2, row, xq, t, xd, xs)
    elif qt == 2:
        r = _b32_rows(2, 2, row, xq, t, xd, xs)
    elif qt == 3:
        r = _b32_rows(3, 2, row, xq, t, xd, xs)
    elif qt == 6:
        r = _b32_rows(6, 2, row, xq, t, xd, xs)
    elif qt == 7:
        r = _b32_rows(7, 2, row, xq, t, xd, xs)
    else:
        r = _b32_rows(39, 2, row, xq, t, xd, xs)
    for i in range(2):
        out[t + i, n] = r[i]


@numba.njit(cache=True, inline="always")
def _b32_tile1(qt, row, xq, t, xd, xs, out, n):
    """out[t:t+1, n] = rows t..t+0 of the activations against weight row `row`."""
    if qt == 8:
        r = _b32_rows(8, 1, row, xq, t, xd, xs)
    elif qt == 2:
        r = _b32_rows(2, 1, row, xq, t, xd, xs)
    elif qt == 3:
        r = _b32_rows(3, 1, row, xq, t, xd, xs)
    elif qt == 6:
        r = _b32_rows(6, 1, row, xq, t, xd, xs)
    elif qt == 7:
        r = _b32_rows(7, 1, row, xq, t, xd, xs)
    else:
        r = _b32_rows(39, 1, row, xq, t, xd, xs)
    for i in range(1):
        out[t + i, n] = r[i]


@numba.njit(cache=True, parallel=True)
def _mm_b32_grp(qt, stack, experts, offs, xq, xd, xs, out, nchunks):
    J = experts.shape[0]
    N = stack.shape[1]
    total = J * N
    for c in prange(nchunks):
        for i in range(c * total // nchunks, (c + 1) * total // nchunks):
            j = i // N
            n = i % N
            row = stack[experts[j], n]
            t = offs[j]
            t1 = offs[j + 1]
            while t + 8 <= t1:
                _b32_tile8(qt, row, xq, t, xd, xs, out, n)
                t += 8
            if t + 4 <= t1:
                _b32_tile4(qt, row, xq, t, xd, xs, out, n)
                t += 4
            if t + 2 <= t1:
                _b32_tile2(qt, row, xq, t, xd, xs, out, n)
                t += 2
            if t < t1:
                _b32_tile1(qt, row, xq, t, xd, xs, out, n)


@numba.njit(cache=True, parallel=True)
def _mm_kq_grp(qt, tiled, stack, experts, offs, xq, xd, xbs, out, nchunks):
    J = experts.shape[0]
    N = stack.shape[1]
    total = J * N
    for c in prange(nchunks):
        for i in range(c * total // nchunks, (c + 1) * total // nchunks):
            j = i // N
            n = i % N
            row = stack[experts[j], n]
            t0 = offs[j]
            t1 = offs[j + 1]
            t4 = t1 - (t1 - t0) % 4
            for t in range(t0, t4, 4):
                if tiled[j]:
                    if qt == 12:
                        r = _kq_rows(12, 4, 1, row, xq, t, xd, xbs)
                    elif qt == 13:
                        r = _kq_rows(13, 4, 1, row, xq, t, xd, xbs)
                    else:
                        r = _kq_rows(14, 4, 1, row, xq, t, xd, xbs)
                else:
                    if qt == 12:
                        r = _kq_rows(12, 4, 0, row, xq, t, xd, xbs)
                    elif qt == 13:
                        r = _kq_rows(13, 4, 0, row, xq, t, xd, xbs)
                    else:
                        r = _kq_rows(14, 4, 0, row, xq, t, xd, xbs)
                out[t, n] = r[0]
                out[t + 1, n] = r[1]
                out[t + 2, n] = r[2]
                out[t + 3, n] = r[3]
            for t in range(t4, t1):
                if tiled[j]:
                    if qt == 12:
                        r1 = _kq_rows(12, 1, 1, row, xq, t, xd, xbs)
                    elif qt == 13:
                        r1 = _kq_rows(13, 1, 1, row, xq, t, xd, xbs)
                    else:
                        r1 = _kq_rows(14, 1, 1, row, xq, t, xd, xbs)
                else:
                    if qt == 12:
                        r1 = _kq_rows(12, 1, 0, row, xq, t, xd, xbs)
                    elif qt == 13:
                        r1 = _kq_rows(13, 1, 0, row, xq, t, xd, xbs)
                    else:
                        r1 = _kq_rows(14, 1, 0, row, xq, t, xd, xbs)
                out[t, n] = r1[0]


# --------------------------------------------------------------------------------------------
# float weights (F32, F16, BF16)
#
# "ggml" numerics, as llama.cpp: the products are exact in float32 for F16/BF16 (their values
# and the rounded activations have at most 11 significant bits), and F32 uses real FMAs.
# * tinyBLAS (llamafile_sgemm, AVX2; ordinary matmuls with >= 2 rows, N % 4 == 0, K % 8 == 0):
#   eight lanes, lane = fma(w_k, x_k, lane) for k = lane mod 8, result hsum_float_8.
# * vec_dot otherwise (ggml_vec_dot_f32/f16/bf16): four <8 x float> accumulators over steps of
#   32 values, combined as (a0+a2)+(a1+a3), reduced by two hadd (F32/F16) or as hsum_float_8
#   (BF16); the K % 32 leftovers are added in float32 with FMA (F32) or in double (F16/BF16).

_FL_KINDS = (0, 1, 30)  # F32, F16, BF16


def _ld_w8(builder, k, wp, off):
    """8 weights from element offset off (i64) as <8 x float>."""
    if k == 0:
        return _load(builder, wp, builder.mul(off, _c64(4)), _vt(_F32, 8), 4)
    h = _load(builder, wp, builder.mul(off, _c64(2)), _vt(_I16, 8), 2)
    if k == 1:
        return builder.fpext(builder.bitcast(h, _vt(ir.HalfType(), 8)), _vt(_F32, 8))
    return builder.bitcast(builder.shl(builder.zext(h, _vt(_I32, 8)), _splat_const(_I32, 8, 16)), _vt(_F32, 8))


def _ld_w1(builder, k, wp, off):
    if k == 0:
        return _load(builder, wp, builder.mul(off, _c64(4)), _F32, 4)
    h = _load(builder, wp, builder.mul(off, _c64(2)), _I16, 2)
    if k == 1:
        return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)
    return builder.bitcast(builder.shl(builder.zext(h, _I32), ir.Constant(_I32, 16)), _F32)


@intrinsic
def _fl_rows(typingctx, kind, tiny, ntok, row, x, t0):
    """Tokens t0 .. t0+ntok-1 (ntok 1 or 4) against one F32/F16/BF16 weight row (its raw
    integer bits, any integer dtype) with tinyBLAS's (tiny=1) or vec_dot's (tiny=0) order.
    x: float32 [T, K] (already rounded to f16/bf16 for those types)."""
    k = _literal(kind, _FL_KINDS)
    tn = _literal(tiny, (0, 1))
    m = _literal(ntok, (1, 4))
    if k is None or tn is None or m is None or not _is_c(row, x) or not isinstance(t0, types.Integer):
        return None
    sig = types.UniTuple(types.float32, m)(kind, tiny, ntok, row, x, t0)

    def codegen(context, builder, sig, args):
        _, _, _, row, x, t0 = args
        wp = _bytes(builder, _arr(context, builder, sig.args[3], row).data)
        t0 = context.cast(builder, t0, sig.args[5], types.int64)
        xrows, xa = _rows_of(context, builder, sig.args[4], x, t0, m)
        K = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
        zero8 = ir.Constant(_vt(_F32, 8), [0.0] * 8)
        if tn:
            acc = [cgutils.alloca_once_value(builder, zero8) for _ in range(m)]
            with cgutils.for_range(builder, builder.ashr(K, _c64(3))) as loop:
                off = builder.mul(loop.index, _c64(8))
                w = _ld_w8(builder, k, wp, off)
                for i in range(m):
                    xv = _load(builder, xrows[i], builder.mul(off, _c64(4)), _vt(_F32, 8), 4)
                    builder.store(_fma(builder, w, xv, builder.load(acc[i])), acc[i])
            out = [_hsum8f(builder, builder.load(a)) for a in acc]
            return context.make_tuple(builder, sig.return_type, out)
        acc = [[cgutils.alloca_once_value(builder, zero8) for _ in range(4)] for _ in range(m)]
        with cgutils.for_range(builder, builder.ashr(K, _c64(5))) as loop:
            base = builder.mul(loop.index, _c64(32))
            for j in range(4):
                off = builder.add(base, _c64(8 * j))
                w = _ld_w8(builder, k, wp, off)
                for i in range(m):
                    xv = _load(builder, xrows[i], builder.mul(off, _c64(4)), _vt(_F32, 8), 4)
                    builder.store(_fma(builder, w, xv, builder.load(acc[i][j])), acc[i][j])
        np_ = builder.and_(K, _c64(~31))
        out = []
        for i in range(m):
            a = [builder.load(v) for v in acc[i]]
            l8 = builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3]))
            red = _hsum8f(builder, l8) if k == 30 else _hadd8f(builder, l8)
            if k == 0:
                s = cgutils.alloca_once_value(builder, red)
            else:
                s = cgutils.alloca_once_value(builder, builder.fpext(red, ir.DoubleType()))
            with cgutils.for_range_slice(builder, np_, K, _c64(1), inc=True) as (idx, _):
                wv = _ld_w1(builder, k, wp, idx)
                xv = _load(builder, xrows[i], builder.mul(idx, _c64(4)), _F32, 4)
                if k == 0:
                    builder.store(_fma(builder, wv, xv, builder.load(s)), s)
                else:
                    builder.store(builder.fadd(builder.load(s), builder.fpext(builder.fmul(wv, xv), ir.DoubleType())), s)
            r = builder.load(s)
            out.append(r if k == 0 else builder.fptrunc(r, _F32))
        return context.make_tuple(builder, sig.return_type, out)

    return sig, codegen


@numba.njit(cache=True, parallel=True)
def _mm_float_ggml(w, qt, tiny, x, out, nchunks):
    N = w.shape[0]
    T = x.shape[0]
    T4 = T - T % 4
    for c in prange(nchunks):
        for n in range(c * N // nchunks, (c + 1) * N // nchunks):
            row = w[n]
            for t in range(0, T4, 4):
                if tiny:
                    if qt == 0:
                        r = _fl_rows(0, 1, 4, row, x, t)
                    elif qt == 1:
                        r = _fl_rows(1, 1, 4, row, x, t)
                    else:
                        r = _fl_rows(30, 1, 4, row, x, t)
                else:
                    if qt == 0:
                        r = _fl_rows(0, 0, 4, row, x, t)
                    elif qt == 1:
                        r = _fl_rows(1, 0, 4, row, x, t)
                    else:
                        r = _fl_rows(30, 0, 4, row, x, t)
                out[t, n] = r[0]
                out[t + 1, n] = r[1]
                out[t + 2, n] = r[2]
                out[t + 3, n] = r[3]
            for t in range(T4, T):
                if tiny:
                    if qt == 0:
                        r1 = _fl_rows(0, 1, 1, row, x, t)
                    elif qt == 1:
                        r1 = _fl_rows(1, 1, 1, row, x, t)
                    else:
                        r1 = _fl_rows(30, 1, 1, row, x, t)
                else:
                    if qt == 0:
                        r1 = _fl_rows(0, 0, 1, row, x, t)
                    elif qt == 1:
                        r1 = _fl_rows(1, 0, 1, row, x, t)
                    else:
                        r1 = _fl_rows(30, 0, 1, row, x, t)
                out[t, n] = r1[0]


# float32 numerics for float weights: exact conversion, float64 dot


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
def _dot64(a, b):
    s = 0.0
    for k in range(a.shape[0]):
        s += np.float64(a[k]) * np.float64(b[k])
    return s


@numba.njit(cache=True, parallel=True)
def _mm_float(w, qt, x, out, nchunks):
    N, K = w.shape
    T = x.shape[0]
    for c in prange(nchunks):
        fb = np.empty(K, np.float32)
        for n in range(c * N // nchunks, (c + 1) * N // nchunks):
            _row_to_f32(w[n], qt, fb)
            for t in range(T):
                out[t, n] = _dot64(fb, x[t])


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
    values; None when quantized). For Q8_0/Q8_1: qs int8 [T, K], d f32 [T, B], s f32 [T, B]
    (Q8_1 only). For Q8_K: qs int8 [T, K], d f32 [T, S], bsums int32 [T, K/16].
    """

    numerics: str
    vec_dot_type: int
    x: np.ndarray | None
    qs: np.ndarray | None = None
    d: np.ndarray | None = None
    s: np.ndarray | None = None
    bsums: np.ndarray | None = None

    @property
    def T(self) -> int:
        return (self.x if self.qs is None else self.qs).shape[0]

    def rows(self, idx: np.ndarray) -> Prepared:
        """These activations gathered by row: row i of the result is row idx[i] (conversion is
        per row, so this equals preparing x[idx])."""
        return Prepared(self.numerics, self.vec_dot_type,
                        *(None if a is None else a[idx] for a in (self.x, self.qs, self.d, self.s, self.bsums)))

    @property
    def K(self) -> int:
        return (self.x if self.qs is None else self.qs).shape[1]


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
        return Prepared("ggml", vt, None, qs=qs, d=d, bsums=bsums)
    d = np.empty((T, K // 32), np.float32)
    s = np.empty((T, K // 32), np.float32)
    if T:
        _quantize_q8_0_1(x, qs, d, s)
    if vt == Q.Q8_1:
        return Prepared("ggml", vt, None, qs=qs, d=d, s=s)
    return Prepared("ggml", vt, None, qs=qs, d=d)


def _nchunks(n: int) -> int:
    return max(1, min(n, 4 * _threads()))


@functools.cache
def _threads() -> int:
    # numba.get_num_threads() costs microseconds per call; the chunk count only balances work
    # across threads (results do not depend on it), so the first value serves.
    return numba.get_num_threads()


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


def tiled_kquant(rows: int) -> bool:
    """Whether llama.cpp takes its tiled K-quant kernel (ggml-cpu/tiled) for an op with this many
    activation rows: all tokens of an ordinary matmul, the tokens routed to one expert for
    MUL_MAT_ID (ggml_tiled_min_batch: rows >= 8)."""
    return rows >= 8


def tinyblas_float(rows: int, n: int, k: int, expert: bool) -> bool:
    """Whether llama.cpp takes llamafile's tinyBLAS for F32/F16/BF16 weights (AVX2): ordinary
    matmuls (MUL_MAT_ID has no sgemm path) with >= 2 rows, N % 4 == 0 and K % 8 == 0."""
    return not expert and rows >= 2 and n % 4 == 0 and k % 8 == 0


_ONE_EXPERT = np.zeros(1, np.int64)


def linear_prepared(xp: Prepared, raw: np.ndarray, ggml_type: int, k: int, expert: bool = False,
                    solo: bool = False, groups: np.ndarray | None = None) -> np.ndarray:
    """out float32 [T, N] = x @ W.T for prepared activations xp and weight raw [N, row_bytes].

    expert: the call is one expert of a MUL_MAT_ID (MoE experts: x = the tokens routed to it);
    with "ggml" numerics it selects llama.cpp's path as that op does (see the module docstring).
    solo: the rows are independent one-token steps (a decode batch): each row is computed as a
    one-row call computes it, so a token's result does not depend on its batch.
    groups: row offsets [G+1] from 0 to T of independent sequences stacked in x (a batched
    prefill): each group is computed as a separate call on its rows computes it."""
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
    groups = _row_groups(T, solo, groups)
    counts = [1] if solo else np.diff(groups).tolist()  # the row counts that pick llama.cpp's path
    if xp.numerics == "float32":
        if ggml_type in Q.FLOAT_TYPES:
            _mm_float(w, qt, xp.x, out, nc)
        else:
            _mm_ref(w, qt, k, xp.x, out, nc)
    elif ggml_type in Q.FLOAT_TYPES:
        flags = [tinyblas_float(c, N, k, expert) for c in counts]
        if len(set(flags)) == 1:
            _mm_float_ggml(w, qt, flags[0], xp.x, out, nc)
        else:  # sequences taking different paths: one call each
            for g, flag in enumerate(flags):
                r0, r1 = int(groups[g]), int(groups[g + 1])
                _mm_float_ggml(w, qt, flag, xp.x[r0:r1], out[r0:r1], nc)
    elif ggml_type in Q.KQUANT_TYPES:  # rows of one path in one group ("expert" 0)
        tiled = [tiled_kquant(c) for c in counts]
        if len(set(tiled)) == 1:
            groups = np.array([0, T])
        _mm_kq_grp(qt, np.array(tiled[:len(groups) - 1], dtype=np.uint8), w[None],
                   np.zeros(len(groups) - 1, np.int64), groups, xp.qs, xp.d, xp.bsums, out, nc)
    else:  # the row count does not matter to these kernels
        xs = xp.s if xp.s is not None else xp.d  # read only for Q8_1
        _mm_b32_grp(qt, w[None], _ONE_EXPERT, np.array([0, T]), xp.qs, xp.d, xs, out, nc)
    return out


def _row_groups(T: int, solo: bool, groups) -> np.ndarray:
    """Row offsets of independent groups: [0, T] by default; checked when given."""
    if groups is None or solo:
        return np.array([0, T], dtype=np.int64)
    groups = np.ascontiguousarray(groups, dtype=np.int64)
    if groups.ndim != 1 or groups.size < 2 or groups[0] != 0 or groups[-1] != T or np.any(np.diff(groups) <= 0):
        raise ValueError(f"groups must rise strictly from 0 to {T}")
    return groups


def linear_selected(xp: Prepared, stack: np.ndarray, sel: np.ndarray, xrow: np.ndarray,
                    ggml_type: int, k: int) -> np.ndarray:
    """Expert matmuls of one decode step in one call: out [A, N] with
    out[a] = W[sel[a]] @ x[xrow[a]], for stack uint8 [E, N, row_bytes] of expert weights.

    Each row is computed exactly as a one-token expert call of linear_prepared computes it.
    Quantized weights in "ggml" numerics only; other cases loop over linear_prepared."""
    sel = np.ascontiguousarray(sel, dtype=np.int64)
    xrow = np.ascontiguousarray(xrow, dtype=np.int64)
    A, N = sel.shape[0], stack.shape[1]
    if A and (sel.min() < 0 or sel.max() >= stack.shape[0] or xrow.min() < 0 or xrow.max() >= xp.T):
        raise ValueError("expert or activation row index out of range")
    if xp.numerics != "ggml" or ggml_type in Q.FLOAT_TYPES or not stack.flags.c_contiguous:
        out = np.empty((A, N), np.float32)
        for a in range(A):
            one = Prepared(xp.numerics, xp.vec_dot_type, *(None if v is None else v[xrow[a]:xrow[a] + 1]
                                                           for v in (xp.x, xp.qs, xp.d, xp.s, xp.bsums)))
            out[a] = linear_prepared(one, stack[sel[a]], ggml_type, k, expert=True)[0]
        return out
    if VEC_DOT_TYPE[ggml_type] != xp.vec_dot_type or xp.K != k:
        raise ValueError("activations were prepared for another weight type or length")
    if stack.dtype != np.uint8 or stack.ndim != 3 or stack.shape[2] != Q.row_bytes(ggml_type, k):
        raise ValueError(f"stack must be uint8 [E, N, {Q.row_bytes(ggml_type, k)}], got {stack.dtype} {stack.shape}")
    out = np.empty((A, N), np.float32)
    if A == 0 or N == 0:
        return out
    nc = _nchunks(A * N)
    if ggml_type in Q.KQUANT_TYPES:
        _mm_kq_sel(int(ggml_type), stack, sel, xrow, xp.qs, xp.d, xp.bsums, out, nc)
    else:
        xs = xp.s if xp.s is not None else xp.d
        _mm_b32_sel(int(ggml_type), stack, sel, xrow, xp.qs, xp.d, xs, out, nc)
    return out


@numba.njit(cache=True)
def _group_problem(experts, offs, n_expert, n_rows):
    """0 when offs [J+1] rises from 0 to n_rows and every experts [J] is in 0..n_expert-1;
    1: bad offs, 2: bad expert. (One call: these checks cost more than the kernel in numpy.)"""
    J = experts.shape[0]
    if offs.shape[0] != J + 1 or offs[0] != 0 or offs[J] != n_rows:
        return 1
    for j in range(J):
        if offs[j + 1] < offs[j]:
            return 1
        if experts[j] < 0 or experts[j] >= n_expert:
            return 2
    return 0


def linear_grouped(xp: Prepared, stack: np.ndarray, experts: np.ndarray, offs: np.ndarray,
                   ggml_type: int, k: int, solo: bool = False) -> np.ndarray:
    """Every expert of a layer in one call: out [P, N] with out[p] = W[experts[j]] @ x[p] for p in
    offs[j]..offs[j+1] (activations gathered by expert), for stack uint8 [E, N, row_bytes].

    Each expert's rows are computed exactly as a separate expert call of linear_prepared on those
    rows computes them (solo: as one-row calls)."""
    experts = np.ascontiguousarray(experts, dtype=np.int64)
    offs = np.ascontiguousarray(offs, dtype=np.int64)
    J, N = experts.shape[0], stack.shape[1]
    problem = _group_problem(experts, offs, stack.shape[0], xp.T)
    if problem:
        raise ValueError(("", "offs must rise from 0 to the number of activation rows, one step per expert",
                          "expert index out of range")[problem])
    if xp.numerics != "ggml" or ggml_type in Q.FLOAT_TYPES or not stack.flags.c_contiguous:
        out = np.empty((xp.T, N), np.float32)
        for j in range(J):
            r0, r1 = int(offs[j]), int(offs[j + 1])
            part = Prepared(xp.numerics, xp.vec_dot_type, *(None if v is None else v[r0:r1]
                                                             for v in (xp.x, xp.qs, xp.d, xp.s, xp.bsums)))
            out[r0:r1] = linear_prepared(part, stack[experts[j]], ggml_type, k, expert=True, solo=solo)
        return out
    if VEC_DOT_TYPE[ggml_type] != xp.vec_dot_type or xp.K != k:
        raise ValueError("activations were prepared for another weight type or length")
    if stack.dtype != np.uint8 or stack.ndim != 3 or stack.shape[2] != Q.row_bytes(ggml_type, k):
        raise ValueError(f"stack must be uint8 [E, N, {Q.row_bytes(ggml_type, k)}], got {stack.dtype} {stack.shape}")
    out = np.empty((xp.T, N), np.float32)
    if J == 0 or N == 0 or xp.T == 0:
        return out
    nc = _nchunks(J * N)
    if ggml_type in Q.KQUANT_TYPES:
        counts = np.diff(offs)
        tiled = np.array([0 if solo else tiled_kquant(int(c)) for c in counts], dtype=np.uint8)
        _mm_kq_grp(int(ggml_type), tiled, stack, experts, offs, xp.qs, xp.d, xp.bsums, out, nc)
    else:
        xs = xp.s if xp.s is not None else xp.d
        _mm_b32_grp(int(ggml_type), stack, experts, offs, xp.qs, xp.d, xs, out, nc)
    return out


def linear(
    x: np.ndarray, raw: np.ndarray, ggml_type: int, k: int, numerics: str = "ggml", expert: bool = False,
    solo: bool = False, groups: np.ndarray | None = None,
) -> np.ndarray:
    """out float32 [T, N] = x [T, K] @ W.T, W given as ggml blocks raw uint8 [N, row_bytes].
    expert, solo, groups: as linear_prepared."""
    return linear_prepared(prepare(x, ggml_type, numerics), raw, ggml_type, k, expert, solo, groups)


# --------------------------------------------------------------------------------------------
# benchmark


def bench(
    types=("Q8_0", "Q4_0", "Q4_1", "Q5_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"),
    n: int = 2048,
    k: int = 2048,
    tokens=(1, 32),
    numerics: str = "ggml",
    seconds: float = 0.5,
    working_set_mb: float = 0,
) -> list[tuple[str, int, float, float]]:
    """Time linear_prepared (activation preparation excluded) on n x k matrices of random
    blocks; print and return (type, T, ms per call, GB/s of weight bytes). With
    working_set_mb > 0 the calls cycle through enough distinct matrices to fill that much
    memory, so that weights come from DRAM rather than from the caches."""
    rng = np.random.default_rng(0)
    results = []
    print(f"threads={numba.get_num_threads()} N={n} K={k} numerics={numerics}"
          + (f" working set {working_set_mb:.0f} MB" if working_set_mb else ""))
    for name in types:
        qt = int(getattr(Q, name))
        rb = Q.row_bytes(qt, k)
        copies = max(1, int(np.ceil(working_set_mb * 1e6 / (n * rb))))
        raws = []
        for _ in range(copies):
            raw = rng.integers(0, 256, size=(n, rb), dtype=np.uint8)
            if qt in Q.FLOAT_TYPES:
                w = rng.standard_normal((n, k)).astype(np.float32)
                if qt == Q.F16:
                    w = w.astype(np.float16)
                elif qt == Q.BF16:
                    w = (w.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
                raw = np.ascontiguousarray(w).view(np.uint8)
            else:
                _fix_scales(raw, qt, rng)
            raws.append(raw)
        for T in tokens:
            x = rng.standard_normal((T, k)).astype(np.float32)
            xp = prepare(x, qt, numerics)
            linear_prepared(xp, raws[0], qt, k)  # compile / warm
            reps, t0 = 0, time.perf_counter()
            best = float("inf")
            while time.perf_counter() - t0 < seconds or reps < 3:
                t1 = time.perf_counter()
                for raw in raws:
                    linear_prepared(xp, raw, qt, k)
                best = min(best, (time.perf_counter() - t1) / len(raws))
                reps += 1
            gbs = raws[0].nbytes / best / 1e9
            results.append((name, T, best * 1e3, gbs))
            print(f"{name:6s} T={T:4d} {best * 1e3:8.3f} ms  {gbs:6.2f} GB/s  "
                  f"{2 * T * n * k / best / 1e9:7.1f} GOP/s", flush=True)
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
    bench(types=("Q8_0", "Q4_0", "Q4_1", "MXFP4", "Q4_K", "Q6_K", "BF16"), n=4096, k=4096,
          tokens=(1,), working_set_mb=512)
