"""Quantized row kernels (numba): out[p, n] = W_e[n] . x[p] for 32-value block and K-quant weights,
with activations quantized as llama.cpp does (matmul_activations.py), bit for bit as llama.cpp's x86
AVX2 kernels (matmul.py's docstring has the numerics).

Legend: T = activation rows, K = input features, N = weight rows, E = experts in a stack,
J = expert groups in a call, B = 32-value blocks per row, S = 256-value super-blocks per row.

Two layers:
* row intrinsics (block32_rows, kquant_rows): the dot products of one weight row with 1 to 8
  consecutive activation rows, emitted as LLVM vector IR (simd_ir.py) from the block decoders
  (matmul_blocks.py). The type (`kind`) and the token count are compile-time literals. A
  multi-token call decodes each block once and then runs the very same per-token operations
  for each token, so a token's result does not depend on the tokens next to it.
* grouped kernels (block32_kernel, kquant_kernel): one parallel call over every (expert, weight
  row) pair of a layer, compiled per weight type on first use.
"""

from __future__ import annotations

import functools

import numba
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from daemon.kernels import matmul_blocks, matmul_types
from daemon.kernels import quants as Q
from daemon.kernels import simd_ir
from daemon.kernels.matmul_blocks import block32_scales, decode_block32, decode_kquant, unsigned_codes
from daemon.kernels.matmul_types import BLOCK32, KQUANT, TYPES, of_family
from daemon.kernels.simd_ir import (F32, I8, I16, I32, byte_ptr, c64, c_arrays, call_llvm, concat, fma, hsum, hsum8f,
                                    lane, literal_int, load, load_f32, pairadd, quads, row_address, row_pointers,
                                    shuffle, splat, splat_const, vec)

BLOCK32_KINDS = of_family(BLOCK32)
KQUANT_KINDS = of_family(KQUANT)

# The kernels inline IR built in these files; numba's cache only watches this one (simd_ir.source_stamp).
_SOURCES = simd_ir.source_stamp(simd_ir.__file__, matmul_blocks.__file__, matmul_types.__file__, __file__)

def _stack_and_indices(stack, e, n) -> bool:
    """stack: a C-contiguous uint8 [E, N, row_bytes]; e, n: integers."""
    return (c_arrays(stack) and stack.ndim == 3 and stack.dtype == types.uint8
            and isinstance(e, types.Integer) and isinstance(n, types.Integer))


# ---- 32-value block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 (activations Q8_0 / Q8_1) ----
#
# As ggml_vec_dot_<w>_q8_0/q8_1 (AVX2) and tinyBLAS_Q0_AVX (same order): per block eight int32
# lanes, lane r = the exact sum of w_e q_e over e = 4r..4r+3 (maddubs + madd with ones), then
# acc = fma(splat(d_w*d_x), float(lanes), acc) in eight float lanes, block after block;
# result hsum_float_8(acc). Q4_1/Q5_1: + summs, summs = fma(m_w, s_x, summs) block after block
# (GCC contracts `summs += m*s`). MXFP4: even blocks in one accumulator, odd ones in another,
# hsum_float_8(acc1 + acc2); an odd last block is added as fma(d, float(sumi), sum).


def _block_pairs(builder, k, w, dw, b, xrows, drows, accs):
    """Block b of tokens (2p, 2p+1) for each pair p: acc_p = fma(dw*d_x as 8+8 lanes, the two
    tokens' exact int32 lanes, acc_p). The lanes are those of quads (vpdpbusd with |w| and x
    negated where w < 0, i.e. the vpsignb trick; lanes where w == 0 multiply by 0 either way)."""
    v64 = vec(I8, 64)
    if unsigned_codes(k):
        w2 = concat(builder, w, w)
        neg2 = None
    else:
        neg = builder.icmp_signed("<", w, ir.Constant(w.type, [0] * 32))
        wa = call_llvm(builder, "llvm.x86.avx2.psign.b", w.type, w, w)
        w2 = concat(builder, wa, wa)
        neg2 = concat(builder, neg, neg)
    zero16 = ir.Constant(vec(I32, 16), [0] * 16)
    off = builder.mul(b, c64(32))
    for p, acc in enumerate(accs):
        x2 = concat(builder, load(builder, xrows[2 * p], off, vec(I8, 32)),
                  load(builder, xrows[2 * p + 1], off, vec(I8, 32)))
        if neg2 is not None:
            x2 = builder.select(neg2, builder.sub(ir.Constant(v64, [0] * 64), x2), x2)
        lanes = builder.sitofp(call_llvm(builder, "llvm.x86.avx512.vpdpbusd.512", zero16.type, zero16, w2, x2),
                               vec(F32, 16))
        s0 = builder.fmul(dw, load_f32(builder, drows[2 * p], b))
        s1 = builder.fmul(dw, load_f32(builder, drows[2 * p + 1], b))
        two = builder.insert_element(builder.insert_element(ir.Constant(vec(F32, 2), ir.Undefined), s0,
                                                            ir.Constant(I32, 0)), s1, ir.Constant(I32, 1))
        sc = shuffle(builder, two, two, [0] * 8 + [1] * 8)
        builder.store(fma(builder, sc, lanes, builder.load(acc)), acc)


def _per_token(builder, accs, pairs):
    """Accumulators -> one <8 x float> per token (pairs: each <16 x float> holds two tokens)."""
    if not pairs:
        return accs
    return [h for v in accs for h in (shuffle(builder, v, v, range(8)), shuffle(builder, v, v, range(8, 16)))]


@intrinsic
def block32_rows(typingctx, kind, ntok, stack, e, n, xq, t0, xd, xs):
    """Tokens t0 .. t0+ntok-1 (ntok 1, 2, 4 or 8) against weight row n of expert e, each as ggml's
    vec_dot (the tokens share the weight decoding only). stack: uint8 [E, N, row_bytes]; xq: int8 [T, K];
    xd, xs: float32 [T, B] (xs read for Q4_1/Q5_1 only)."""
    k = literal_int(kind, BLOCK32_KINDS)
    m = literal_int(ntok, (1, 2, 4, 8))
    if k is None or m is None or not _stack_and_indices(stack, e, n) or not c_arrays(xq, xd, xs) \
            or not isinstance(t0, types.Integer):
        return None
    sig = types.UniTuple(types.float32, m)(kind, ntok, stack, e, n, xq, t0, xd, xs)

    def codegen(context, builder, sig, args):
        _, _, stack, e, n, xq, t0, xd, xs = args
        idx = [context.cast(builder, v, ty, types.int64) for v, ty in zip((e, n), sig.args[3:5])]
        rp = row_address(context, builder, sig.args[2], stack, idx)
        t0 = context.cast(builder, t0, sig.args[6], types.int64)
        xrows, _ = row_pointers(context, builder, sig.args[5], xq, t0, m)
        drows, da = row_pointers(context, builder, sig.args[7], xd, t0, m)
        srows, _ = row_pointers(context, builder, sig.args[8], xs, t0, m)
        nb = cgutils.unpack_tuple(builder, da.shape, 2)[1]
        zero8 = ir.Constant(vec(F32, 8), [0.0] * 8)
        npar = 2 if k == Q.MXFP4 else 1
        # pairs: tokens 2p and 2p+1 share <16 x float> accumulators (lanes 0-7: token 2p), their
        # integer dots one 512-bit vpdpbusd; lane for lane the same operations as one token alone
        pairs = m > 1 and simd_ir.has_avx512_vnni(context)
        if pairs:
            zero16 = ir.Constant(vec(F32, 16), [0.0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero16) for _ in range(npar)] for _ in range(m // 2)]
        else:
            accs = [[cgutils.alloca_once_value(builder, zero8) for _ in range(npar)] for _ in range(m)]
        maccs = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(m)]

        def block(b, par):
            bp = byte_ptr(builder, rp, builder.mul(b, c64(TYPES[k].block_bytes)))
            w = decode_block32(k, context, builder, bp)
            dw, mw = block32_scales(k, builder, bp)
            if pairs:
                _block_pairs(builder, k, w, dw, b, xrows, drows, [a[par] for a in accs])
            for i in range(m):
                if not pairs:
                    x = load(builder, xrows[i], builder.mul(b, c64(32)), vec(I8, 32))
                    lanes = builder.sitofp(quads(context, builder, w, x, unsigned_codes(k)), vec(F32, 8))
                    sc = builder.fmul(dw, load_f32(builder, drows[i], b))
                    acc = accs[i][par]
                    builder.store(fma(builder, splat(builder, sc, 8), lanes, builder.load(acc)), acc)
                if mw is not None:
                    builder.store(fma(builder, mw, load_f32(builder, srows[i], b), builder.load(maccs[i])), maccs[i])

        if k == Q.MXFP4:
            with cgutils.for_range(builder, builder.ashr(nb, c64(1))) as loop:
                b = builder.mul(loop.index, c64(2))
                block(b, 0)
                block(builder.add(b, c64(1)), 1)
            sums = [builder.fadd(builder.load(a[0]), builder.load(a[1])) for a in accs]
            res = [cgutils.alloca_once_value(builder, hsum8f(builder, v)) for v in _per_token(builder, sums, pairs)]
            odd = builder.icmp_signed("!=", builder.and_(nb, c64(1)), c64(0))
            with builder.if_then(odd, likely=False):
                b = builder.sub(nb, c64(1))
                bp = byte_ptr(builder, rp, builder.mul(b, c64(TYPES[k].block_bytes)))
                w = decode_block32(k, context, builder, bp)
                dw, _ = block32_scales(k, builder, bp)
                for i in range(m):
                    x = load(builder, xrows[i], builder.mul(b, c64(32)), vec(I8, 32))
                    sumi = builder.sitofp(hsum(builder, quads(context, builder, w, x, False)), F32)
                    d = builder.fmul(load_f32(builder, drows[i], b), dw)
                    builder.store(fma(builder, d, sumi, builder.load(res[i])), res[i])
            out = [builder.load(r) for r in res]
        else:
            with cgutils.for_range(builder, nb) as loop:
                block(loop.index, 0)
            out = [hsum8f(builder, v) for v in _per_token(builder, [builder.load(a[0]) for a in accs], pairs)]
            if unsigned_codes(k):
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


def _kq_lanes(context, builder, ws, xp, xo):
    """ggml's eight int32 lanes of one super-block (see above), exact: with AVX2
    sum_j vpmaddwd(vpmaddubsw(codes_j, x_j), scales_j); else portable."""
    if simd_ir.has_avx2(context):
        acc = None
        for j, (q, sc16) in enumerate(ws):
            x = load(builder, xp, builder.add(xo, c64(32 * j)), vec(I8, 32))
            p16 = call_llvm(builder, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), q, x)
            v = call_llvm(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), p16, sc16)
            acc = v if acc is None else builder.add(acc, v)
        return acc
    acc = None
    for j, (q, sc16) in enumerate(ws):
        x = load(builder, xp, builder.add(xo, c64(32 * j)), vec(I8, 32))
        sc = builder.sext(shuffle(builder, sc16, sc16, [e // 2 for e in range(32)]), vec(I32, 32))
        p = builder.mul(builder.mul(builder.zext(q, vec(I32, 32)), sc), builder.sext(x, vec(I32, 32)))
        acc = p if acc is None else builder.add(acc, p)
    return pairadd(builder, pairadd(builder, acc))




@intrinsic
def kquant_rows(typingctx, kind, ntok, tiled, stack, e, n, xq, t0, xd, xbs):
    """Tokens t0 .. t0+ntok-1 (ntok 1 or 4) against weight row n of expert e, with ggml's vec_dot
    (tiled=0) or tiled (tiled=1) float epilogue. stack: uint8 [E, N, row_bytes]; xq: int8 [T, K];
    xd: float32 [T, S]; xbs: int32 [T, K/16]."""
    k = literal_int(kind, KQUANT_KINDS)
    m = literal_int(ntok, (1, 4))
    tl = literal_int(tiled, (0, 1))
    if k is None or m is None or tl is None or not _stack_and_indices(stack, e, n) or not c_arrays(xq, xd, xbs) \
            or not isinstance(t0, types.Integer):
        return None
    sig = types.UniTuple(types.float32, m)(kind, ntok, tiled, stack, e, n, xq, t0, xd, xbs)

    def codegen(context, builder, sig, args):
        _, _, _, stack, e, n, xq, t0, xd, xbs = args
        idx = [context.cast(builder, v, ty, types.int64) for v, ty in zip((e, n), sig.args[4:6])]
        rp = row_address(context, builder, sig.args[3], stack, idx)
        t0 = context.cast(builder, t0, sig.args[7], types.int64)
        xrows, _ = row_pointers(context, builder, sig.args[6], xq, t0, m)
        drows, da = row_pointers(context, builder, sig.args[8], xd, t0, m)
        brows, _ = row_pointers(context, builder, sig.args[9], xbs, t0, m)
        ns = cgutils.unpack_tuple(builder, da.shape, 2)[1]
        acc = [cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 8), [0.0] * 8)) for _ in range(m)]
        macc = [cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 4), [0.0] * 4)) for _ in range(m)]
        sacc = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(m)]
        with cgutils.for_range(builder, ns) as loop:
            s = loop.index
            bp = byte_ptr(builder, rp, builder.mul(s, c64(TYPES[k].block_bytes)))
            ws, mins, d, dmin, sc16 = decode_kquant(k, builder, bp)
            xo = builder.mul(s, c64(256))
            for i in range(m):
                lanes = _kq_lanes(context, builder, ws, xrows[i], xo)  # <8 x i32>
                bs = load(builder, brows[i], builder.mul(s, c64(64)), vec(I32, 16), 4)
                if sc16 is not None:
                    corr = builder.shl(pairadd(builder, builder.mul(bs, sc16)), splat_const(I32, 8, 5))
                    lanes = builder.sub(lanes, corr)
                mprod = builder.mul(mins, pairadd(builder, bs)) if mins is not None else None  # <8 x i32>
                dx = load_f32(builder, drows[i], s)
                if tl:
                    res = builder.fmul(d, builder.sitofp(hsum(builder, lanes), F32))
                    if mins is not None:
                        res = fma(builder, builder.fneg(dmin), builder.sitofp(hsum(builder, mprod), F32), res)
                    builder.store(fma(builder, res, dx, builder.load(sacc[i])), sacc[i])
                else:
                    dd = builder.fmul(dx, d)
                    builder.store(fma(builder, splat(builder, dd, 8), builder.sitofp(lanes, vec(F32, 8)),
                                       builder.load(acc[i])), acc[i])
                    if mins is not None:
                        dm = builder.fmul(builder.fneg(dx), dmin)
                        if k == Q.Q4_K:
                            m4 = builder.sitofp(pairadd(builder, mprod), vec(F32, 4))
                            builder.store(fma(builder, splat(builder, dm, 4), m4, builder.load(macc[i])), macc[i])
                        else:
                            sm = builder.sitofp(hsum(builder, mprod), F32)
                            builder.store(fma(builder, dm, sm, builder.load(sacc[i])), sacc[i])
        out = []
        for i in range(m):
            if tl:
                out.append(builder.load(sacc[i]))
                continue
            r = hsum8f(builder, builder.load(acc[i]))
            if k == Q.Q4_K:
                mv = builder.load(macc[i])
                r = builder.fadd(r, builder.fadd(builder.fadd(lane(builder, mv, 0), lane(builder, mv, 2)),
                                                 builder.fadd(lane(builder, mv, 1), lane(builder, mv, 3))))
            elif k == Q.Q5_K:
                r = builder.fadd(r, builder.load(sacc[i]))
            out.append(r)
        return context.make_tuple(builder, sig.return_type, out)

    return sig, codegen


# ---- grouped kernels: out[p, n] = row n of expert experts[j] . activation row p, for the rows
# p in offs[j]..offs[j+1] (the tokens routed to expert j, gathered). One parallel call for every
# expert of a layer (llama.cpp's MUL_MAT_ID); an ordinary matmul is the case of one expert. A
# thread takes one weight row and applies it to the expert's rows eight (block types) or four at
# a time, then one by one (the block is decoded once per tile); tiled[j] picks the K-quant path
# as a separate call with those rows would. stack: uint8 [E, N, row_bytes]; experts: int64 [J];
# offs: int64 [J+1]; xq: int8 [T, K]; out: float32 [T, N]; nchunks: work items per thread x 4.
#
# Each kernel is a closure over its weight type, so the type is a compile-time constant and only
# the types a model has get compiled. numba hashes a closure's cell contents into its cache key:
# the cell holds the type and the stamp of the IR sources.


@numba.njit(inline="always")
def block32_tile(kind, m, stack, e, n, xq, t, xd, xs, out):
    """out[t:t+m, n] = activation rows t..t+m-1 against row n of expert e (kind, m: literals)."""
    r = block32_rows(kind, m, stack, e, n, xq, t, xd, xs)
    for i in range(m):
        out[t + i, n] = r[i]


@numba.njit(inline="always")
def kquant_tile(kind, m, tiled, stack, e, n, xq, t, xd, xbs, out):
    """out[t:t+m, n] = activation rows t..t+m-1 against row n of expert e (kind, m: literals),
    with the tiled (tiled != 0) or the vec_dot epilogue."""
    if tiled:
        r = kquant_rows(kind, m, 1, stack, e, n, xq, t, xd, xbs)
    else:
        r = kquant_rows(kind, m, 0, stack, e, n, xq, t, xd, xbs)
    for i in range(m):
        out[t + i, n] = r[i]


@numba.njit(inline="always")
def block32_span(kind, stack, e, n0, n1, xq, xd, xs, t0, t1, out):
    """out[t0:t1, n0:n1]: rows n0..n1-1 of expert e against activation rows t0..t1-1, in tiles of
    8, 4 and 1 (a tile shares the block decoding only: a row's bits do not depend on it)."""
    for n in range(n0, n1):
        t = t0
        while t + 8 <= t1:
            block32_tile(kind, 8, stack, e, n, xq, t, xd, xs, out)
            t += 8
        if t + 4 <= t1:
            block32_tile(kind, 4, stack, e, n, xq, t, xd, xs, out)
            t += 4
        while t < t1:
            block32_tile(kind, 1, stack, e, n, xq, t, xd, xs, out)
            t += 1


@numba.njit(inline="always")
def kquant_span(kind, tiled, stack, e, n0, n1, xq, xd, xbs, t0, t1, out):
    """kquant_tile's out[t0:t1, n0:n1], in tiles of 4 and 1."""
    for n in range(n0, n1):
        t = t0
        while t + 4 <= t1:
            kquant_tile(kind, 4, tiled, stack, e, n, xq, t, xd, xbs, out)
            t += 4
        while t < t1:
            kquant_tile(kind, 1, tiled, stack, e, n, xq, t, xd, xbs, out)
            t += 1


@functools.cache
def block32_kernel(ggml_type: int):
    """kernel(stack, experts, offs, xq, xd, xs, out, nchunks) for one 32-value block type.
    xd, xs: float32 [T, B] (xs: the Q8_1 sums, read for Q4_1/Q5_1 only)."""
    if ggml_type not in BLOCK32_KINDS:
        raise ValueError(f"not a 32-value block type: {ggml_type}")
    spec = (int(ggml_type), _SOURCES)

    @numba.njit(cache=True, parallel=True)
    def block32_grouped(stack, experts, offs, xq, xd, xs, out, nchunks):
        kind = spec[0]
        J = experts.shape[0]
        N = stack.shape[1]
        total = J * N
        for c in prange(nchunks):
            for i in range(c * total // nchunks, (c + 1) * total // nchunks):
                j = i // N
                n = i % N
                block32_span(kind, stack, experts[j], n, n + 1, xq, xd, xs, offs[j], offs[j + 1], out)

    return block32_grouped


@functools.cache
def kquant_kernel(ggml_type: int):
    """kernel(tiled, stack, experts, offs, xq, xd, xbs, out, nchunks) for one K-quant type.
    tiled: uint8 [J]; xd: float32 [T, S]; xbs: int32 [T, K/16] (the Q8_K block sums)."""
    if ggml_type not in KQUANT_KINDS:
        raise ValueError(f"not a K-quant type: {ggml_type}")
    spec = (int(ggml_type), _SOURCES)

    @numba.njit(cache=True, parallel=True)
    def kquant_grouped(tiled, stack, experts, offs, xq, xd, xbs, out, nchunks):
        kind = spec[0]
        J = experts.shape[0]
        N = stack.shape[1]
        total = J * N
        for c in prange(nchunks):
            for i in range(c * total // nchunks, (c + 1) * total // nchunks):
                j = i // N
                n = i % N
                kquant_span(kind, tiled[j], stack, experts[j], n, n + 1, xq, xd, xbs, offs[j], offs[j + 1], out)

    return kquant_grouped
