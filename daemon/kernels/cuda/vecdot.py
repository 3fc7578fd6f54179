"""Per-type dot products of one 16-byte weight chunk against activations (device functions).

The GEMV kernels (mmvq.py) walk a repacked weight row (layout.py) in chunks of 16 quant bytes,
one 128-bit load each, and split each chunk's work in two:
    w = load(W, base, nb, c)               decode chunk c of the row at byte `base` (weight side,
                                            once per chunk whatever the number of columns)
    f = dot(w, A0, A1, arow, k, c)          its contribution to the dot with activation row `arow`
so that with several columns the weights are read and decoded once. `VALUES[t]` is the number of
values one chunk covers. Activations are q8_1 (quantize.py: A0 = qs int8 [R, K],
A1 = ds float32 [R, K/32, 2]) for the quantized types, and float32 (A0 = A1 = x [R, K]) for F32,
F16 and BF16.

Integer sums use dp4a on int8x4 words (llama.cpp's vecdotq.cuh, same algebra, own code):
    Q8_0               d_w * d_a * sum(q_w q_a)
    Q4_0 / Q5_0        d_w * (d_a * sum(q_w q_a) - 8 s_a)   (16 s_a for Q5_0: the offset through s)
    Q4_1 / Q5_1        d_w * d_a * sum(q_w q_a) + m_w * s_a
    MXFP4              e8m0/2 * d_a * sum(kvalue(q_w) q_a)  (kvalues through a byte-permute table)
    Q4_K / Q5_K        per 32-value sub-block: d_a * (d*sc * sum(q_w q_a) - dmin*m * sum(q_a))
    Q6_K               per 16 values: d_a * d*sc * (sum(q_w q_a) - 32 sum(q_a)), q_w in [0, 63]
(s_a is the q8_1 block's stored sum of the float activations, as in llama.cpp; the K-quants use the
exact integer sum of q_a instead, also as llama.cpp does.)

Legend: W = uint8 weight rows (any leading dims), base = byte offset of the row, nb = blocks per
row, c = chunk index within the row, k = values per row (K), arow = activation row.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..quants import BF16, F16, F32, MXFP4, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .ptx import bits_to_f32, device, dp4a, f16_to_f32, ldg_u8, ldg_u16, ldg_u32, ldg_v4, prmt

_U4 = np.uint32(4)
_U16 = np.uint32(16)
_M4 = np.uint32(0x0F0F0F0F)
_M2 = np.uint32(0x03030303)
_M1 = np.uint32(0x01010101)
_ONES = np.uint32(0x01010101)
_LO16 = np.uint32(0xFFFF)
_HI16 = np.uint32(0xFFFF0000)
# kvalues_mxfp4 (doubled e2m1) as 4 little-endian words: {0,1,2,3}, {4,6,8,12}, {0,-1,-2,-3},
# {-4,-6,-8,-12}.
_T0 = np.uint32(0x03020100)
_T1 = np.uint32(0x0C080604)
_T2 = np.uint32(0xFDFEFF00)
_T3 = np.uint32(0xF4F8FAFC)
_SEL3 = np.uint32(0x77777777)
_SEL_HI = np.uint32(0x88888888)
_SEL_BASE = np.uint32(0x32103210)
_F8 = np.float32(8.0)
_F16 = np.float32(16.0)


# ---- int8 sums of four words ---------------------------------------------------------------

@device
def _dot4(w0, w1, w2, w3, a):
    """sum of the 16 int8 products of 4 weight words and a 4-word activation tuple."""
    s = dp4a(w0, a[0], 0)
    s = dp4a(w1, a[1], s)
    s = dp4a(w2, a[2], s)
    return dp4a(w3, a[3], s)


@device
def _sum4(a):
    """sum of the 16 int8 values of a 4-word activation tuple."""
    s = dp4a(_ONES, a[0], 0)
    s = dp4a(_ONES, a[1], s)
    s = dp4a(_ONES, a[2], s)
    return dp4a(_ONES, a[3], s)


# ---- weight side: fetch (raw words) and decode, per type ---------------------------------------
# A quant type's chunk load is two steps, so that the tiled matmul can issue the next K step's
# loads before it multiplies the current one and decode them after (mmq_stage.py):
#     fetch(W, base, nb, c, raw, s)   the chunk's raw words (RAW[t] of them) into raw[s, :]
#     decode(raw, s, c)               -> the tuple `load` returns (quant words, then scales)
# load(W, base, nb, c) = decode of fetch, through a one-row local array (registers).

@device
def _f16_lo(u):
    return f16_to_f32(u & _LO16)


@device
def _f16_hi(u):
    return f16_to_f32(u >> _U16)


@device
def _fetch_quads(W, base, c, raw, s):
    """The chunk's 16 quant bytes as raw[s, 0:4]."""
    q = ldg_v4(W, base + (c << 4))
    raw[s, 0] = q[0]
    raw[s, 1] = q[1]
    raw[s, 2] = q[2]
    raw[s, 3] = q[3]


@device
def fetch_q8_0(W, base, nb, c, raw, s):
    _fetch_quads(W, base, c, raw, s)
    raw[s, 4] = ldg_u16(W, base + (nb << 5) + ((c >> 1) << 1))


@device
def decode_q8_0(raw, s, c):
    return raw[s, 0], raw[s, 1], raw[s, 2], raw[s, 3], f16_to_f32(raw[s, 4])


@device
def _nibbles(raw, s):
    """The 16 quant bytes raw[s, 0:4] as 8 words of int8 values: low nibbles (values 0..15), then
    high nibbles (values 16..31)."""
    q0, q1, q2, q3 = raw[s, 0], raw[s, 1], raw[s, 2], raw[s, 3]
    return (q0 & _M4, q1 & _M4, q2 & _M4, q3 & _M4,
            (q0 >> _U4) & _M4, (q1 >> _U4) & _M4, (q2 >> _U4) & _M4, (q3 >> _U4) & _M4)


@device
def fetch_q4_0(W, base, nb, c, raw, s):
    _fetch_quads(W, base, c, raw, s)
    raw[s, 4] = ldg_u16(W, base + (nb << 4) + (c << 1))


@device
def decode_q4_0(raw, s, c):
    n = _nibbles(raw, s)
    return n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7], f16_to_f32(raw[s, 4])


@device
def fetch_q4_1(W, base, nb, c, raw, s):
    _fetch_quads(W, base, c, raw, s)
    raw[s, 4] = ldg_u32(W, base + (nb << 4) + (c << 2))


@device
def decode_q4_1(raw, s, c):
    n = _nibbles(raw, s)
    dm = raw[s, 4]
    return n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7], _f16_lo(dm), _f16_hi(dm)


@device
def _spread4(n):
    """4 bits -> bit 4 of each byte (bit i -> bit 8i+4): the 5th bit of 4 int8 values."""
    return ((n & np.uint32(0xF)) * np.uint32(0x02040810)) & np.uint32(0x10101010)


@device
def _nibbles5(raw, s):
    """Q5_0/Q5_1: 8 words of 5-bit values (qh = raw[s, 4], its bit j is value j's 5th bit)."""
    n = _nibbles(raw, s)
    qh = raw[s, 4]
    return (n[0] | _spread4(qh), n[1] | _spread4(qh >> np.uint32(4)),
            n[2] | _spread4(qh >> np.uint32(8)), n[3] | _spread4(qh >> np.uint32(12)),
            n[4] | _spread4(qh >> np.uint32(16)), n[5] | _spread4(qh >> np.uint32(20)),
            n[6] | _spread4(qh >> np.uint32(24)), n[7] | _spread4(qh >> np.uint32(28)))


@device
def fetch_q5_0(W, base, nb, c, raw, s):
    _fetch_quads(W, base, c, raw, s)
    raw[s, 4] = ldg_u32(W, base + (nb << 4) + (c << 2))
    raw[s, 5] = ldg_u16(W, base + nb * 20 + (c << 1))


@device
def decode_q5_0(raw, s, c):
    n = _nibbles5(raw, s)
    return n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7], f16_to_f32(raw[s, 5])


@device
def fetch_q5_1(W, base, nb, c, raw, s):
    _fetch_quads(W, base, c, raw, s)
    raw[s, 4] = ldg_u32(W, base + (nb << 4) + (c << 2))
    raw[s, 5] = ldg_u32(W, base + nb * 20 + (c << 2))


@device
def decode_q5_1(raw, s, c):
    n = _nibbles5(raw, s)
    dm = raw[s, 5]
    return n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7], _f16_lo(dm), _f16_hi(dm)


@device
def _lut16(q):
    """8 nibbles -> (int8x4 of kvalues[low nibbles], int8x4 of kvalues[high nibbles]), by byte
    permutes: the low 3 bits pick among 8 table bytes, bit 3 picks the table half."""
    hi = ((q & _SEL_HI) >> np.uint32(1)) | _SEL_BASE
    s = q & _SEL3
    t0 = prmt(prmt(_T0, _T1, s), prmt(_T2, _T3, s), hi)  # bytes for nibbles 0..3
    s16 = s >> _U16
    t1 = prmt(prmt(_T0, _T1, s16), prmt(_T2, _T3, s16), hi >> _U16)  # nibbles 4..7
    return prmt(t0, t1, np.uint32(0x6420)), prmt(t0, t1, np.uint32(0x7531))


@device
def fetch_mxfp4(W, base, nb, c, raw, s):
    _fetch_quads(W, base, c, raw, s)
    raw[s, 4] = ldg_u8(W, base + (nb << 4) + c)


@device
def decode_mxfp4(raw, s, c):
    l0, h0 = _lut16(raw[s, 0])
    l1, h1 = _lut16(raw[s, 1])
    l2, h2 = _lut16(raw[s, 2])
    l3, h3 = _lut16(raw[s, 3])
    e = raw[s, 4]
    # e8m0 / 2 = 2**(e - 128); e < 2 are the float32 denormals 2**-128, 2**-127
    if e < np.uint32(2):
        bits = np.uint32(0x00200000) << e
    else:
        bits = (e - np.uint32(1)) << np.uint32(23)
    return l0, l1, l2, l3, h0, h1, h2, h3, bits_to_f32(bits)


# ---- weight side: K-quants (256-value super-blocks, 8 chunks each) ---------------------------

@device
def _scale_min(s0, s1, s2, j):
    """get_scale_min_k4 for sub-block j (0..7) from the 12 scale bytes held as 3 words."""
    if j < 4:
        sh = np.uint32(8 * j)
        return (s0 >> sh) & np.uint32(63), (s1 >> sh) & np.uint32(63)
    sh = np.uint32(8 * (j - 4))
    d = ((s2 >> sh) & np.uint32(0xF)) | (((s0 >> sh) >> np.uint32(6) & np.uint32(3)) << _U4)
    m = ((s2 >> sh) >> _U4 & np.uint32(0xF)) | (((s1 >> sh) >> np.uint32(6) & np.uint32(3)) << _U4)
    return d, m


@device
def _fetch_kq4_scales(W, base, c, sc_plane, dm_plane, raw, s, at):
    """Super-block c >> 3's 12 scale bytes and (d, dmin) word into raw[s, at:at+4]."""
    sb = c >> 3
    so = base + sc_plane + sb * 12
    raw[s, at] = ldg_u32(W, so)
    raw[s, at + 1] = ldg_u32(W, so + 4)
    raw[s, at + 2] = ldg_u32(W, so + 8)
    raw[s, at + 3] = ldg_u32(W, base + dm_plane + (sb << 2))


@device
def _kq4_scales(raw, s, at, c):
    """(d*sc, d*sc, dmin*m, dmin*m) of the two sub-blocks chunk c touches (Q4_K/Q5_K)."""
    j = (c & 7) >> 1
    s0, s1, s2 = raw[s, at], raw[s, at + 1], raw[s, at + 2]
    sc0, m0 = _scale_min(s0, s1, s2, 2 * j)
    sc1, m1 = _scale_min(s0, s1, s2, 2 * j + 1)
    dm = raw[s, at + 3]
    d = _f16_lo(dm)
    dmin = _f16_hi(dm)
    return d * np.float32(sc0), d * np.float32(sc1), dmin * np.float32(m0), dmin * np.float32(m1)


@device
def fetch_q4_k(W, base, nb, c, raw, s):
    # chunk c: bytes [16h, 16h+16) of the 32-byte group j of super-block sb: low nibbles are
    # sub-block 2j, high nibbles sub-block 2j+1, values l = 16h..16h+15 of each.
    _fetch_quads(W, base, c, raw, s)
    _fetch_kq4_scales(W, base, c, nb << 7, nb * 140, raw, s, 4)


@device
def decode_q4_k(raw, s, c):
    n = _nibbles(raw, s)
    sc = _kq4_scales(raw, s, 4, c)
    return n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7], sc[0], sc[1], sc[2], sc[3]


@device
def fetch_q5_k(W, base, nb, c, raw, s):
    _fetch_quads(W, base, c, raw, s)
    h = ldg_v4(W, base + (nb << 7) + ((c >> 3) << 5) + ((c & 1) << 4))
    raw[s, 4] = h[0]
    raw[s, 5] = h[1]
    raw[s, 6] = h[2]
    raw[s, 7] = h[3]
    _fetch_kq4_scales(W, base, c, nb * 160, nb * 172, raw, s, 8)


@device
def decode_q5_k(raw, s, c):
    n = _nibbles(raw, s)
    lo = np.uint32((c & 7) >> 1) << np.uint32(1)
    hi = lo + np.uint32(1)
    h0, h1, h2, h3 = raw[s, 4], raw[s, 5], raw[s, 6], raw[s, 7]
    sc = _kq4_scales(raw, s, 8, c)
    return (n[0] | (((h0 >> lo) & _M1) << _U4), n[1] | (((h1 >> lo) & _M1) << _U4),
            n[2] | (((h2 >> lo) & _M1) << _U4), n[3] | (((h3 >> lo) & _M1) << _U4),
            n[4] | (((h0 >> hi) & _M1) << _U4), n[5] | (((h1 >> hi) & _M1) << _U4),
            n[6] | (((h2 >> hi) & _M1) << _U4), n[7] | (((h3 >> hi) & _M1) << _U4),
            sc[0], sc[1], sc[2], sc[3])


@device
def _i8(u):
    """The low byte of u as a signed value."""
    v = np.int32(u & np.uint32(0xFF))
    return v - ((v & np.int32(0x80)) << np.int32(1))


@device
def fetch_q6_k(W, base, nb, c, raw, s):
    # chunk c of super-block sb: cc = c & 7 -> half = cc >> 2, sub = (cc >> 1) & 1, hh = cc & 1;
    # ql bytes [16cc, 16cc+16): low nibbles are group sub, high nibbles group sub+2 (32 values
    # each, l = 16hh..16hh+15); the 5th/6th bits are in qh[32 half + l] at bits 2g, 2g+1.
    sb = c >> 3
    cc = c & 7
    half = cc >> 2
    sub = (cc >> 1) & 1
    hh = cc & 1
    _fetch_quads(W, base, c, raw, s)
    h = ldg_v4(W, base + (nb << 7) + (sb << 6) + (half << 5) + (hh << 4))
    raw[s, 4] = h[0]
    raw[s, 5] = h[1]
    raw[s, 6] = h[2]
    raw[s, 7] = h[3]
    raw[s, 8] = ldg_u16(W, base + nb * 208 + (sb << 1))
    si = base + nb * 192 + (sb << 4) + (half << 3) + (sub << 1) + hh
    raw[s, 9] = ldg_u8(W, si)
    raw[s, 10] = ldg_u8(W, si + 4)


@device
def decode_q6_k(raw, s, c):
    s0 = np.uint32(2 * (((c & 7) >> 1) & 1))
    s1 = s0 + np.uint32(4)
    q0, q1, q2, q3 = raw[s, 0], raw[s, 1], raw[s, 2], raw[s, 3]
    h0, h1, h2, h3 = raw[s, 4], raw[s, 5], raw[s, 6], raw[s, 7]
    d = f16_to_f32(raw[s, 8])
    return (q0 & _M4 | ((h0 >> s0) & _M2) << _U4, q1 & _M4 | ((h1 >> s0) & _M2) << _U4,
            q2 & _M4 | ((h2 >> s0) & _M2) << _U4, q3 & _M4 | ((h3 >> s0) & _M2) << _U4,
            (q0 >> _U4) & _M4 | ((h0 >> s1) & _M2) << _U4,
            (q1 >> _U4) & _M4 | ((h1 >> s1) & _M2) << _U4,
            (q2 >> _U4) & _M4 | ((h2 >> s1) & _M2) << _U4,
            (q3 >> _U4) & _M4 | ((h3 >> s1) & _M2) << _U4,
            d * np.float32(_i8(raw[s, 9])), d * np.float32(_i8(raw[s, 10])))


# ---- the quant types' dots against q8_1 activations ----------------------------------------

@device
def _act_d(ads, arow, k, blk):
    """d of q8_1 block `blk` of activation row `arow` (ds float32 [R, K/32, 2])."""
    return bits_to_f32(ldg_u32(ads, ((arow * (k >> 5) + blk) << 3)))


@device
def _act_s(ads, arow, k, blk):
    """s (the block's sum of floats) of q8_1 block `blk` of activation row `arow`."""
    return bits_to_f32(ldg_u32(ads, ((arow * (k >> 5) + blk) << 3) + 4))


@device
def _dot32(w, aq, arow, k, c):
    """int sum over the 32 values of block c: words w[0:4] hold values 0..15, w[4:8] 16..31."""
    o = arow * k + (c << 5)
    return _dot4(w[0], w[1], w[2], w[3], ldg_v4(aq, o)) + _dot4(w[4], w[5], w[6], w[7],
                                                                 ldg_v4(aq, o + 16))


@device
def dot_q8_0(w, aq, ads, arow, k, c):
    s = _dot4(w[0], w[1], w[2], w[3], ldg_v4(aq, arow * k + (c << 4)))
    return w[4] * _act_d(ads, arow, k, c >> 1) * np.float32(s)


@device
def dot_q4_0(w, aq, ads, arow, k, c):
    s = _dot32(w, aq, arow, k, c)
    return w[8] * (_act_d(ads, arow, k, c) * np.float32(s) - _F8 * _act_s(ads, arow, k, c))


@device
def dot_q4_1(w, aq, ads, arow, k, c):
    s = _dot32(w, aq, arow, k, c)
    return w[8] * _act_d(ads, arow, k, c) * np.float32(s) + w[9] * _act_s(ads, arow, k, c)


@device
def dot_q5_0(w, aq, ads, arow, k, c):
    s = _dot32(w, aq, arow, k, c)
    return w[8] * (_act_d(ads, arow, k, c) * np.float32(s) - _F16 * _act_s(ads, arow, k, c))


@device
def dot_mxfp4(w, aq, ads, arow, k, c):
    s = _dot32(w, aq, arow, k, c)
    return w[8] * _act_d(ads, arow, k, c) * np.float32(s)


@device
def dot_kq4(w, aq, ads, arow, k, c):
    sb = c >> 3
    j = (c & 7) >> 1
    o = arow * k + (sb << 8) + (j << 6) + ((c & 1) << 4)
    a = ldg_v4(aq, o)
    b = ldg_v4(aq, o + 32)
    blk = (sb << 3) + 2 * j
    lo = w[8] * np.float32(_dot4(w[0], w[1], w[2], w[3], a)) - w[10] * np.float32(_sum4(a))
    hi = w[9] * np.float32(_dot4(w[4], w[5], w[6], w[7], b)) - w[11] * np.float32(_sum4(b))
    return _act_d(ads, arow, k, blk) * lo + _act_d(ads, arow, k, blk + 1) * hi


@device
def dot_q6_k(w, aq, ads, arow, k, c):
    sb = c >> 3
    cc = c & 7
    half = cc >> 2
    sub = (cc >> 1) & 1
    o = arow * k + (sb << 8) + (half << 7) + (sub << 5) + ((cc & 1) << 4)
    a = ldg_v4(aq, o)
    b = ldg_v4(aq, o + 64)
    blk = (sb << 3) + (half << 2) + sub
    s0 = _dot4(w[0], w[1], w[2], w[3], a) - 32 * _sum4(a)
    s1 = _dot4(w[4], w[5], w[6], w[7], b) - 32 * _sum4(b)
    return (_act_d(ads, arow, k, blk) * w[8] * np.float32(s0)
            + _act_d(ads, arow, k, blk + 2) * w[9] * np.float32(s1))


# ---- float weights against float32 activations ----------------------------------------------

@device
def load_f32(W, base, nb, c):
    w0, w1, w2, w3 = ldg_v4(W, base + (c << 4))
    return bits_to_f32(w0), bits_to_f32(w1), bits_to_f32(w2), bits_to_f32(w3)


@device
def dot_f32(w, x, x1, arow, k, c):
    a = ldg_v4(x, (arow * k + (c << 2)) << 2)
    return (w[0] * bits_to_f32(a[0]) + w[1] * bits_to_f32(a[1])
            + w[2] * bits_to_f32(a[2]) + w[3] * bits_to_f32(a[3]))


@device
def load_f16(W, base, nb, c):
    w0, w1, w2, w3 = ldg_v4(W, base + (c << 4))
    return (_f16_lo(w0), _f16_hi(w0), _f16_lo(w1), _f16_hi(w1),
            _f16_lo(w2), _f16_hi(w2), _f16_lo(w3), _f16_hi(w3))


@device
def load_bf16(W, base, nb, c):
    w0, w1, w2, w3 = ldg_v4(W, base + (c << 4))
    return (bits_to_f32(w0 << _U16), bits_to_f32(w0 & _HI16),
            bits_to_f32(w1 << _U16), bits_to_f32(w1 & _HI16),
            bits_to_f32(w2 << _U16), bits_to_f32(w2 & _HI16),
            bits_to_f32(w3 << _U16), bits_to_f32(w3 & _HI16))


@device
def dot_f8(w, x, x1, arow, k, c):
    o = (arow * k + (c << 3)) << 2
    a = ldg_v4(x, o)
    b = ldg_v4(x, o + 16)
    return ((w[0] * bits_to_f32(a[0]) + w[1] * bits_to_f32(a[1]))
            + (w[2] * bits_to_f32(a[2]) + w[3] * bits_to_f32(a[3]))
            + (w[4] * bits_to_f32(b[0]) + w[5] * bits_to_f32(b[1]))
            + (w[6] * bits_to_f32(b[2]) + w[7] * bits_to_f32(b[3])))


def _load_of(fetch, decode, n_raw: int):
    """A chunk's whole load (GEMV kernels): its fetch into registers, decoded at once."""
    @device
    def load(W, base, nb, c):
        raw = cuda.local.array((1, n_raw), np.uint32)
        fetch(W, base, nb, c, raw, 0)
        return decode(raw, 0, c)
    return load


# quant type -> (fetch, decode, raw words a chunk), for the tiled matmul's staging
FETCH = {
    Q8_0: (fetch_q8_0, decode_q8_0, 5), Q4_0: (fetch_q4_0, decode_q4_0, 5),
    Q4_1: (fetch_q4_1, decode_q4_1, 5), Q5_0: (fetch_q5_0, decode_q5_0, 6),
    Q5_1: (fetch_q5_1, decode_q5_1, 6), MXFP4: (fetch_mxfp4, decode_mxfp4, 5),
    Q4_K: (fetch_q4_k, decode_q4_k, 8), Q5_K: (fetch_q5_k, decode_q5_k, 12),
    Q6_K: (fetch_q6_k, decode_q6_k, 11),
}
_LOADS = {t: _load_of(*f) for t, f in FETCH.items()}
# type -> (load, dot); values per chunk; whether activations are q8_1
VECDOT = {
    Q8_0: (_LOADS[Q8_0], dot_q8_0), Q4_0: (_LOADS[Q4_0], dot_q4_0),
    Q4_1: (_LOADS[Q4_1], dot_q4_1), Q5_0: (_LOADS[Q5_0], dot_q5_0),
    Q5_1: (_LOADS[Q5_1], dot_q4_1), MXFP4: (_LOADS[MXFP4], dot_mxfp4),
    Q4_K: (_LOADS[Q4_K], dot_kq4), Q5_K: (_LOADS[Q5_K], dot_kq4), Q6_K: (_LOADS[Q6_K], dot_q6_k),
    F32: (load_f32, dot_f32), F16: (load_f16, dot_f8), BF16: (load_bf16, dot_f8),
}
VALUES = {Q8_0: 16, F32: 4, F16: 8, BF16: 8, Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, MXFP4: 32,
          Q4_K: 32, Q5_K: 32, Q6_K: 32}
FLOAT_ACT = frozenset({F32, F16, BF16})
