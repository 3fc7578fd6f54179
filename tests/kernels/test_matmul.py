"""linear(): float32 reference numerics vs float64, and ggml numerics vs an independent numpy
model of llama.cpp's CPU path (activation quantization, integer block dots, scale combination,
and the AVX2 summation orders, bit for bit)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gq

from daemon.errors import UnsupportedError
from daemon.kernels import matmul as M
from daemon.kernels import quants as Q

from .test_quants import random_blocks

ALL = sorted(Q.SUPPORTED_TYPES)
NAMES = {t: Q.type_name(t) for t in ALL}
K = 512  # two K-quant super-blocks, sixteen 32-blocks
N = 12
TOKENS = (1, 3, 17)  # 17 = four groups of four tokens plus one
KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)


def f16(b: np.ndarray) -> np.ndarray:
    """Two little-endian bytes [..., 2] -> float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def weights(qt: int, rng) -> np.ndarray:
    """Weights [N, row_bytes]: quantized from floats where gguf can, else random blocks."""
    if qt in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4, Q.BF16, Q.F16, Q.F32):
        w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
        w[0, :40] = 0.0  # an all-zero block
        return np.ascontiguousarray(gq.quantize(w, GGMLQuantizationType(qt))).view(np.uint8).reshape(N, -1)
    return random_blocks(qt, (N,), K, rng)


def activations(T: int, rng) -> np.ndarray:
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero activation block (d = 0, id = 0)
    return x


# ---- numpy model of ggml's activation quantization (x86 build) ----


def np_q8_0(x):
    """quantize_row_q8_0/q8_1 as the AVX2 code: id = 127/amax, round half to even."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])
    s = (d * q.sum(-1, dtype=np.float32)).astype(np.float16).astype(np.float32)
    return q.astype(np.int64), d.astype(np.float16).astype(np.float32), s


def np_q8_K(x):
    """quantize_row_q8_K_ref."""
    xb = x.reshape(x.shape[0], -1, 256)
    i = np.abs(xb).argmax(-1)
    mx = np.take_along_axis(xb, i[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(127, np.rint(iscale[..., None] * xb)).astype(np.int64)
    return q, d, q.reshape(q.shape[0], q.shape[1], 16, 16).sum(-1)


# ---- numpy model of the weight blocks: integer values and scales ----


def np_blocks32(qt, raw):
    """-> w int64 [N, B, 32], d f32 [N, B], m f32 [N, B]."""
    bb = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.MXFP4: 17}[qt]
    b = raw.reshape(raw.shape[0], -1, bb)
    m = np.zeros(b.shape[:2], np.float32)
    if qt == Q.Q8_0:
        return b[..., 2:].view(np.int8).astype(np.int64), f16(b[..., 0:2]), m
    if qt == Q.MXFP4:
        d = np.ldexp(np.float32(1), b[..., 0].astype(np.int32) - 128).astype(np.float32)
        nib = np.concatenate([b[..., 1:] & 15, b[..., 1:] >> 4], -1)
        return KV_MXFP4[nib], d, m
    qs_at = {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q5_0: 6, Q.Q5_1: 8}[qt]
    qs = b[..., qs_at:qs_at + 16].astype(np.int64)
    w = np.concatenate([qs & 15, qs >> 4], -1)
    if qt in (Q.Q5_0, Q.Q5_1):
        qh = b[..., qs_at - 4:qs_at].copy().view("<u4")[..., 0].astype(np.int64)
        w |= ((qh[..., None] >> np.arange(32)) & 1) << 4
    if qt == Q.Q4_0:
        w -= 8
    if qt == Q.Q5_0:
        w -= 16
    if qt in (Q.Q4_1, Q.Q5_1):
        m = f16(b[..., 2:4])
    return w, f16(b[..., 0:2]), m


def np_kquant(qt, raw):
    """-> w int64 [N, S, G, L], scales int64 [N, S, G], mins int64 [N, S, G], d, dmin f32 [N, S]
    with G sub-blocks of L values (8 x 32, or 16 x 16 for Q6_K)."""
    bb = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[qt]
    b = raw.reshape(raw.shape[0], -1, bb)
    if qt == Q.Q6_K:
        ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
        vals = []
        for half in range(2):
            l0, l1, h = ql[..., 64 * half:64 * half + 32], ql[..., 64 * half + 32:64 * half + 64], qh[..., 32 * half:32 * half + 32]
            vals += [(l0 & 15) | ((h & 3) << 4), (l1 & 15) | (((h >> 2) & 3) << 4),
                     (l0 >> 4) | (((h >> 4) & 3) << 4), (l1 >> 4) | (((h >> 6) & 3) << 4)]
        w = np.concatenate(vals, -1).reshape(b.shape[0], b.shape[1], 16, 16) - 32
        sc = b[..., 192:208].view(np.int8).astype(np.int64)
        return w, sc, np.zeros_like(sc), f16(b[..., 208:210]), np.zeros(b.shape[:2], np.float32)
    s = b[..., 4:16].astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:144] if qt == Q.Q4_K else b[..., 48:176]
    qs = qs.astype(np.int64).reshape(b.shape[0], b.shape[1], 4, 32)
    w = np.stack([qs & 15, qs >> 4], 3).reshape(b.shape[0], b.shape[1], 8, 32)
    if qt == Q.Q5_K:
        qh = b[..., 16:48].astype(np.int64)
        w |= ((qh[..., None, :] >> np.arange(8)[:, None]) & 1) << 4
    return w, sc, mn, f16(b[..., 0:2]), f16(b[..., 2:4])


def fma(a, b, c):
    """float32 fused multiply-add (the float64 product is exact; the sum is rounded twice,
    which differs from one rounding with probability ~2^-29)."""
    return (np.float64(1) * a * b + c).astype(np.float32)


def hsum8(v):
    """hsum_float_8 over the last axis: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) in float32."""
    h = v[..., :4] + v[..., 4:]
    return (h[..., 0] + h[..., 2]) + (h[..., 1] + h[..., 3])


def hadd8(v):
    """The end of GGML_F32x8_REDUCE: ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7)) in float32."""
    h = v[..., :4] + v[..., 4:]
    return (h[..., 0] + h[..., 1]) + (h[..., 2] + h[..., 3])


def np_ggml(qt, raw, x, drop_min=False, expert=False):
    """llama.cpp's result in float64 (the integer parts exact, float32 scale products): the
    dot products in plain float64, as a loose check on np_ggml_exact."""
    if qt in Q.FLOAT_TYPES:
        W = Q.dequantize(raw, qt).astype(np.float64)
        xr = {Q.F32: x, Q.F16: x.astype(np.float16).astype(np.float32), Q.BF16: bf16(x)}[qt]
        return xr.astype(np.float64) @ W.T
    if qt in Q.KQUANT_TYPES:
        q, dx, bsums = np_q8_K(x)
        w, sc, mn, d, dmin = np_kquant(qt, raw)
        G, L = w.shape[2], w.shape[3]
        qg = q.reshape(q.shape[0], q.shape[1], G, L)
        sumi = np.einsum("nsg,nsgl,tsgl->tns", sc, w, qg)
        out = np.einsum("tns,tns->tn", (d[None] * dx[:, None]).astype(np.float64), sumi)
        if qt != Q.Q6_K and not drop_min:
            bs = bsums.reshape(bsums.shape[0], bsums.shape[1], 8, 2).sum(-1)
            summ = np.einsum("nsg,tsg->tns", mn, bs)
            out -= np.einsum("tns,tns->tn", (dmin[None] * dx[:, None]).astype(np.float64), summ)
        return out
    q, dx, sx = np_q8_0(x)
    w, dw, mw = np_blocks32(qt, raw)
    sumi = np.einsum("nbj,tbj->tnb", w, q)
    out = np.einsum("tnb,tnb->tn", (dw[None] * dx[:, None]).astype(np.float64), sumi)
    if qt in (Q.Q4_1, Q.Q5_1) and not drop_min:
        out += np.einsum("nb,tb->tn", mw.astype(np.float64), sx.astype(np.float64))
    return out


def np_ggml_exact(qt, raw, x, expert=False):
    """llama.cpp's AVX2 result bit for bit, summation orders included (see matmul's docstring):
    vec_dot / tinyBLAS lanes for block and float types, vec_dot or tiled K-quants by row count."""
    T, K = x.shape
    N = raw.shape[0]
    if qt in Q.FLOAT_TYPES:
        W = Q.dequantize(raw, qt).astype(np.float32)
        xr = {Q.F32: x, Q.F16: x.astype(np.float16).astype(np.float32), Q.BF16: bf16(x)}[qt]
        Wb, xb = np.broadcast_arrays(W[None], xr[:, None])  # [T, N, K]
        if not expert and T >= 2 and N % 4 == 0 and K % 8 == 0:  # tinyBLAS
            acc = np.zeros((T, N, 8), np.float32)
            for k0 in range(0, K, 8):
                acc = fma(Wb[..., k0:k0 + 8], xb[..., k0:k0 + 8], acc)
            return hsum8(acc)
        npp = K - K % 32
        acc = np.zeros((T, N, 32), np.float32)
        for k0 in range(0, npp, 32):
            acc = fma(Wb[..., k0:k0 + 32], xb[..., k0:k0 + 32], acc)
        a = acc.reshape(T, N, 4, 8)
        l8 = (a[..., 0, :] + a[..., 2, :]) + (a[..., 1, :] + a[..., 3, :])
        if qt == Q.F32:
            s = hadd8(l8)
            for k in range(npp, K):
                s = fma(Wb[..., k], xb[..., k], s)
            return s
        s = (hsum8(l8) if qt == Q.BF16 else hadd8(l8)).astype(np.float64)
        for k in range(npp, K):
            s = s + (Wb[..., k] * xb[..., k]).astype(np.float64)
        return s.astype(np.float32)
    if qt in Q.KQUANT_TYPES:
        q, dx, bs = np_q8_K(x)  # [T, S, 256], [T, S], [T, S, 16]
        w, sc, mn, d, dmin = np_kquant(qt, raw)
        S = w.shape[1]
        if qt == Q.Q6_K:  # unsigned codes; lane r: half r // 4 of each 32-chunk, then the offset
            wu = (w + 32).reshape(N, S, 8, 2, 4, 4)
            qq = q.reshape(T, S, 8, 2, 4, 4)
            lanes = np.einsum("nsch,nschrj,tschrj->tnshr", sc.reshape(N, S, 8, 2), wu, qq).reshape(T, N, S, 8)
            corr = (bs[:, None] * sc[None]).reshape(T, N, S, 8, 2).sum(-1)
            lanes = lanes - 32 * corr
        else:
            lanes = np.einsum("nsg,nsgrj,tsgrj->tnsr", sc, w.reshape(N, S, 8, 8, 4), q.reshape(T, S, 8, 8, 4))
        q8s = bs.reshape(T, S, 8, 2).sum(-1)  # [T, S, 8]
        mprod = mn[None] * q8s[:, None] if qt != Q.Q6_K else None  # [T, N, S, 8]
        if T >= 8:  # tiled
            out = np.zeros((T, N), np.float32)
            for s in range(S):
                res = (d[None, :, s] * lanes[:, :, s].sum(-1).astype(np.float32)).astype(np.float32)
                if qt != Q.Q6_K:
                    res = fma(-dmin[None, :, s], mprod[:, :, s].sum(-1).astype(np.float32), res)
                out = fma(res, dx[:, None, s], out)
            return out
        acc = np.zeros((T, N, 8), np.float32)
        m4 = np.zeros((T, N, 4), np.float32)
        summs = np.zeros((T, N), np.float32)
        for s in range(S):
            dd = (dx[:, None, s] * d[None, :, s]).astype(np.float32)
            acc = fma(dd[..., None], lanes[:, :, s].astype(np.float32), acc)
            dm = (-dx[:, None, s] * dmin[None, :, s]).astype(np.float32)
            if qt == Q.Q4_K:
                m4 = fma(dm[..., None], mprod[:, :, s].reshape(T, N, 4, 2).sum(-1).astype(np.float32), m4)
            elif qt == Q.Q5_K:
                summs = fma(dm, mprod[:, :, s].sum(-1).astype(np.float32), summs)
        out = hsum8(acc)
        if qt == Q.Q4_K:
            out = out + ((m4[..., 0] + m4[..., 2]) + (m4[..., 1] + m4[..., 3]))
        elif qt == Q.Q5_K:
            out = out + summs
        return out
    q, dx, sx = np_q8_0(x)  # [T, B, 32], [T, B], [T, B]
    w, dw, mw = np_blocks32(qt, raw)
    B = w.shape[1]
    lanes = np.einsum("nbrj,tbrj->tnbr", w.reshape(N, B, 8, 4), q.reshape(T, B, 8, 4)).astype(np.float32)
    sc = (dw[None] * dx[:, None]).astype(np.float32)  # [T, N, B]
    acc = np.zeros((2, T, N, 8), np.float32)
    summs = np.zeros((T, N), np.float32)
    nb = B - B % 2 if qt == Q.MXFP4 else B
    for b in range(nb):
        p = b % 2 if qt == Q.MXFP4 else 0
        acc[p] = fma(sc[..., b, None], lanes[:, :, b], acc[p])
        summs = fma(mw[None, :, b], sx[:, None, b], summs)
    out = hsum8(acc[0] + acc[1])
    if nb < B:  # MXFP4: an odd last block, scalar
        out = fma(sc[..., B - 1], lanes[:, :, B - 1].sum(-1), out)
    if qt in (Q.Q4_1, Q.Q5_1):
        out = out + summs
    return out


def bf16(x):
    n = x.view(np.uint32).astype(np.uint64)
    return (((n + 0x7FFF + ((n >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def magnitude(qt, raw, x):
    """sum |x_k w_k| per output, the scale of float rounding in any summation order."""
    W = np.abs(Q.dequantize(raw, qt).astype(np.float64))
    return np.abs(x.astype(np.float64)) @ W.T + 1e-30


# ---- tests ----


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("qt", ALL, ids=[NAMES[t] for t in ALL])
def test_float32_numerics(qt, T):
    rng = np.random.default_rng(1000 * qt + T)
    raw, x = weights(qt, rng), activations(T, rng)
    got = M.linear(x, raw, qt, K, numerics="float32")
    ref = x.astype(np.float64) @ gq.dequantize(raw, GGMLQuantizationType(qt)).astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (T, N)
    assert (np.abs(got - ref) <= 1e-5 * magnitude(qt, raw, x)).all()


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("qt", ALL, ids=[NAMES[t] for t in ALL])
def test_ggml_numerics(qt, T):
    rng = np.random.default_rng(2000 * qt + T)
    raw, x = weights(qt, rng), activations(T, rng)
    got = M.linear(x, raw, qt, K)  # default numerics="ggml"
    assert np.array_equal(got, np_ggml_exact(qt, raw, x))  # llama.cpp's orders, bit for bit
    assert np.array_equal(M.linear(x, raw, qt, K, expert=True), np_ggml_exact(qt, raw, x, expert=True))
    ref = np_ggml(qt, raw, x)
    mag = magnitude(qt, raw, x)
    err = np.abs(got - ref) / mag
    assert err.max() <= 1e-5, err.max()
    # and loosely the float answer: activations are 8-bit (or f16/bf16)
    exact = x.astype(np.float64) @ Q.dequantize(raw, qt).astype(np.float64).T
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 2e-2
    if qt in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K):
        # the min term (Q8_1 `s`, Q8_K bsums) matters far beyond the 1e-5 tolerance
        assert (np.abs(np_ggml(qt, raw, x, drop_min=True) - ref) / mag).max() > 1e-3


def test_q8_0_activation_rounding_is_half_to_even():
    # amax = 127 -> d = 1, id = 1: the x86 path rounds x*id half to even (roundf would not)
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, 2.5, 3.5, -2.5, 0.49999997]
    xp = M.prepare(x, Q.Q8_0)
    assert xp.qs[0, :5].tolist() == [127, 2, 4, -2, 0]
    assert xp.d[0, 0] == 1.0
    xp1 = M.prepare(x, Q.Q4_1)  # Q8_1: s = d * sum(q)
    assert xp1.s[0, 0] == 131.0


def test_activation_quantizers_match_numpy():
    rng = np.random.default_rng(5)
    x = activations(5, rng) * np.float32(3)
    q, d, s = np_q8_0(x)
    xp = M.prepare(x, Q.Q4_1)
    assert np.array_equal(xp.qs.reshape(q.shape), q) and np.array_equal(xp.d, d) and np.array_equal(xp.s, s)
    q, d, bs = np_q8_K(x)
    xp = M.prepare(x, Q.Q6_K)
    assert np.array_equal(xp.qs.reshape(q.shape), q) and np.array_equal(xp.d, d)
    assert np.array_equal(xp.bsums.reshape(bs.shape), bs)


@pytest.mark.parametrize("qt", ALL, ids=[NAMES[t] for t in ALL])
def test_batch_invariance(qt):
    """A token's output does not depend on the other tokens of the call (bit for bit), except
    where llama.cpp's path depends on the row count: K-quants (tiled from 8 rows on) and float
    weights in ordinary matmuls (tinyBLAS from 2 rows on)."""
    rng = np.random.default_rng(3000 + qt)
    raw, x = weights(qt, rng), activations(17, rng)
    full = M.linear(x, raw, qt, K, "float32")
    for t in (0, 5, 16):
        assert np.array_equal(full[t], M.linear(x[t:t + 1], raw, qt, K, "float32")[0])
    full = M.linear(x, raw, qt, K)
    assert np.array_equal(full[4:12], M.linear(x[4:12], raw, qt, K))  # 8 rows
    assert np.array_equal(full[4:13], M.linear(x[4:13], raw, qt, K))
    few = M.linear(x[:5], raw, qt, K, expert=True)  # < 8 rows
    one = np.concatenate([M.linear(x[t:t + 1], raw, qt, K) for t in range(5)])
    assert np.array_equal(few, one)
    assert np.array_equal(few[1:3], M.linear(x[1:3], raw, qt, K, expert=True))
    if qt in Q.FLOAT_TYPES or qt in Q.KQUANT_TYPES:
        assert not np.array_equal(full[:5], few)  # another summation order
    else:
        assert np.array_equal(full[:5], few)


@pytest.mark.parametrize("qt", [Q.F32, Q.F16, Q.BF16, Q.MXFP4], ids=["F32", "F16", "BF16", "MXFP4"])
def test_ggml_numerics_odd_sizes(qt):
    """Float rows with K % 32 != 0 (vec_dot leftovers) and N % 4 != 0 (no tinyBLAS); MXFP4
    with an odd number of blocks."""
    rng = np.random.default_rng(4000 + qt)
    k = 200 if qt in Q.FLOAT_TYPES else 160
    for n in (7, 8):
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        raw = np.ascontiguousarray(gq.quantize(w, GGMLQuantizationType(qt))).view(np.uint8).reshape(n, -1)
        for T in (1, 3):
            x = rng.standard_normal((T, k)).astype(np.float32)
            got = M.linear(x, raw, qt, k)
            assert np.array_equal(got, np_ggml_exact(qt, raw, x)), (n, T)


def test_prepared_reuse_across_weights_of_one_vec_dot_type():
    rng = np.random.default_rng(9)
    x = activations(3, rng)
    xp = M.prepare(x, Q.Q4_0)
    for qt in (Q.Q4_0, Q.Q8_0, Q.MXFP4, Q.Q5_0):  # all take Q8_0 activations
        raw = weights(qt, rng)
        assert np.array_equal(M.linear_prepared(xp, raw, qt, K), M.linear(x, raw, qt, K))
    with pytest.raises(ValueError):
        M.linear_prepared(xp, weights(Q.Q4_1, rng), Q.Q4_1, K)  # needs Q8_1
    xf = M.prepare(x, Q.Q4_K, "float32")  # float32 numerics: one preparation fits all
    raw = weights(Q.Q6_K, rng)
    assert np.array_equal(M.linear_prepared(xf, raw, Q.Q6_K, K), M.linear(x, raw, Q.Q6_K, K, "float32"))


@pytest.mark.parametrize("qt", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.F16])
@pytest.mark.parametrize("numerics", ["ggml", "float32"])
def test_prepared_rows_equal_preparing_gathered_rows(qt, numerics):
    rng = np.random.default_rng(12)
    x = activations(5, rng)
    idx = np.array([4, 0, 0, 2, 3, 1, 4])
    got, want = M.prepare(x, qt, numerics).rows(idx), M.prepare(x[idx], qt, numerics)
    assert (got.numerics, got.vec_dot_type) == (want.numerics, want.vec_dot_type)
    for a, b in zip((got.x, got.qs, got.d, got.s, got.bsums), (want.x, want.qs, want.d, want.s, want.bsums)):
        assert (a is None) == (b is None)
        assert a is None or np.array_equal(a, b)


def test_expert_slices_and_readonly_weights():
    rng = np.random.default_rng(11)
    E = 3
    stacked = random_blocks(Q.Q4_K, (E, N), K, rng)  # [E, N, row_bytes]
    stacked.flags.writeable = False  # as an mmapped file
    x = activations(2, rng)
    for e in range(E):
        assert np.array_equal(M.linear(x, stacked[e], Q.Q4_K, K), M.linear(x, stacked[e].copy(), Q.Q4_K, K))


def test_errors():
    rng = np.random.default_rng(12)
    x = activations(1, rng)
    raw = weights(Q.Q8_0, rng)
    with pytest.raises(ValueError):
        M.linear(x, raw, Q.Q8_0, K, numerics="fast")
    with pytest.raises(UnsupportedError):
        M.linear(x, raw, int(GGMLQuantizationType.Q2_K), K)
    with pytest.raises(ValueError):
        M.linear(x, raw[:, :-34], Q.Q8_0, K)  # row bytes do not match k
    with pytest.raises(TypeError):
        M.linear(x.astype(np.float64), raw, Q.Q8_0, K)
    with pytest.raises(UnsupportedError):
        M.linear(x[:, :100], raw, Q.Q8_0, 100)  # k not whole blocks
    assert M.linear(x[:0], raw, Q.Q8_0, K).shape == (0, N)


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.MXFP4, Q.Q4_K, Q.Q6_K, Q.F16])
def test_linear_selected_equals_one_token_expert_calls(qt):
    """The decode-step expert kernel gives, row for row, what separate one-token calls give."""
    rng = np.random.default_rng(5)
    stack = np.stack([weights(qt, rng) for _ in range(5)])  # [E, N, row_bytes]
    x = activations(3, rng)
    xp = M.prepare(x, qt)
    sel = np.array([4, 0, 2, 3])
    xrow = np.array([0, 2, 2, 1])
    got = M.linear_selected(xp, stack, sel, xrow, qt, K)
    for a, (e, r) in enumerate(zip(sel, xrow)):
        want = M.linear(x[r:r + 1], stack[e], qt, K, expert=True)[0]
        assert np.array_equal(got[a], want)
    with pytest.raises(ValueError):
        M.linear_selected(xp, stack, np.array([5]), np.array([0]), qt, K)


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.MXFP4, Q.F16])
@pytest.mark.parametrize("solo", [False, True])
def test_linear_grouped_equals_separate_expert_calls(qt, solo):
    """The one-call-per-layer expert kernel gives, expert by expert, what separate expert calls on
    each expert's rows give: 13 rows for one expert (>= 8: K-quant tiled unless solo; block kernels
    take them 8 + 4 + 1), 1, 0, 3."""
    rng = np.random.default_rng(6)
    stack = np.stack([weights(qt, rng) for _ in range(5)])  # [E, N, row_bytes]
    counts = [13, 1, 0, 3]
    experts = np.array([3, 0, 4, 1])
    offs = np.concatenate([[0], np.cumsum(counts)])
    x = activations(int(offs[-1]), rng)
    got = M.linear_grouped(M.prepare(x, qt), stack, experts, offs, qt, K, solo)
    for j, e in enumerate(experts):
        r0, r1 = offs[j], offs[j + 1]
        if r1 == r0:
            continue
        want = (np.concatenate([M.linear(x[r:r + 1], stack[e], qt, K, expert=True) for r in range(r0, r1)])
                if solo else M.linear(x[r0:r1], stack[e], qt, K, expert=True))
        assert np.array_equal(got[r0:r1], want), (j, solo)
    with pytest.raises(ValueError):
        M.linear_grouped(M.prepare(x, qt), stack, np.array([5, 0, 1, 2]), offs, qt, K)
    with pytest.raises(ValueError):
        M.linear_grouped(M.prepare(x, qt), stack, experts, offs[:-1], qt, K)
