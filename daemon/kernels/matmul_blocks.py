"""Weight block decoders for the quantized row kernels: LLVM IR that turns one ggml block (layouts
in quants.py) into int8 vectors and float32 scales, ready for exact integer dot products.

`kind` is the block's ggml type id, a compile-time constant: each function emits the code of
that one type. `bp` is the block's address (i8*).
"""

from __future__ import annotations

from llvmlite import ir

from daemon.kernels import quants as Q
from daemon.kernels import simd_ir
from daemon.kernels.simd_ir import (F32, I8, I16, I32, call_llvm, concat, const_vec, load, load_f16, shuffle,
                                    splat_const, vec)

# ---- 32-value blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4


def _e8m0_half(builder, p, off):
    """ggml_e8m0_to_fp32_half of the byte at p+off."""
    e = builder.zext(load(builder, p, off, I8), I32)
    den = builder.shl(ir.Constant(I32, 0x00200000), e)
    nor = builder.shl(builder.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23))
    bits = builder.select(builder.icmp_unsigned("<", e, ir.Constant(I32, 2)), den, nor)
    return builder.bitcast(bits, F32)


def _nibbles(builder, p, off):
    """16 bytes at p+off -> <32 x i8>: the low nibbles (0..15), then the high nibbles."""
    b = load(builder, p, off, vec(I8, 16))
    return concat(builder, builder.and_(b, splat_const(I8, 16, 15)), builder.lshr(b, splat_const(I8, 16, 4)))


def _qh_bits(builder, p, off):
    """The 32-bit qh at p+off -> <32 x i8> holding 16 in lane j where bit j of qh is set
    (byte j//8 of qh spread over 8 lanes, tested against 1 << (j % 8))."""
    qh = builder.bitcast(load(builder, p, off, I32), vec(I8, 4))
    spread = shuffle(builder, qh, qh, [j // 8 for j in range(32)])
    bit = builder.and_(spread, const_vec(I8, [1 << (j % 8) for j in range(32)]))
    on = builder.icmp_unsigned("!=", bit, splat_const(I8, 32, 0))
    return builder.select(on, splat_const(I8, 32, 16), splat_const(I8, 32, 0))


def _e2m1x2(context, builder, nib):
    """kvalues_mxfp4[nib] for <32 x i8> nibbles. With AVX2 a table lookup (vpshufb); else
    computed: codes 0..7 are the magnitudes 0,1,2,3 (c < 4), 4,6 (= (2 + (c & 1)) << 1) and
    8,12 (= (2 + (c & 1)) << 2), bit 3 is the sign."""
    n = nib.type.count
    if simd_ir.has_avx2(context) and n == 32:
        table = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12] * 2
        return call_llvm(builder, "llvm.x86.avx2.pshuf.b", vec(I8, 32), const_vec(I8, [v & 0xFF for v in table]), nib)

    def k(v):
        return splat_const(I8, n, v)

    c = builder.and_(nib, k(7))
    m = builder.add(k(2), builder.and_(c, k(1)))
    big = builder.select(builder.icmp_unsigned("!=", builder.and_(c, k(2)), k(0)),
                         builder.shl(m, k(2)), builder.shl(m, k(1)))
    mag = builder.select(builder.icmp_unsigned("<", c, k(4)), c, big)
    neg = builder.icmp_unsigned("!=", builder.and_(nib, k(8)), k(0))
    return builder.select(neg, builder.sub(k(0), mag), mag)


def unsigned_codes(kind) -> bool:
    """Q4_1/Q5_1 store codes 0..31 and a min (the dot adds m_w * s_x); the others signed values."""
    return kind in (Q.Q4_1, Q.Q5_1)


def decode_block32(kind, context, builder, bp):
    """The 32 weights of the block at bp as <32 x i8>."""
    if kind == Q.Q8_0:
        return load(builder, bp, 2, vec(I8, 32))
    if kind == Q.Q4_0:
        return builder.sub(_nibbles(builder, bp, 2), splat_const(I8, 32, 8))
    if kind == Q.Q4_1:
        return _nibbles(builder, bp, 4)
    if kind == Q.Q5_0:
        w = builder.or_(_nibbles(builder, bp, 6), _qh_bits(builder, bp, 2))
        return builder.sub(w, splat_const(I8, 32, 16))
    if kind == Q.Q5_1:
        return builder.or_(_nibbles(builder, bp, 8), _qh_bits(builder, bp, 4))
    assert kind == Q.MXFP4
    return _e2m1x2(context, builder, _nibbles(builder, bp, 1))


def block32_scales(kind, builder, bp):
    """(d, m) of the block at bp; m is None for types without a min."""
    if kind == Q.MXFP4:
        return _e8m0_half(builder, bp, 0), None
    if unsigned_codes(kind):
        return load_f16(builder, bp, 0), load_f16(builder, bp, 2)
    return load_f16(builder, bp, 0), None


# ---- 256-value super-blocks: Q4_K, Q5_K, Q6_K


def _scales_k4(builder, bp):
    """The 8 six-bit (scale, min) pairs of a Q4_K/Q5_K block (get_scale_min_k4):
    -> scales <8 x i16>, mins <8 x i32>."""
    q = [builder.zext(load(builder, bp, 4 + i, I8), I32) for i in range(12)]

    def c(v):
        return ir.Constant(I32, v)

    sc = ir.Constant(vec(I16, 8), ir.Undefined)
    mn = ir.Constant(vec(I32, 8), ir.Undefined)
    for j in range(8):
        if j < 4:
            d = builder.and_(q[j], c(63))
            m = builder.and_(q[j + 4], c(63))
        else:
            d = builder.or_(builder.and_(q[j + 4], c(15)), builder.shl(builder.lshr(q[j - 4], c(6)), c(4)))
            m = builder.or_(builder.lshr(q[j + 4], c(4)), builder.shl(builder.lshr(q[j], c(6)), c(4)))
        sc = builder.insert_element(sc, builder.trunc(d, I16), c(j))
        mn = builder.insert_element(mn, m, c(j))
    return sc, mn


def decode_kquant(kind, builder, bp):
    """-> (8 pairs (unsigned codes <32 x i8>, their scales <16 x i16>: lane p for elements 2p,
    2p+1), mins <8 x i32> or None, d, dmin or None, Q6_K scales <16 x i32> or None)."""
    ws = []
    if kind in (Q.Q4_K, Q.Q5_K):
        qs = 16 if kind == Q.Q4_K else 48
        qh = load(builder, bp, 16, vec(I8, 32)) if kind == Q.Q5_K else None
        scv, mins = _scales_k4(builder, bp)
        for j in range(8):
            c, hi = divmod(j, 2)
            b = load(builder, bp, qs + 32 * c, vec(I8, 32))
            w = builder.lshr(b, splat_const(I8, 32, 4)) if hi else builder.and_(b, splat_const(I8, 32, 15))
            if kind == Q.Q5_K:
                h = builder.and_(builder.lshr(qh, splat_const(I8, 32, j)), splat_const(I8, 32, 1))
                w = builder.or_(w, builder.shl(h, splat_const(I8, 32, 4)))
            ws.append((w, shuffle(builder, scv, scv, [j] * 16)))
        return ws, mins, load_f16(builder, bp, 0), load_f16(builder, bp, 2), None
    assert kind == Q.Q6_K
    sc8 = load(builder, bp, 192, vec(I8, 16))
    scv = builder.sext(sc8, vec(I16, 16))
    for half in range(2):
        qh = load(builder, bp, 128 + half * 32, vec(I8, 32))
        for grp in range(4):
            ql = load(builder, bp, half * 64 + (grp & 1) * 32, vec(I8, 32))
            ql = builder.and_(builder.lshr(ql, splat_const(I8, 32, 4 * (grp >> 1))), splat_const(I8, 32, 15))
            h = builder.and_(builder.lshr(qh, splat_const(I8, 32, 2 * grp)), splat_const(I8, 32, 3))
            q = builder.or_(ql, builder.shl(h, splat_const(I8, 32, 4)))  # 0..63, unsigned
            g = half * 8 + grp * 2  # 16-value groups g and g+1
            ws.append((q, shuffle(builder, scv, scv, [g] * 8 + [g + 1] * 8)))
    return ws, None, load_f16(builder, bp, 208), None, builder.sext(sc8, vec(I32, 16))
