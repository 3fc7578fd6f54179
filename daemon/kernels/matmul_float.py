"""Float weight kernels (numba): out[t, n] = W[n] . x[t] for F32, F16 and BF16 weights in llama.cpp's
"ggml" numerics, bit for bit as its x86 (AVX2 + FMA) build.

Legend: T = activation rows, K = input features, N = weight rows.

The products are exact in float32 for F16/BF16 (their values and the rounded activations have at
most 11 significant bits), and F32 uses real FMAs. Two summation orders, as llama.cpp:
* tinyBLAS (llamafile_sgemm, AVX2; ordinary matmuls with >= 2 rows, N % 4 == 0, K % 8 == 0):
  eight lanes, lane = fma(w_k, x_k, lane) for k = lane mod 8, result hsum_float_8.
* vec_dot otherwise (ggml_vec_dot_f32/f16/bf16): four <8 x float> accumulators over steps of
  32 values, combined as (a0+a2)+(a1+a3), reduced by two hadd (F32/F16) or as hsum_float_8
  (BF16); the K % 32 leftovers are added in float32 with FMA (F32) or in double (F16/BF16).
"""

from __future__ import annotations

import functools

import numba
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from daemon.kernels import matmul_types
from daemon.kernels import quants as Q
from daemon.kernels import simd_ir
from daemon.kernels.matmul_types import FLOAT, of_family
from daemon.kernels.simd_ir import (F32, I16, I32, c64, c_arrays, fma, hadd8f, hsum8f, literal_int, load,
                                    row_address, row_pointers, splat_const, vec)

FLOAT_KINDS = of_family(FLOAT)

# The kernels inline IR built in these files; numba's cache only watches this one (simd_ir.source_stamp).
_SOURCES = simd_ir.source_stamp(simd_ir.__file__, matmul_types.__file__, __file__)


def _ld_w8(builder, k, wp, off):
    """8 weights from element offset off (i64) as <8 x float>."""
    if k == Q.F32:
        return load(builder, wp, builder.mul(off, c64(4)), vec(F32, 8), 4)
    h = load(builder, wp, builder.mul(off, c64(2)), vec(I16, 8), 2)
    if k == Q.F16:
        return builder.fpext(builder.bitcast(h, vec(ir.HalfType(), 8)), vec(F32, 8))
    return builder.bitcast(builder.shl(builder.zext(h, vec(I32, 8)), splat_const(I32, 8, 16)), vec(F32, 8))


def _ld_w1(builder, k, wp, off):
    if k == Q.F32:
        return load(builder, wp, builder.mul(off, c64(4)), F32, 4)
    h = load(builder, wp, builder.mul(off, c64(2)), I16, 2)
    if k == Q.F16:
        return builder.fpext(builder.bitcast(h, ir.HalfType()), F32)
    return builder.bitcast(builder.shl(builder.zext(h, I32), ir.Constant(I32, 16)), F32)


@intrinsic
def float_rows(typingctx, kind, tiny, ntok, w, n, x, t0):
    """Tokens t0 .. t0+ntok-1 (ntok 1 or 4) against row n of an F32/F16/BF16 weight w [N, K] (its
    raw integer bits, any integer dtype) with tinyBLAS's (tiny=1) or vec_dot's (tiny=0) order.
    x: float32 [T, K] (already rounded to f16/bf16 for those types)."""
    k = literal_int(kind, FLOAT_KINDS)
    tn = literal_int(tiny, (0, 1))
    m = literal_int(ntok, (1, 4))
    if k is None or tn is None or m is None or not c_arrays(w, x) or w.ndim != 2 \
            or not isinstance(n, types.Integer) or not isinstance(t0, types.Integer):
        return None
    sig = types.UniTuple(types.float32, m)(kind, tiny, ntok, w, n, x, t0)

    def codegen(context, builder, sig, args):
        _, _, _, w, n, x, t0 = args
        wp = row_address(context, builder, sig.args[3], w, [context.cast(builder, n, sig.args[4], types.int64)])
        t0 = context.cast(builder, t0, sig.args[6], types.int64)
        xrows, xa = row_pointers(context, builder, sig.args[5], x, t0, m)
        K = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
        zero8 = ir.Constant(vec(F32, 8), [0.0] * 8)
        if tn:
            acc = [cgutils.alloca_once_value(builder, zero8) for _ in range(m)]
            with cgutils.for_range(builder, builder.ashr(K, c64(3))) as loop:
                off = builder.mul(loop.index, c64(8))
                w = _ld_w8(builder, k, wp, off)
                for i in range(m):
                    xv = load(builder, xrows[i], builder.mul(off, c64(4)), vec(F32, 8), 4)
                    builder.store(fma(builder, w, xv, builder.load(acc[i])), acc[i])
            out = [hsum8f(builder, builder.load(a)) for a in acc]
            return context.make_tuple(builder, sig.return_type, out)
        acc = [[cgutils.alloca_once_value(builder, zero8) for _ in range(4)] for _ in range(m)]
        with cgutils.for_range(builder, builder.ashr(K, c64(5))) as loop:
            base = builder.mul(loop.index, c64(32))
            for j in range(4):
                off = builder.add(base, c64(8 * j))
                w = _ld_w8(builder, k, wp, off)
                for i in range(m):
                    xv = load(builder, xrows[i], builder.mul(off, c64(4)), vec(F32, 8), 4)
                    builder.store(fma(builder, w, xv, builder.load(acc[i][j])), acc[i][j])
        np_ = builder.and_(K, c64(~31))
        out = []
        for i in range(m):
            a = [builder.load(v) for v in acc[i]]
            l8 = builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3]))
            red = hsum8f(builder, l8) if k == Q.BF16 else hadd8f(builder, l8)
            if k == Q.F32:
                s = cgutils.alloca_once_value(builder, red)
            else:
                s = cgutils.alloca_once_value(builder, builder.fpext(red, ir.DoubleType()))
            with cgutils.for_range_slice(builder, np_, K, c64(1), inc=True) as (idx, _):
                wv = _ld_w1(builder, k, wp, idx)
                xv = load(builder, xrows[i], builder.mul(idx, c64(4)), F32, 4)
                if k == Q.F32:
                    builder.store(fma(builder, wv, xv, builder.load(s)), s)
                else:
                    builder.store(builder.fadd(builder.load(s), builder.fpext(builder.fmul(wv, xv), ir.DoubleType())), s)
            r = builder.load(s)
            out.append(r if k == Q.F32 else builder.fptrunc(r, F32))
        return context.make_tuple(builder, sig.return_type, out)

    return sig, codegen


@numba.njit(inline="always")
def float_tile(kind, m, tiny, w, n, x, t, out):
    """out[t:t+m, n] = activation rows t..t+m-1 against weight row n (kind, m: literals), in
    tinyBLAS's (tiny != 0) or vec_dot's order."""
    if tiny:
        r = float_rows(kind, 1, m, w, n, x, t)
    else:
        r = float_rows(kind, 0, m, w, n, x, t)
    for i in range(m):
        out[t + i, n] = r[i]


@numba.njit(inline="always")
def float_span(kind, tiny, w, n0, n1, x, t0, t1, out):
    """float_tile's out[t0:t1, n0:n1], in tiles of 4 and 1."""
    for n in range(n0, n1):
        t = t0
        while t + 4 <= t1:
            float_tile(kind, 4, tiny, w, n, x, t, out)
            t += 4
        while t < t1:
            float_tile(kind, 1, tiny, w, n, x, t, out)
            t += 1


@functools.cache
def float_kernel(ggml_type: int):
    """kernel(w, tiny, x, out, nchunks) for one float type, compiled on first use: w [N, K] (the raw
    bits: uint32 for F32, uint16 for F16/BF16), x float32 [T, K] (rounded to the weight type),
    out float32 [T, N]. A thread takes one weight row and applies it to four tokens at a time,
    then one by one. The closure holds the type (a compile-time constant) and the sources'
    stamp, both in numba's cache key."""
    if ggml_type not in FLOAT_KINDS:
        raise ValueError(f"not a float type: {ggml_type}")
    spec = (int(ggml_type), _SOURCES)

    @numba.njit(cache=True, parallel=True)
    def float_ggml(w, tiny, x, out, nchunks):
        kind = spec[0]
        N = w.shape[0]
        for c in prange(nchunks):
            float_span(kind, tiny, w, c * N // nchunks, (c + 1) * N // nchunks, x, 0, x.shape[0], out)

    return float_ggml
