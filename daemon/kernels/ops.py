"""Numba CPU kernels for the non-matmul ops: norms, RoPE, attention, activations.

Each kernel computes what ggml's CPU backend computes, in the same precision: float32 values,
with float64 ("ggml_float") accumulators where ggml uses them (norm sums, softmax sums).

"ggml" numerics follow llama.cpp's x86 AVX2+FMA+F16C build bit for bit (checked against
libggml-cpu op by op), which means emulating, besides the plain float32 arithmetic:

* `ggml_v_expf`, the SIMD exp (<= 1.5 ulp) that ggml uses for every full group of 8 elements
  in softmax (`ggml_vec_soft_max_f32`) and SiLU/SwiGLU (`ggml_v_silu`); leftover elements
  (n % 8) use glibc `expf` (numba's `math.exp` on a float32 calls it). `v_expf` below is a
  transcription of the AVX2 version, FMAs included.
* FMA contraction: GCC compiles ggml with `-mfma` and the default `-ffp-contract=fast`, so
  `a*b + c*d` in ops.cpp is `fma(a, b, c*d)` (RoPE rotation, YaRN angle mix and mscale).
* Summation orders: softmax sums each group of 8 exps in float32 (`(v0+v4)+(v2+v6)` +
  `(v1+v5)+(v3+v7)`) before adding it to the float64 total; the f16 KQ and KQV products run
  through llamafile's tinyBLAS when the batch has >= 2 tokens (8 float32 lanes, lane = index % 8,
  same horizontal sum) and through `ggml_vec_dot_f16` for a single token (32 lanes,
  `GGML_F32x8_REDUCE`). Products of two f16 values are exact in float32, so an FMA there is a
  plain float32 add of the product.

Legend: T = tokens in the step, D = hidden size, H = query heads, Hkv = key/value heads,
Dh = head size, C = KV cache length (positions), F = FFN size.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, models, register_model

from .quants import f32_as_u32 as f32_bits, u32_as_f32 as bits_f32

# --------------------------------------------------------------------------------------------
# scalar building blocks


@intrinsic
def fma32(typingctx, a, b, c):
    """Fused multiply-add on float32 (one rounding), as x86 vfmadd: llvm.fma.f32."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return types.float32(a, b, c), codegen


_F32 = np.float32
# ggml_v_expf (AVX2/FMA, vec.h) constants
_EXP_R = _F32(float.fromhex("0x1.8p23"))
_EXP_LOG2E = _F32(float.fromhex("0x1.715476p+0"))
_EXP_LN2_HI = _F32(float.fromhex("0x1.62e4p-1"))
_EXP_LN2_LO = _F32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C1 = _F32(float.fromhex("0x1.ffffecp-1"))
_EXP_C2 = _F32(float.fromhex("0x1.fffdb6p-2"))
_EXP_C3 = _F32(float.fromhex("0x1.555e66p-3"))
_EXP_C4 = _F32(float.fromhex("0x1.573e2ep-5"))
_EXP_C5 = _F32(float.fromhex("0x1.0e4020p-7"))


@njit(cache=True, inline="always")
def v_expf(x):
    """One lane of ggml's AVX2 `ggml_v_expf` (float32 in, float32 out).

    Range reduction x = n*ln2 + b with n = round(x*log2e), a degree-5 polynomial for e^b - 1,
    then scaling by 2^n through the exponent bits; |n| > 126 takes the two-factor scaling path
    and |n| > 192 saturates to 0 or inf. Not correctly rounded (up to ~1.5 ulp), which is why
    it must be reproduced exactly.
    """
    z = fma32(x, _EXP_LOG2E, _EXP_R)
    n = z - _EXP_R
    b = fma32(-n, _EXP_LN2_LO, fma32(-n, _EXP_LN2_HI, x))
    e = f32_bits(z) << np.uint32(23)
    k = bits_f32(e + np.uint32(0x3F800000))
    u = b * b
    j = fma32(fma32(fma32(_EXP_C5, b, _EXP_C4), u, fma32(_EXP_C3, b, _EXP_C2)), u, _EXP_C1 * b)
    # every path is computed and the result selected, as the SIMD code does per lane (and so that
    # loops over v_expf vectorize)
    fast = fma32(j, k, k)
    g = np.uint32(0x82000000) if n <= _F32(0.0) else np.uint32(0)
    s1 = bits_f32(g + np.uint32(0x7F000000))
    s2 = bits_f32(e - g)
    scaled = fma32(s2, j, s2) * s1
    an = abs(n)
    big = scaled if not an > _F32(192.0) else s1 * s1
    return fast if not an > _F32(126.0) else big  # NaN: ordered compares are false -> fast


@njit(cache=True, inline="always")
def expf(x):
    """glibc expf (numba lowers math.exp on a float32 to the C library's expf)."""
    return math.exp(x)


@njit(cache=True, inline="always")
def v_silu(x):
    """One lane of `ggml_v_silu`: x / (1 + v_expf(0 - x))."""
    return x / (_F32(1.0) + v_expf(_F32(0.0) - x))


@njit(cache=True, inline="always")
def silu_f32(x):
    """`ggml_silu_f32` (the scalar tail): x / (1 + expf(-x))."""
    return x / (_F32(1.0) + expf(-x))


@njit(cache=True, inline="always")
def hsum8(v0, v1, v2, v3, v4, v5, v6, v7):
    """AVX horizontal sum of 8 float32 lanes as ggml's softmax and tinyBLAS's hsum do it:
    add the high half to the low half, then movehl, then movehdup."""
    return ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))


@njit(cache=True, inline="always")
def reduce8_hadd(v0, v1, v2, v3, v4, v5, v6, v7):
    """The last steps of GGML_F32x8_REDUCE: low + high half, then two _mm_hadd_ps."""
    return ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7))


@njit(cache=True, inline="always")
def round_f16(x):
    """float32 -> nearest float16 value (ties to even), returned as float32; numpy's
    astype(float16), F16C vcvtps2ph. Pure bit operations, no allocation."""
    u = f32_bits(x)
    sign = u & np.uint32(0x80000000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf, nan
        return x
    if a >= np.uint32(0x477FF000):  # >= 65520: rounds past 65504
        return bits_f32(sign | np.uint32(0x7F800000))
    if a < np.uint32(0x38800000):  # below 2^-14: f16 subnormals, a fixed quantum of 2^-24
        q = np.rint(bits_f32(a) * _F32(16777216.0))  # exact scaling, RNE to an integer
        return bits_f32(sign | f32_bits(q * _F32(5.9604644775390625e-08)))
    a = (a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return bits_f32(sign | a)


@intrinsic
def _f16_trip(typingctx, x):
    """float32 -> float16 -> float32 as LLVM fptrunc/fpext (F16C vcvtps2ph/vcvtph2ps where the
    CPU has it): round to nearest even, as numpy's astype(float16) and ggml's fp32->fp16 for every
    non-NaN value (a NaN stays NaN; its payload bits may differ)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(x), codegen


@njit(cache=True)
def to_f16_values(a):
    """In place: each element of a C-contiguous float32 array rounded to its float16 value (the
    f16 KV cache and f16 queries of ggml numerics). Vectorized; see _f16_trip."""
    f = a.reshape(-1)
    for i in range(f.shape[0]):
        f[i] = _f16_trip(f[i])


@njit(cache=True)
def round_f16_array(a):
    """Elementwise round_f16 of a float32 array of any shape -> new (C-contiguous) array."""
    a = np.ascontiguousarray(a)
    out = np.empty_like(a)
    fa = a.reshape(-1)
    fo = out.reshape(-1)
    for i in range(fa.shape[0]):
        fo[i] = round_f16(fa[i])
    return out


# --------------------------------------------------------------------------------------------
# norms


@njit(cache=True, fastmath=False)  # serial: per-call thread start-up costs more than these small ops
def rms_norm(x, weight, eps):
    """x: [T, D] f32, weight: [D] f32 -> [T, D]; ggml_rms_norm then ggml_mul by the weight.

    sum of float32 squares in float64 (sequential), mean rounded to float32,
    scale = 1/sqrtf(mean + eps), y = (x*scale)*w."""
    T, D = x.shape
    out = np.empty_like(x)
    for t in prange(T):
        acc = 0.0  # float64, as ggml_float
        for i in range(D):
            sq = np.float32(x[t, i] * x[t, i])
            acc += sq
        mean = np.float32(acc / D)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))
        for i in range(D):
            out[t, i] = np.float32(x[t, i] * scale) * weight[i]
    return out


@njit(cache=True)  # serial: per-call thread start-up costs more than these small ops
def rms_norm_heads(x, weight, eps):
    """Per-head RMSNorm (qwen3 q/k norm). x: [T, H, Dh], weight: [Dh] -> [T, H, Dh]."""
    T, H, Dh = x.shape
    out = np.empty_like(x)
    for th in prange(T * H):
        t = th // H
        h = th % H
        acc = 0.0
        for i in range(Dh):
            acc += np.float32(x[t, h, i] * x[t, h, i])
        mean = np.float32(acc / Dh)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))
        for i in range(Dh):
            out[t, h, i] = np.float32(x[t, h, i] * scale) * weight[i]
    return out


# --------------------------------------------------------------------------------------------
# RoPE


def rope_cache(positions: np.ndarray, n_dims: int, freq_base: float, freq_scale: float,
               ext_factor: float, attn_factor: float, corr_dims: tuple[float, float],
               freq_factors: np.ndarray | None = None) -> np.ndarray:
    """cos/sin table as ggml_rope_cache_init builds it: [T, n_dims/2, 2] f32.

    theta is advanced by repeated float32 multiplication by theta_scale, as ggml does, so the angles
    (and their rounding) match its cache exactly. freq_factors ([n_dims/2], `rope_freqs.weight`)
    divide each pair's angle.
    """
    ff = (np.ones(n_dims // 2, np.float32) if freq_factors is None
          else np.ascontiguousarray(freq_factors, dtype=np.float32))
    return _rope_cache(positions.astype(np.float32), n_dims, np.float32(freq_base), np.float32(freq_scale),
                       np.float32(ext_factor), np.float32(attn_factor),
                       np.float32(corr_dims[0]), np.float32(corr_dims[1]), ff)


@njit(cache=True)
def _rope_cache(positions, n_dims, freq_base, freq_scale, ext_factor, mscale0, corr0, corr1, ff):
    T = positions.shape[0]
    half = n_dims // 2
    cache = np.empty((T, half, 2), dtype=np.float32)
    one = np.float32(1.0)
    theta_scale = np.float32(freq_base ** np.float32(np.float32(-2.0) / np.float32(n_dims)))  # powf
    mscale = mscale0
    if ext_factor != 0.0:
        # mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale), contracted to an fma
        mscale = np.float32(mscale0 * fma32(np.float32(0.1), np.float32(math.log(np.float32(one / freq_scale))), one))
    for t in range(T):
        theta = positions[t]
        for i in range(half):
            theta_extrap = np.float32(theta / ff[i])
            theta_interp = np.float32(freq_scale * theta_extrap)
            th = theta_interp
            if ext_factor != 0.0:
                y = np.float32((np.float32(i) - corr0) / max(np.float32(0.001), np.float32(corr1 - corr0)))
                ramp = one - min(one, max(np.float32(0.0), y))
                ramp_mix = np.float32(ramp * ext_factor)
                # theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix, first product fused
                th = fma32(theta_interp, np.float32(one - ramp_mix), np.float32(theta_extrap * ramp_mix))
            cache[t, i, 0] = np.float32(math.cos(th)) * mscale  # cosf, sinf
            cache[t, i, 1] = np.float32(math.sin(th)) * mscale
            theta = np.float32(theta * theta_scale)
    return cache


@njit(cache=True)  # serial: per-call thread start-up costs more than these small ops
def apply_rope(x, cache, n_dims, neox):
    """x: [T, H, Dh] f32, cache: [T, n_dims/2, 2] -> rotated copy.

    NORM rotates adjacent pairs (x[2i], x[2i+1]); NEOX rotates halves (x[i], x[i + n_dims/2]).
    Dimensions past n_dims pass through. As ggml's rotate_pairs compiled with FMA contraction:
    x0' = fma(x0, cos, -(x1*sin)), x1' = fma(x0, sin, x1*cos).
    """
    T, H, Dh = x.shape
    out = x.copy()
    half = n_dims // 2
    for th in prange(T * H):
        t = th // H
        h = th % H
        for i in range(half):
            c = cache[t, i, 0]
            s = cache[t, i, 1]
            if neox:
                a = i
                b = i + half
            else:
                a = 2 * i
                b = 2 * i + 1
            x0 = x[t, h, a]
            x1 = x[t, h, b]
            out[t, h, a] = fma32(x0, c, -(x1 * s))
            out[t, h, b] = fma32(x0, s, x1 * c)
    return out


@njit(cache=True)  # serial, as its parts
def norm_rope_qk(q, k, q_norm, k_norm, has_norm, eps, cache, n_dims, neox):
    """The queries and keys of an attention layer: per-head RMSNorm (has_norm: qwen3's q/k norms)
    then RoPE, in one call. q: [T, H, Dh], k: [T, Hkv, Dh] -> rotated copies (the bits of
    rms_norm_heads and apply_rope called apart)."""
    if has_norm:
        q = rms_norm_heads(q, q_norm, eps)
        k = rms_norm_heads(k, k_norm, eps)
    return apply_rope(q, cache, n_dims, neox), apply_rope(k, cache, n_dims, neox)


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the dimension range over which YaRN ramps between interpolation
    and extrapolation."""
    def corr_dim(n_rot: float) -> float:
        f32 = np.float32
        return float(f32(n_dims) * f32(math.log(f32(n_ctx_orig) / f32(f32(n_rot) * f32(2.0 * math.pi))))
                     / f32(f32(2.0) * f32(math.log(f32(freq_base)))))
    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return float(max(0.0, start)), float(min(n_dims - 1, end))


# --------------------------------------------------------------------------------------------
# attention

class _F32x8(types.Type):
    """Eight float32 lanes held in one LLVM <8 x float> value (a ymm register), so loop-carried
    lane accumulators stay in registers."""

    def __init__(self):
        super().__init__(name="f32x8")


f32x8 = _F32x8()
_V8 = ir.VectorType(ir.FloatType(), 8)


@register_model(_F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V8)


def _is_f32_vec(t):
    return isinstance(t, types.Array) and t.dtype == types.float32 and t.ndim == 1 and t.layout == "C"


def _vload8(context, builder, arrty, arr, idx):
    ary = context.make_array(arrty)(context, builder, arr)
    ptr = builder.gep(ary.data, [idx])
    return builder.load(builder.bitcast(ptr, _V8.as_pointer()), align=4)


@intrinsic
def zeros8(typingctx):
    """f32x8 of +0.0."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_V8, [0.0] * 8)

    return f32x8(), codegen


@intrinsic
def madd8(typingctx, acc, a, ia, b, ib):
    """Lane-wise acc + a[ia:ia+8] * b[ib:ib+8] (the product rounded, then added: an exact FMA
    emulation when the products are exact, as f16 x f16 ones are). a and b: contiguous 1-D
    float32 arrays (not bounds checked)."""
    if acc != f32x8 or not (_is_f32_vec(a) and _is_f32_vec(b)):
        return None

    def codegen(context, builder, sig, args):
        x = _vload8(context, builder, sig.args[1], args[1], args[2])
        y = _vload8(context, builder, sig.args[3], args[3], args[4])
        return builder.fadd(args[0], builder.fmul(x, y))

    return f32x8(acc, a, ia, b, ib), codegen


@intrinsic
def axpy8(typingctx, y, iy, alpha, x, ix):
    """y[iy:iy+8] += alpha * x[ix:ix+8] lane-wise (product rounded, then added) in memory."""
    if not (_is_f32_vec(y) and _is_f32_vec(x) and alpha == types.float32):
        return None

    def codegen(context, builder, sig, args):
        yv = _vload8(context, builder, sig.args[0], args[0], args[1])
        xv = _vload8(context, builder, sig.args[3], args[3], args[4])
        av = builder.insert_element(ir.Constant(_V8, ir.Undefined), args[2], ir.Constant(ir.IntType(32), 0))
        av = builder.shuffle_vector(av, ir.Constant(_V8, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))
        res = builder.fadd(yv, builder.fmul(av, xv))
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        builder.store(res, builder.bitcast(ptr, _V8.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(y, iy, alpha, x, ix), codegen


@intrinsic
def lane8(typingctx, v, r):
    """Lane r (a literal or runtime int) of an f32x8."""
    if v != f32x8 or not isinstance(r, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])

    return types.float32(v, r), codegen


@njit(cache=True, inline="always")
def hsum8v(v):
    """hsum8 of an f32x8."""
    return hsum8(lane8(v, 0), lane8(v, 1), lane8(v, 2), lane8(v, 3),
                 lane8(v, 4), lane8(v, 5), lane8(v, 6), lane8(v, 7))


@njit(cache=True, inline="always")
def reduce32v(a0, a1, a2, a3):
    """GGML_F32x8_REDUCE of 4 accumulators of 8 lanes (ggml_vec_dot_f16 / _f32 on AVX2) -> f32:
    (a0 + a2) + (a1 + a3) lane-wise, then the low + high half and two hadds."""
    return reduce8_hadd(
        (lane8(a0, 0) + lane8(a2, 0)) + (lane8(a1, 0) + lane8(a3, 0)),
        (lane8(a0, 1) + lane8(a2, 1)) + (lane8(a1, 1) + lane8(a3, 1)),
        (lane8(a0, 2) + lane8(a2, 2)) + (lane8(a1, 2) + lane8(a3, 2)),
        (lane8(a0, 3) + lane8(a2, 3)) + (lane8(a1, 3) + lane8(a3, 3)),
        (lane8(a0, 4) + lane8(a2, 4)) + (lane8(a1, 4) + lane8(a3, 4)),
        (lane8(a0, 5) + lane8(a2, 5)) + (lane8(a1, 5) + lane8(a3, 5)),
        (lane8(a0, 6) + lane8(a2, 6)) + (lane8(a1, 6) + lane8(a3, 6)),
        (lane8(a0, 7) + lane8(a2, 7)) + (lane8(a1, 7) + lane8(a3, 7)))


@njit(cache=True, inline="always")
def dot_f16_sgemm(a, b):
    """llamafile tinyBLAS<8> F16 dot (what a batch of >= 2 tokens gets): lane r sums a[i]*b[i]
    over i % 8 == r in order, then hsum8. len % 8 == 0. Products of f16 values are exact in
    float32, so the FMA is a plain add of the product."""
    acc = zeros8()
    for i in range(0, a.shape[0], 8):
        acc = madd8(acc, a, i, b, i)
    return hsum8v(acc)


@njit(cache=True, inline="always")
def dot_f16_vec(a, b):
    """ggml_vec_dot_f16 on AVX2 (what a single token gets): 4 accumulators x 8 lanes over steps
    of 32, GGML_F32x8_REDUCE, then the n % 32 leftovers added in float64. len % 8 == 0."""
    n = a.shape[0]
    np_ = n - n % 32
    a0 = zeros8()
    a1 = zeros8()
    a2 = zeros8()
    a3 = zeros8()
    for i in range(0, np_, 32):
        a0 = madd8(a0, a, i, b, i)
        a1 = madd8(a1, a, i + 8, b, i + 8)
        a2 = madd8(a2, a, i + 16, b, i + 16)
        a3 = madd8(a3, a, i + 24, b, i + 24)
    s = np.float64(reduce32v(a0, a1, a2, a3))
    for i in range(np_, n):
        s += np.float64(a[i] * b[i])
    return np.float32(s)


def attention(q, k_cache, v_cache, positions, scale, window, sinks, round_weights_f16):
    """Causal multi-head attention of one sequence against its KV cache.

    q: [T, H, Dh] f32 (already rounded to f16 values in ggml numerics); k_cache: [C, Hkv, Dh],
    v_cache: [C, Hkv, Dv] (f16 values stored as f32); positions: [T] int64 (position of each
    query; cache rows 0..pos are visible, row index = position = llama.cpp's KV cell); window:
    sliding window (0 = full): key j is visible from query position p iff p - j < window;
    sinks: [H] f32 extra softmax logit per head (empty = none).

    round_weights_f16 selects ggml numerics, i.e. llama.cpp without flash attention:
    kq = K·q as an f16 mul_mat (tinyBLAS lanes for T >= 2 tokens, ggml_vec_dot_f16 for T == 1),
    soft_max_ext (kq*scale, v_expf over 8-aligned groups of the KV row with float32 group sums
    into a float64 total, sinks through expf), weights rounded to f16, then V·w as an f16 mul_mat
    (lanes over the KV index j: j % 8 for T >= 2, j % 32 for T == 1). Otherwise plain float32.
    -> [T, H, Dv]
    """
    T = q.shape[0]
    kb, nchunk = _attention_split(T, k_cache.shape[1])
    return _attention(np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(k_cache, dtype=np.float32),
                      np.ascontiguousarray(v_cache, dtype=np.float32),
                      np.ascontiguousarray(positions, dtype=np.int64), np.float32(scale), int(window),
                      np.ascontiguousarray(sinks, dtype=np.float32), bool(round_weights_f16), kb, nchunk)


def attention_decode(q, k_new, v_new, k_caches, v_caches, layer, positions, scale, window, sinks,
                     round_weights_f16):
    """One decode step of B sequences in one call: query b is the single new token of sequence b.

    Stores k_new[b], v_new[b] at cell positions[b] of layer `layer` of k_caches[b], v_caches[b],
    then attends each query to cells 0..positions[b] of its own cache, computed exactly as
    attention() computes a one-token call for that sequence.
    q: [B, H, Dh]; k_new: [B, Hkv, Dh]; v_new: [B, Hkv, Dv]; k_caches, v_caches: numba typed
    Lists of B float32 arrays [n_layer, C_b, Hkv, Dh|Dv] with C_b > positions[b]. -> [B, H, Dv]
    """
    B = q.shape[0]
    kb, nchunk = _attention_split(B, k_new.shape[1])
    return _attention_decode(np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(k_new, dtype=np.float32),
                             np.ascontiguousarray(v_new, dtype=np.float32), k_caches, v_caches, int(layer),
                             np.ascontiguousarray(positions, dtype=np.int64), np.float32(scale), int(window),
                             np.ascontiguousarray(sinks, dtype=np.float32), bool(round_weights_f16), kb, nchunk)


def _attention_split(rows: int, n_head_kv: int) -> tuple[int, int]:
    """Work items are (query row, block of kb KV heads). Whole rows of the cache (all KV heads of
    a position) are read sequentially when kb == Hkv; the heads are split only when there are too
    few rows to keep the threads busy. Results do not depend on the split. -> (kb, chunks)"""
    nth = numba.get_num_threads()
    nblk = 1 if rows >= 2 * nth else min(n_head_kv, -(-2 * nth // rows))
    kb = -(-n_head_kv // nblk)
    nitem = rows * (-(-n_head_kv // kb))
    return kb, max(1, min(nitem, 4 * nth))


@njit(parallel=True, cache=True)
def _attention(q, k_cache, v_cache, positions, scale, window, sinks, ggml, kb, nchunk):
    T, H = q.shape[0], q.shape[1]
    Hkv = k_cache.shape[1]
    Dv = v_cache.shape[2]
    C = k_cache.shape[0]
    G = H // Hkv
    out = np.zeros((T, H, Dv), dtype=np.float32)
    many = T >= 2
    NL = 8 if many and Dv % 4 == 0 else 32  # lanes of the KQV sum over the KV index (as _attend)
    nblk = -(-Hkv // kb)
    nitem = T * nblk
    for c in prange(nchunk):
        w = np.empty((kb * G, C + 8), dtype=np.float32)
        acc = np.empty((kb * G, NL, Dv), dtype=np.float32)
        for item in range(c * nitem // nchunk, (c + 1) * nitem // nchunk):
            t = item // nblk
            kh0 = (item % nblk) * kb
            _attend(q[t], k_cache, v_cache, positions[t], window, kh0, min(Hkv, kh0 + kb), scale, sinks,
                    ggml, many, w, acc, out[t])
    return out


@njit(cache=True)
def write_kv(k_caches, v_caches, layer, positions, k_new, v_new):
    """Row b's key and value [Hkv, Dh|Dv] into its sequence's cache cell (layer, positions[b]) ->
    the most cells a row attends to."""
    C = 1
    for b in range(k_new.shape[0]):
        k_caches[b][layer, positions[b]] = k_new[b]
        v_caches[b][layer, positions[b]] = v_new[b]
        C = max(C, positions[b] + 1)
    return C


@njit(parallel=True, cache=True)
def _attention_decode(q, k_new, v_new, k_caches, v_caches, layer, positions, scale, window, sinks, ggml,
                      kb, nchunk):
    B, H = q.shape[0], q.shape[1]
    Hkv = k_new.shape[1]
    Dv = v_new.shape[2]
    G = H // Hkv
    C = write_kv(k_caches, v_caches, layer, positions, k_new, v_new)  # the step's cells first
    out = np.zeros((B, H, Dv), dtype=np.float32)
    nblk = -(-Hkv // kb)
    nitem = B * nblk
    for c in prange(nchunk):
        w = np.empty((kb * G, C + 8), dtype=np.float32)
        acc = np.empty((kb * G, 32, Dv), dtype=np.float32)
        for item in range(c * nitem // nchunk, (c + 1) * nitem // nchunk):
            b = item // nblk
            kh0 = (item % nblk) * kb
            _attend(q[b], k_caches[b][layer], v_caches[b][layer], positions[b], window, kh0, min(Hkv, kh0 + kb),
                    scale, sinks, ggml, False, w, acc, out[b])
    return out


@njit(cache=True, inline="always")
def _attend(qt, k_cache, v_cache, p, window, kh0, kh1, scale, sinks, ggml, many, w, acc, ot):
    """Query row qt [H, Dh] at position p, heads of KV heads kh0..kh1-1, against cache cells
    lo..p -> ot [H, Dv] (those heads; zeros on entry). many: the call has >= 2 query rows (llama.cpp
    then takes tinyBLAS for K·q and V·w). w: [>= heads, p + 1 - lo] and acc: [>= heads, NL, Dv]
    scratch."""
    H, Dh = qt.shape
    Hkv = k_cache.shape[1]
    Dv = v_cache.shape[2]
    G = H // Hkv
    has_sinks = sinks.shape[0] > 0
    lo = 0
    if window > 0:
        lo = max(0, p - window + 1)
    if not ggml:
        for h in range(kh0 * G, kh1 * G):
            _attn_row_f32(qt[h], k_cache, v_cache, h // G, lo, p, scale, has_sinks, sinks, h, w[h - kh0 * G], ot[h])
        return
    sg_kq = many and Dh % 8 == 0  # tinyBLAS needs k % 8 == 0 (and m = n_kv % 4 == 0: always)
    NL = 8 if many and Dv % 4 == 0 else 32  # tinyBLAS for V·w: m = Dv % 4 == 0, k = n_kv % 8 == 0 (padded)
    vec_kq = Dh % 8 == 0 and not sg_kq  # the 32-lane vec_dot path can use 8-wide loads
    # KQ, then kq*scale (soft_max_ext's vec_scale): w[h - kh0*G, j - lo]
    for j in range(lo, p + 1):
        for kh in range(kh0, kh1):
            kj = k_cache[j, kh]
            for h in range(kh * G, kh * G + G):
                qv = qt[h]
                if sg_kq:
                    s = dot_f16_sgemm(qv, kj)
                elif vec_kq:
                    s = dot_f16_vec(kj, qv)
                else:
                    s = _dot_f16_vec_scalar(kj, qv)
                w[h - kh0 * G, j - lo] = np.float32(s * scale)
    for h in range(kh0 * G, kh1 * G):
        _softmax_kv_row(w[h - kh0 * G], lo, p, has_sinks, sinks, h)
    # KQV: out[d] = reduce over lanes r of sum_{j % NL == r} w[j] * v[j, d]
    acc[:] = 0.0
    for j in range(lo, p + 1):
        r = j % NL
        for kh in range(kh0, kh1):
            vj = v_cache[j, kh]
            for h in range(kh * G - kh0 * G, kh * G + G - kh0 * G):
                wj = w[h, j - lo]
                if wj != 0.0:  # zero weights add exact zeros
                    a = acc[h, r]
                    if Dv % 8 == 0:
                        for d in range(0, Dv, 8):
                            axpy8(a, d, wj, vj, d)
                    else:
                        for d in range(Dv):
                            a[d] += wj * vj[d]
    for h in range(kh0 * G, kh1 * G):
        o = ot[h]
        ag = acc[h - kh0 * G]
        if NL == 8:
            for d in range(Dv):
                o[d] = hsum8(ag[0, d], ag[1, d], ag[2, d], ag[3, d], ag[4, d], ag[5, d], ag[6, d], ag[7, d])
        else:
            for d in range(Dv):
                o[d] = _reduce32_col(ag, d)


@njit(cache=True, inline="always")
def _reduce32_col(ag, d):
    """GGML_F32x8_REDUCE of column d of 32 lane rows ag[0:32, d] (lane r = accumulator r // 8,
    element r % 8) -> f32."""
    return reduce8_hadd((ag[0, d] + ag[16, d]) + (ag[8, d] + ag[24, d]),
                        (ag[1, d] + ag[17, d]) + (ag[9, d] + ag[25, d]),
                        (ag[2, d] + ag[18, d]) + (ag[10, d] + ag[26, d]),
                        (ag[3, d] + ag[19, d]) + (ag[11, d] + ag[27, d]),
                        (ag[4, d] + ag[20, d]) + (ag[12, d] + ag[28, d]),
                        (ag[5, d] + ag[21, d]) + (ag[13, d] + ag[29, d]),
                        (ag[6, d] + ag[22, d]) + (ag[14, d] + ag[30, d]),
                        (ag[7, d] + ag[23, d]) + (ag[15, d] + ag[31, d]))


@njit(cache=True)
def _dot_f16_vec_scalar(a, b):
    """dot_f16_vec without vector loads (any length)."""
    n = a.shape[0]
    np_ = n - n % 32
    lanes = np.zeros(32, np.float32)
    for i in range(0, np_, 32):
        for r in range(32):
            lanes[r] += a[i + r] * b[i + r]
    s = np.float64(_reduce32_col(lanes.reshape(32, 1), 0))
    for i in range(np_, n):
        s += np.float64(a[i] * b[i])
    return np.float32(s)


@njit(cache=True, inline="always")
def _wval(w, j, lo, p):
    """exp of KV cell j from w (cells lo..p), 0 for masked cells."""
    if j < lo or j > p:
        return np.float32(0.0)
    return w[j - lo]


@njit(cache=True, inline="always")
def _softmax_kv_row(w, lo, p, has_sinks, sinks, h):
    """In place on w[0 : p+1-lo] (scaled scores of KV cells lo..p): soft_max_ext + sinks, the
    weights rounded to f16. ggml's row spans all n_kv cells with -inf outside lo..p; its
    ggml_vec_soft_max_f32 runs v_expf over groups of 8 cells from cell 0 and sums each group in
    float32 (masked cells add exact zeros), so the groups are aligned on the absolute cell index."""
    n = p + 1 - lo
    mx = np.float32(-np.inf)
    for i in range(n):
        if w[i] > mx:
            mx = w[i]
    if has_sinks and sinks[h] > mx:
        mx = sinks[h]
    for i in range(n):
        w[i] = v_expf(np.float32(w[i] - mx))
    total = 0.0
    for gs in range(lo - lo % 8, p + 1, 8):
        total += np.float64(hsum8(_wval(w, gs, lo, p), _wval(w, gs + 1, lo, p), _wval(w, gs + 2, lo, p),
                                  _wval(w, gs + 3, lo, p), _wval(w, gs + 4, lo, p), _wval(w, gs + 5, lo, p),
                                  _wval(w, gs + 6, lo, p), _wval(w, gs + 7, lo, p)))
    if has_sinks:
        total += np.float64(expf(np.float32(sinks[h] - mx)))
    inv = np.float32(1.0 / total)
    for i in range(n):
        w[i] = round_f16(np.float32(w[i] * inv))


@njit(cache=True)
def _attn_row_f32(qv, k_cache, v_cache, kh, lo, p, scale, has_sinks, sinks, h, w, o):
    """Plain float32 attention for one query row ("float32" numerics)."""
    Dh = qv.shape[0]
    Dv = o.shape[0]
    n = p + 1 - lo
    mx = np.float32(-np.inf)
    for j in range(n):
        acc = np.float32(0.0)
        kj = k_cache[lo + j, kh]
        for d in range(Dh):
            acc += qv[d] * kj[d]
        s = np.float32(acc * scale)
        w[j] = s
        if s > mx:
            mx = s
    if has_sinks and sinks[h] > mx:
        mx = sinks[h]
    total = 0.0
    for j in range(n):
        e = np.float32(math.exp(np.float32(w[j] - mx)))
        w[j] = e
        total += e
    if has_sinks:
        total += np.float32(math.exp(np.float32(sinks[h] - mx)))
    inv = np.float32(1.0 / total)
    for j in range(n):
        wj = np.float32(w[j] * inv)
        vj = v_cache[lo + j, kh]
        for d in range(Dv):
            o[d] += wj * vj[d]


# --------------------------------------------------------------------------------------------
# activations and softmax


@njit(cache=True)
def _f64_sum(v):
    """numpy's float64 sum of a short row (pairwise_sum up to 128 values): in order below 8 values,
    else eight running sums combined ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the rest in order."""
    n = v.shape[0]
    if n < 8:
        res = 0.0
        for i in range(n):
            res += np.float64(v[i])
        return res
    r = np.empty(8, np.float64)
    for j in range(8):
        r[j] = np.float64(v[j])
    i = 8
    while i < n - n % 8:
        for j in range(8):
            r[j] += np.float64(v[i + j])
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res += np.float64(v[i])
        i += 1
    return res


@njit(cache=True)  # serial: a decode step's router is one row
def route_top_k(logits, k, weight_softmax, norm_topk, scale, chosen):
    """The router's choice as CPUBackend.router makes it with numpy, in one call: logits [T, E] ->
    ids [T, k] int64 (largest first, the lower index first among equals, as a stable argsort of the
    negated scores), weights [T, k] f32. weight_softmax (gpt-oss): top-k of the logits, weights the
    softmax of those; else top-k of softmax_rows(logits), weights their probabilities. norm_topk:
    divided by their float64 sum (numpy's order) rounded to f32, at least 2^-14; scale: times it.
    chosen: ids [T, k] int64 to weigh instead of the top-k (routing replay), or an empty array."""
    T, E = logits.shape
    scores = logits if weight_softmax else softmax_rows(logits)
    ids = np.empty((T, k), np.int64)
    weights = np.empty((T, k), np.float32)
    taken = np.zeros(E, np.bool_)
    for t in range(T):
        taken[:] = False
        for a in range(k):
            best = -1
            if chosen.shape[0]:
                best = chosen[t, a]
            else:
                for e in range(E):
                    if not taken[e] and (best < 0 or scores[t, e] > scores[t, best]):
                        best = e
                taken[best] = True
            ids[t, a] = best
            weights[t, a] = scores[t, best]
    if weight_softmax:
        weights = softmax_rows(weights)
    for t in range(T):
        if norm_topk:
            total = np.float32(_f64_sum(weights[t]))
            if total < np.float32(6.103515625e-5):  # np.maximum: a NaN stays NaN
                total = np.float32(6.103515625e-5)
            for a in range(k):
                weights[t, a] = weights[t, a] / total
        if scale != 0:
            for a in range(k):
                weights[t, a] = weights[t, a] * np.float32(scale)
    return ids, weights


@njit(cache=True)  # serial: per-call thread start-up costs more than this small op
def moe_mix(y, slot_rows, weights):
    """The weighted sum of each token's expert outputs, in top-k order, in float32:
    out[t] = ((y[r0] * w0 + y[r1] * w1) + y[r2] * w2) + ..., r_a = slot_rows[t, a], w_a = weights[t, a]
    (llama.cpp's chain of ggml_add over the weighted expert views). y: [P, D] expert outputs;
    slot_rows: [T, A] int64 rows of y; weights: [T, A] f32 -> [T, D]"""
    T, A = slot_rows.shape
    D = y.shape[1]
    out = np.empty((T, D), np.float32)
    for t in range(T):
        r = slot_rows[t, 0]
        w = weights[t, 0]
        for d in range(D):
            out[t, d] = y[r, d] * w
        for a in range(1, A):
            r = slot_rows[t, a]
            w = weights[t, a]
            for d in range(D):
                out[t, d] = out[t, d] + y[r, d] * w
    return out


def swiglu(gate, up):
    """silu(gate) * up, elementwise; [T, F] -> [T, F] (ggml_swiglu_split -> ggml_vec_swiglu_f32:
    ggml_v_silu on each full group of 8 of a row, the scalar ggml_silu_f32 on the rest)."""
    # threads only pay off on large inputs (a decode batch's expert rows, prefill)
    return (_swiglu_parallel if gate.size >= 1 << 14 else _swiglu_serial)(gate, up)


@njit(cache=True, error_model="numpy")
def _swiglu_serial(gate, up):
    out = np.empty_like(gate)
    nv = gate.shape[1] - gate.shape[1] % 8
    for t in range(gate.shape[0]):
        _swiglu_row(gate[t], up[t], out[t], nv)
    return out


@njit(cache=True, error_model="numpy", parallel=True)
def _swiglu_parallel(gate, up):
    out = np.empty_like(gate)
    nv = gate.shape[1] - gate.shape[1] % 8
    for t in prange(gate.shape[0]):
        _swiglu_row(gate[t], up[t], out[t], nv)
    return out


@njit(cache=True, error_model="numpy")
def _swiglu_row(g, u, o, nv):
    for i in range(nv):  # 1-D loop: vectorizes (v_expf is branch-free)
        o[i] = v_silu(g[i]) * u[i]
    for i in range(nv, g.shape[0]):
        o[i] = silu_f32(g[i]) * u[i]


@njit(cache=True, error_model="numpy")  # serial: per-call thread start-up costs more than these small ops
def silu(x):
    """ggml_silu on [T, N] rows (ggml_vec_silu_f32: SIMD groups of 8, scalar tail) -> [T, N]."""
    T, N = x.shape
    out = np.empty_like(x)
    nv = N - N % 8
    for t in prange(T):
        xr = x[t]
        o = out[t]
        for i in range(nv):
            o[i] = v_silu(xr[i])
        for i in range(nv, N):
            o[i] = silu_f32(xr[i])
    return out


@njit(cache=True, error_model="numpy")
def swiglu_oai_row(g, u, o, alpha, limit):
    """gpt-oss's clamped SwiGLU of one row (ggml_compute_forward_swiglu_oai_f32, scalar expf), all
    in float32: x = min(g, limit); y = clamp(u, -limit, limit); o = x / (1 + expf(alpha * -x)) * (y + 1)."""
    for i in range(g.shape[0]):
        x = min(g[i], limit)
        y = min(max(u[i], -limit), limit)
        glu = np.float32(x / np.float32(np.float32(1.0) + expf(np.float32(alpha * -x))))
        o[i] = np.float32(glu * np.float32(y + np.float32(1.0)))


@njit(cache=True, error_model="numpy")  # serial: per-call thread start-up costs more than these small ops
def swiglu_oai(gate, up, alpha, limit):
    """swiglu_oai_row over [T, F] -> [T, F]."""
    out = np.empty_like(gate)
    for t in range(gate.shape[0]):
        swiglu_oai_row(gate[t], up[t], out[t], alpha, limit)
    return out


@njit(cache=True)
def softmax_rows(x):
    """Row softmax like ggml_soft_max (no mask, scale 1): max, then ggml_vec_soft_max_f32 (v_expf
    on groups of 8 summed in float32 then into a float64 total, scalar expf on the n % 8 tail),
    then multiplication by (float)(1/sum). [T, N] -> [T, N]."""
    T, N = x.shape
    out = np.empty_like(x)
    nv = N - N % 8
    for t in range(T):
        mx = np.float32(-np.inf)
        for i in range(N):
            if x[t, i] > mx:
                mx = x[t, i]
        total = 0.0
        for g in range(0, nv, 8):
            for i in range(g, g + 8):
                out[t, i] = v_expf(np.float32(x[t, i] - mx))
            total += np.float64(hsum8(out[t, g], out[t, g + 1], out[t, g + 2], out[t, g + 3],
                                      out[t, g + 4], out[t, g + 5], out[t, g + 6], out[t, g + 7]))
        for i in range(nv, N):
            e = expf(np.float32(x[t, i] - mx))
            out[t, i] = e
            total += np.float64(e)
        inv = np.float32(1.0 / total)
        for i in range(N):
            out[t, i] = np.float32(out[t, i] * inv)
    return out
