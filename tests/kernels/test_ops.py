"""Tests of daemon.kernels.ops: the emulations of ggml's AVX2 CPU numerics.

Three kinds of references:
- slow, independent transcriptions (Python / numpy float32 scalars, exact FMAs with Fractions)
  of the algorithms ggml runs (ggml_v_expf, the softmax / tinyBLAS / vec_dot summation orders),
  compared bit for bit;
- plain float64 formulas, compared with a tolerance (rms_norm, RoPE, attention);
- libggml itself (the llama-cpp-python build the fixtures use), called through ctypes on the
  same inputs and compared bit for bit; skipped when that library is missing or was not built
  for plain AVX2 (AVX512 builds use other SIMD widths), failed instead when `CI` is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from daemon.kernels import ops
from tests.conftest import needs_reference

f32 = np.float32


# --------------------------------------------------------------------------------------------
# exact helpers


def _bits(x) -> int:
    return int(np.array([x], np.float32).view(np.uint32)[0])


def _from_bits(u: int) -> np.float32:
    return np.array([u & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


def _round_f32(v: Fraction) -> np.float32:
    """Exact value -> nearest float32, ties to even (no double rounding)."""
    if v == 0:
        return f32(0.0)
    c = f32(float(v))
    best = None
    for cand in (np.nextafter(c, f32(-np.inf)), c, np.nextafter(c, f32(np.inf))):
        if not np.isfinite(cand):
            continue
        d = abs(Fraction(float(cand)) - v)
        key = (d, _bits(cand) & 1)
        if best is None or key < best[0]:
            best = (key, cand)
    return f32(best[1])


def fma_ref(a, b, c) -> np.float32:
    a, b, c = f32(a), f32(b), f32(c)
    if not (np.isfinite(a) and np.isfinite(b) and np.isfinite(c)):
        return f32(np.float64(a) * np.float64(b) + np.float64(c))
    return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


_C = {k: f32(float.fromhex(v)) for k, v in dict(
    r="0x1.8p23", log2e="0x1.715476p+0", ln2hi="0x1.62e4p-1", ln2lo="0x1.7f7d1cp-20",
    c1="0x1.ffffecp-1", c2="0x1.fffdb6p-2", c3="0x1.555e66p-3", c4="0x1.573e2ep-5",
    c5="0x1.0e4020p-7").items()}


def v_expf_ref(x) -> np.float32:
    """ggml_v_expf (ggml-cpu/vec.h, __AVX2__ && __FMA__), one lane, transcribed."""
    x = f32(x)
    with np.errstate(all="ignore"):
        z = fma_ref(x, _C["log2e"], _C["r"])
        n = f32(z - _C["r"])
        b = fma_ref(-n, _C["ln2lo"], fma_ref(-n, _C["ln2hi"], x))
        e = (_bits(z) << 23) & 0xFFFFFFFF
        k = _from_bits(e + _bits(f32(1.0)))
        c = abs(n) > 126  # _CMP_GT_OQ: false for NaN
        u = f32(b * b)
        j = fma_ref(fma_ref(fma_ref(_C["c5"], b, _C["c4"]), u, fma_ref(_C["c3"], b, _C["c2"])), u,
                    f32(_C["c1"] * b))
        if not c:
            return fma_ref(j, k, k)
        g = 0x82000000 if n <= 0 else 0
        s1 = _from_bits(g + 0x7F000000)
        s2 = _from_bits(e - g)
        if abs(n) > 192:
            return f32(s1 * s1)
        return f32(fma_ref(s2, j, s2) * s1)


def _libm_expf():
    name = ctypes.util.find_library("m")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).expf
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float]
    return lambda x: f32(fn(float(x)))


EXPF = _libm_expf()
needs_libm = needs_reference(EXPF is not None, "no C libm expf to compare with")


def hsum8_ref(v):
    v = [f32(a) for a in v]
    return f32(f32(f32(v[0] + v[4]) + f32(v[2] + v[6])) + f32(f32(v[1] + v[5]) + f32(v[3] + v[7])))


def reduce32_ref(acc):
    """GGML_F32x8_REDUCE of 4 x 8 lanes acc[32] (AVX): pairwise vectors, then lo+hi and hadds."""
    a = [f32(x) for x in acc]
    s = [f32(f32(a[r] + a[16 + r]) + f32(a[8 + r] + a[24 + r])) for r in range(8)]
    t = [f32(s[r] + s[r + 4]) for r in range(4)]
    return f32(f32(t[0] + t[1]) + f32(t[2] + t[3]))


def same(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


@njit(cache=True)
def _v_expf_arr(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = ops.v_expf(x[i])
    return out


@njit(cache=True)
def _fma_arr(a, b, c):
    out = np.empty_like(a)
    for i in range(a.shape[0]):
        out[i] = ops.fma32(a[i], b[i], c[i])
    return out


# --------------------------------------------------------------------------------------------
# scalar building blocks


def test_fma32_is_a_single_rounding():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(400).astype(np.float32)
    b = rng.standard_normal(400).astype(np.float32)
    c = (rng.standard_normal(400) * 1e-3).astype(np.float32)
    # products that nearly cancel c expose a second rounding
    c[:100] = -(a[:100].astype(np.float64) * b[:100]).astype(np.float32)
    got = _fma_arr(a, b, c)
    want = np.array([fma_ref(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    assert same(got, want)


def test_v_expf_matches_transcription():
    rng = np.random.default_rng(1)
    edge = [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 0.5, -0.5, 10.0, -10.0, 87.0, 88.0, 88.3, 88.38,
            88.5, 88.72, 89.0, 100.0, 200.0, -87.0, -87.33, -87.5, -88.0, -100.0, -103.0, -103.97,
            -104.0, -110.0, -126 * math.log(2), -127 * math.log(2), -133.0, -150.0, -1000.0, 1000.0,
            3.4e38, -3.4e38, np.inf, -np.inf, np.nan]
    xs = np.concatenate([np.array(edge), rng.uniform(-110, 90, 1200), -rng.exponential(5, 600),
                         rng.standard_normal(300) * 1e-3]).astype(np.float32)
    got = _v_expf_arr(xs)
    want = np.array([v_expf_ref(x) for x in xs], np.float32)
    assert same(got, want)
    assert _v_expf_arr(np.array([-np.inf, 0.0, np.inf], np.float32)).tolist() == [0.0, 1.0, np.inf]


def test_v_expf_is_accurate():
    x = np.linspace(-87, 88, 20001).astype(np.float32)
    got = _v_expf_arr(x).astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - exact) / ulp) < 2.0  # ggml: max error 1.45 ulp + 0.5
    assert np.mean(got != exact.astype(np.float32)) > 0.001  # and not correctly rounded


def test_round_f16_matches_numpy():
    sweep = np.arange(0, 2**32, 4093, dtype=np.uint64).astype(np.uint32).view(np.float32)
    k = np.arange(-3000, 3000, dtype=np.float64)
    special = np.concatenate([
        k * 2.0**-25,  # f16 subnormal ties and midpoints
        k * 2.0**-24, 2.0**-14 * (1 + k / 2048.0),  # around the smallest normals
        65504.0 + k / 128.0,  # around the overflow threshold (65520 rounds to inf)
        1.0 + k * 2.0**-11,  # ties between f16 neighbours near 1
        [0.0, -0.0, np.inf, -np.inf, np.nan, 65519.996, 65520.0, -65520.0, 1e-8, 2.9802322e-08,
         2.9802326e-08, 5.9604645e-08, 6.1035156e-05, 3.4e38],
    ]).astype(np.float32)
    for x in (sweep, special):
        with np.errstate(over="ignore"):
            want = x.astype(np.float16).astype(np.float32)
        assert same(ops.round_f16_array(x), want)
    assert np.signbit(ops.round_f16_array(np.array([-0.0, -1e-9], np.float32))).all()


def test_to_f16_values_matches_numpy_on_every_non_nan():
    sweep = np.arange(0, 2**32, 4093, dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65519.996, 65520.0, -65520.0, 1e-8, 2.9802322e-08,
                        2.9802326e-08, 5.9604645e-08, 6.1035156e-05, 3.4e38, 1.0 + 2.0**-11], np.float32)
    for x in (sweep, special):
        finite = x[~np.isnan(x)].reshape(1, -1).copy()  # any C-contiguous shape
        with np.errstate(over="ignore"):
            want = finite.astype(np.float16).astype(np.float32)
        ops.to_f16_values(finite)
        assert same(finite, want)
    nan = sweep[np.isnan(sweep)].copy()
    ops.to_f16_values(nan)
    assert np.isnan(nan).all()


# --------------------------------------------------------------------------------------------
# norms and RoPE


def test_rms_norm_matches_ggml_formula():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((7, 300)) * rng.uniform(0.01, 30, (7, 1))).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    eps = f32(1e-5)
    acc = np.cumsum((x * x).astype(np.float64), axis=1)[:, -1]  # sequential float64 sum
    mean = (acc / 300).astype(np.float32)
    scale = f32(1.0) / np.sqrt(mean + eps)
    want = (x * scale[:, None]) * w
    assert same(ops.rms_norm(x, w, eps), want)
    xh = x.reshape(7, 3, 100)
    acc = np.cumsum((xh * xh).astype(np.float64), axis=2)[..., -1]
    scale = f32(1.0) / np.sqrt((acc / 100).astype(np.float32) + eps)
    assert same(ops.rms_norm_heads(xh, w[:100], eps), (xh * scale[..., None]) * w[:100])
    ref = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(ops.rms_norm(x, w, eps), ref, rtol=2e-6, atol=1e-6)


def _rope_ref64(x, pos, n_dims, base, neox, freq_scale=1.0, ext=0.0, corr=(0.0, 0.0), mscale=1.0):
    x = x.astype(np.float64)
    out = x.copy()
    half = n_dims // 2
    i = np.arange(half)
    theta_e = pos[:, None] * base ** (-2.0 * i / n_dims)
    theta = freq_scale * theta_e
    ms = mscale
    if ext:
        y = (i - corr[0]) / max(0.001, corr[1] - corr[0])
        mix = (1 - np.clip(y, 0, 1)) * ext
        theta = theta * (1 - mix) + theta_e * mix
        ms = mscale * (1 + 0.1 * math.log(1 / freq_scale))
    c, s = np.cos(theta)[:, None, :] * ms, np.sin(theta)[:, None, :] * ms
    a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
    out[..., a] = x[..., a] * c - x[..., b] * s
    out[..., b] = x[..., a] * s + x[..., b] * c
    return out


@pytest.mark.parametrize("neox", [False, True])
def test_rope_vs_float64(neox):
    rng = np.random.default_rng(3)
    T, H, Dh, n_dims = 40, 3, 64, 48  # partial rotation: the last 16 dims pass through
    x = rng.standard_normal((T, H, Dh)).astype(np.float32)
    pos = np.arange(5, 5 + T)
    tab = ops.rope_cache(pos, n_dims, 10000.0, 1.0, 0.0, 1.0, (0.0, 0.0))
    got = ops.apply_rope(x, tab, n_dims, neox)
    assert same(got[..., n_dims:], x[..., n_dims:])
    np.testing.assert_allclose(got, _rope_ref64(x, pos, n_dims, 10000.0, neox), atol=2e-5)
    # YaRN (gpt-oss-like: factor 32, original context 4096)
    corr = ops.yarn_corr_dims(Dh, 4096, 150000.0, 32.0, 1.0)
    assert corr == (8.0, 18.0)
    tab = ops.rope_cache(pos, Dh, 150000.0, 1 / 32, 1.0, 1.0, corr)
    got = ops.apply_rope(x, tab, Dh, neox)
    np.testing.assert_allclose(got, _rope_ref64(x, pos, Dh, 150000.0, neox, 1 / 32, 1.0, corr), atol=3e-5)


def test_rope_rotation_is_fma_contracted():
    """ggml's rotate_pairs compiles x0*c - x1*s to fma(x0, c, -(x1*s)), x0*s + x1*c to
    fma(x0, s, x1*c); the cache is built by repeated float32 multiplication of theta."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((4, 2, 16)) * 3).astype(np.float32)
    pos = np.array([0, 1, 17, 1000])
    tab = ops.rope_cache(pos, 16, 10000.0, 1.0, 0.0, 1.0, (0.0, 0.0))
    theta_scale = f32(f32(10000.0) ** f32(f32(-2.0) / f32(16)))
    for t, p in enumerate(pos):
        theta = f32(p)
        for i in range(8):  # glibc cosf/sinf of the float32 angle: within an ulp of the exact value
            assert abs(tab[t, i, 0] - math.cos(theta)) <= 6e-8 and abs(tab[t, i, 1] - math.sin(theta)) <= 6e-8
            theta = f32(theta * theta_scale)
    for neox in (False, True):
        got = ops.apply_rope(x, tab, 16, neox)
        for t in range(4):
            for h in range(2):
                for i in range(8):
                    a, b = (i, i + 8) if neox else (2 * i, 2 * i + 1)
                    c, s = tab[t, i]
                    x0, x1 = x[t, h, a], x[t, h, b]
                    assert got[t, h, a] == fma_ref(x0, c, -f32(x1 * s))
                    assert got[t, h, b] == fma_ref(x0, s, f32(x1 * c))


# --------------------------------------------------------------------------------------------
# softmax and activations


def _soft_max_ref(row, mx=None):
    """ggml_vec_soft_max_f32 (AVX2) on one row: v_expf on groups of 8 summed in float32, then in
    float64; scalar expf on the tail."""
    n = len(row)
    mx = max(row) if mx is None else mx
    e = np.zeros(n, np.float32)
    total = 0.0
    nv = n - n % 8
    for g in range(0, nv, 8):
        for i in range(g, g + 8):
            e[i] = v_expf_ref(f32(row[i] - mx))
        total += float(hsum8_ref(e[g:g + 8]))
    for i in range(nv, n):
        e[i] = EXPF(f32(row[i] - mx))
        total += float(e[i])
    return e, total


@needs_libm
@pytest.mark.parametrize("n", [4, 8, 13, 32])
def test_softmax_rows_matches_transcription(n):
    rng = np.random.default_rng(5 + n)
    x = (rng.standard_normal((6, n)) * 5).astype(np.float32)
    x[0, 0] = -np.inf
    want = np.empty_like(x)
    for t in range(6):
        e, total = _soft_max_ref(x[t])
        want[t] = e * f32(1.0 / total)
    got = ops.softmax_rows(x)
    assert same(got, want)
    np.testing.assert_allclose(got, np.exp(x - x.max(1, keepdims=True)) / np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True), rtol=1e-6, atol=1e-7)


@needs_libm
def test_swiglu_and_silu_match_transcription():
    rng = np.random.default_rng(6)
    g = (rng.standard_normal((3, 21)) * 4).astype(np.float32)  # 16 SIMD lanes + 5 scalar
    g[0, :6] = [0.0, -0.0, 100.0, -100.0, 88.7, -104.5]
    g[1, 17:] = [0.0, 100.0, -100.0, 89.0]
    u = rng.standard_normal((3, 21)).astype(np.float32)

    def silu_ref(i, x):
        if i < 16:
            return f32(x / f32(f32(1.0) + v_expf_ref(f32(f32(0.0) - x))))
        return f32(x / f32(f32(1.0) + EXPF(-x)))

    s = np.array([[silu_ref(i, x) for i, x in enumerate(row)] for row in g], np.float32)
    assert same(ops.silu(g), s)
    assert same(ops.swiglu(g, u), s * u)
    np.testing.assert_allclose(ops.swiglu(g, u), g / (1 + np.exp(-g.astype(np.float64))) * u, rtol=1e-6, atol=1e-30)


@needs_libm
def test_swiglu_oai_matches_scalar_formula():
    rng = np.random.default_rng(7)
    g = (rng.standard_normal((4, 37)) * 6).astype(np.float32)
    u = (rng.standard_normal((4, 37)) * 6).astype(np.float32)
    alpha, limit = f32(1.702), f32(7.0)
    want = np.empty_like(g)
    for idx in np.ndindex(g.shape):
        x = min(g[idx], limit)
        y = min(max(u[idx], -limit), limit)
        want[idx] = f32(f32(x / f32(f32(1.0) + EXPF(f32(alpha * -x)))) * f32(y + f32(1.0)))
    assert same(ops.swiglu_oai(g, u, alpha, limit), want)


# --------------------------------------------------------------------------------------------
# attention


def _attention_ref_ggml(q, k, v, pos, scale, window, sinks):
    """llama.cpp without flash attention, transcribed: tinyBLAS (T >= 2) or vec_dot_f16 (T == 1)
    lane orders for KQ and KQV, soft_max_ext with 8-aligned v_expf groups of the KV row."""
    T, H, Dh = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    out = np.zeros((T, H, Dv), np.float32)
    for t in range(T):
        p = int(pos[t])
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            kh = h // (H // Hkv)
            s = {}
            for j in range(lo, p + 1):
                prods = [f32(q[t, h, d] * k[j, kh, d]) for d in range(Dh)]
                if T >= 2:
                    lanes = [f32(0.0)] * 8
                    for d in range(Dh):
                        lanes[d % 8] = f32(lanes[d % 8] + prods[d])
                    val = hsum8_ref(lanes)
                else:
                    lanes = [f32(0.0)] * 32
                    for d in range(Dh):
                        lanes[d % 32] = f32(lanes[d % 32] + prods[d])
                    val = reduce32_ref(lanes)
                s[j] = f32(val * scale)
            mx = max(s.values())
            if len(sinks):
                mx = max(mx, sinks[h])
            e = {j: v_expf_ref(f32(s[j] - mx)) for j in s}
            total = 0.0
            for g0 in range(lo - lo % 8, p + 1, 8):
                total += float(hsum8_ref([e.get(j, f32(0.0)) for j in range(g0, g0 + 8)]))
            if len(sinks):
                total += float(EXPF(f32(sinks[h] - mx)))
            inv = f32(1.0 / total)
            w = {j: np.float32(np.float16(f32(e[j] * inv))) for j in e}
            nl = 8 if T >= 2 else 32
            acc = np.zeros((nl, Dv), np.float32)
            for j in range(lo, p + 1):
                acc[j % nl] = acc[j % nl] + w[j] * v[j, kh]
            for d in range(Dv):
                out[t, h, d] = hsum8_ref(acc[:, d]) if nl == 8 else reduce32_ref(acc[:, d])
    return out


def _attention_ref64(q, k, v, pos, scale, window, sinks):
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    out = np.zeros((T, H, v.shape[2]))
    for t in range(T):
        p = int(pos[t])
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            kh = h // (H // Hkv)
            sc = k[lo:p + 1, kh].astype(np.float64) @ q[t, h].astype(np.float64) * float(scale)
            m = max(sc.max(), sinks[h]) if len(sinks) else sc.max()
            e = np.exp(sc - m)
            den = e.sum() + (math.exp(sinks[h] - m) if len(sinks) else 0.0)
            out[t, h] = (e / den) @ v[lo:p + 1, kh].astype(np.float64)
    return out


def _f16(a):
    return a.astype(np.float16).astype(np.float32)


CASES = [  # T, start, H, Hkv, Dh, window, sinks
    (5, 0, 4, 2, 16, 0, False),
    (6, 11, 4, 1, 16, 4, True),
    (1, 19, 4, 2, 40, 0, False),  # vec_dot_f16 with 8 leftover products
    (1, 22, 2, 2, 16, 5, True),
]


@needs_libm
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_transcription(case):
    T, start, H, Hkv, Dh, window, has_sinks = case
    rng = np.random.default_rng(sum(case))
    C = start + T
    q = _f16(rng.standard_normal((T, H, Dh)).astype(np.float32) * 2)
    k = _f16(rng.standard_normal((C, Hkv, Dh)).astype(np.float32) * 2)
    v = _f16(rng.standard_normal((C, Hkv, Dh)).astype(np.float32))
    pos = np.arange(start, start + T)
    scale = f32(1 / math.sqrt(Dh))
    sinks = (rng.standard_normal(H) * 2).astype(np.float32) if has_sinks else np.empty(0, np.float32)
    got = ops.attention(q, k, v, pos, scale, window, sinks, True)
    assert same(got, _attention_ref_ggml(q, k, v, pos, scale, window, sinks))
    ref = _attention_ref64(q, k, v, pos, scale, window, sinks)
    np.testing.assert_allclose(got, ref, atol=3e-3 * np.abs(ref).max())
    plain = ops.attention(q, k, v, pos, scale, window, sinks, False)
    np.testing.assert_allclose(plain, ref, atol=1e-5 * np.abs(ref).max())


def test_attention_window_and_sinks_semantics():
    rng = np.random.default_rng(9)
    T, H, Dh = 12, 2, 8
    q = _f16(rng.standard_normal((T, H, Dh)).astype(np.float32))
    k = _f16(rng.standard_normal((T, 1, Dh)).astype(np.float32))
    v = _f16(rng.standard_normal((T, 1, Dh)).astype(np.float32))
    pos = np.arange(T)
    none = np.empty(0, np.float32)
    full = ops.attention(q, k, v, pos, f32(0.3), 0, none, True)
    win = ops.attention(q, k, v, pos, f32(0.3), 3, none, True)
    assert same(full[:3], win[:3])  # the first 3 positions see everything anyway
    assert not np.allclose(full[5:], win[5:])
    # each row is the same whether it is computed in a batch of >= 2 tokens or with the rest
    assert same(ops.attention(q[4:9], k[:9], v[:9], pos[4:9], f32(0.3), 3, none, True), win[4:9])
    # a very negative sink changes nothing; a large one shrinks every output toward 0
    s_lo = np.full(H, -1e4, np.float32)
    assert same(ops.attention(q, k, v, pos, f32(0.3), 0, s_lo, True), full)
    s_hi = np.full(H, 30.0, np.float32)
    assert np.abs(ops.attention(q, k, v, pos, f32(0.3), 0, s_hi, True)).max() < 1e-6


@pytest.mark.parametrize("ggml", [True, False])
@pytest.mark.parametrize("window, has_sinks", [(0, False), (4, True)])
def test_attention_decode_equals_one_token_calls(ggml, window, has_sinks):
    """A decode step of B sequences in one call: each stores its new cell, and each output is
    bit-identical to a one-token attention() call on that sequence's own cache."""
    from numba.typed import List

    rng = np.random.default_rng(7 + window)
    L, H, Hkv, Dh, Dv = 3, 6, 2, 16, 8
    past = [0, 3, 17, 9, 40]  # cells already in each cache; the new token goes there
    caps = [n + 1 + int(rng.integers(0, 5)) for n in past]  # room for the new cell, some spare
    ks = [_f16(rng.standard_normal((L, c, Hkv, Dh)).astype(np.float32)) for c in caps]
    vs = [_f16(rng.standard_normal((L, c, Hkv, Dv)).astype(np.float32)) for c in caps]
    B = len(past)
    q = _f16(rng.standard_normal((B, H, Dh)).astype(np.float32))
    k_new = _f16(rng.standard_normal((B, Hkv, Dh)).astype(np.float32))
    v_new = _f16(rng.standard_normal((B, Hkv, Dv)).astype(np.float32))
    sinks = rng.standard_normal(H).astype(np.float32) if has_sinks else np.empty(0, np.float32)
    pos = np.array(past, dtype=np.int64)
    layer, scale = 1, f32(0.25)
    before = [(k.copy(), v.copy()) for k, v in zip(ks, vs)]
    got = ops.attention_decode(q, k_new, v_new, List(ks), List(vs), layer, pos, scale, window, sinks, ggml)
    assert got.shape == (B, H, Dv)
    for b in range(B):
        k0, v0 = before[b]
        k0[layer, past[b]] = k_new[b]
        v0[layer, past[b]] = v_new[b]
        assert same(ks[b], k0) and same(vs[b], v0)  # exactly the new cell written
        n = past[b] + 1
        want = ops.attention(q[b:b + 1], ks[b][layer, :n], vs[b][layer, :n], pos[b:b + 1], scale, window, sinks,
                             ggml)
        assert same(got[b:b + 1], want)
    assert not np.allclose(got[0], got[1])  # each row saw its own cache


# --------------------------------------------------------------------------------------------
# against libggml itself (llama-cpp-python's build)


def _ggml():
    try:
        import llama_cpp
    except ImportError:
        return None
    lib = Path(llama_cpp.__file__).parent / "lib"
    try:
        base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        for name in ("ggml_cpu_has_avx2", "ggml_cpu_has_fma", "ggml_cpu_has_f16c", "ggml_cpu_has_avx512"):
            getattr(cpu, name).restype = ctypes.c_int
        if not (cpu.ggml_cpu_has_avx2() and cpu.ggml_cpu_has_fma() and cpu.ggml_cpu_has_f16c()) \
                or cpu.ggml_cpu_has_avx512():
            return None
        return _Ggml(base, cpu)
    except (OSError, AttributeError):
        return None


class _Ggml:
    """Just enough of the ggml C API to run one op on numpy arrays."""

    class Params(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    def __init__(self, base, cpu):
        P, F, I = ctypes.c_void_p, ctypes.c_float, ctypes.c_int

        def fn(lib, name, res, *args):
            f = getattr(lib, name)
            f.restype, f.argtypes = res, list(args)
            return f

        self.init = fn(base, "ggml_init", P, self.Params)
        self.free = fn(base, "ggml_free", None, P)
        self.nt = {n: fn(base, f"ggml_new_tensor_{n}d", P, P, I, *[ctypes.c_int64] * n) for n in (1, 2, 3)}
        self.data = fn(base, "ggml_get_data", P, P)
        self.nbytes = fn(base, "ggml_nbytes", ctypes.c_size_t, P)
        self.graph = fn(base, "ggml_new_graph", P, P)
        self.expand = fn(base, "ggml_build_forward_expand", None, P, P)
        self.compute = fn(cpu, "ggml_graph_compute_with_ctx", I, P, P, I)
        self.rope_ext = fn(base, "ggml_rope_ext", P, P, P, P, P, I, I, I, F, F, F, F, F, F)
        self.soft_max_ext = fn(base, "ggml_soft_max_ext", P, P, P, P, F, F)
        self.add_sinks = fn(base, "ggml_soft_max_add_sinks", None, P, P)
        self.mul_mat = fn(base, "ggml_mul_mat", P, P, P, P)
        self.mul_mat_id = fn(base, "ggml_mul_mat_id", P, P, P, P, P)
        self.swiglu_split = fn(base, "ggml_swiglu_split", P, P, P, P)
        self.swiglu_oai = fn(base, "ggml_swiglu_oai", P, P, P, P, F, F)
        self.rms_norm = fn(base, "ggml_rms_norm", P, P, P, F)
        self.silu = fn(base, "ggml_silu", P, P, P)

    def run(self, build, *arrays, shape):
        mem = 64 << 20
        buf = ctypes.create_string_buffer(mem)
        ctx = self.init(self.Params(mem, ctypes.cast(buf, ctypes.c_void_p), False))
        try:
            ts = []
            for a in arrays:
                if isinstance(a, tuple):  # (raw uint8 bytes, ggml type, ne): a tensor of any type
                    raw, qt, ne = a
                    t = self.nt[len(ne)](ctx, qt, *ne)
                    assert self.nbytes(t) == raw.nbytes
                    ctypes.memmove(self.data(t), np.ascontiguousarray(raw).ctypes.data, raw.nbytes)
                    ts.append(t)
                    continue
                a = np.ascontiguousarray(a)
                t = self.nt[a.ndim](ctx, {np.float32: 0, np.float16: 1, np.int32: 26}[a.dtype.type], *a.shape[::-1])
                ctypes.memmove(self.data(t), a.ctypes.data, a.nbytes)
                ts.append(t)
            out_t = build(ctx, *ts)
            g = self.graph(ctx)
            self.expand(g, out_t)
            assert self.compute(ctx, g, 2) == 0
            out = np.empty(shape, np.float32)
            assert self.nbytes(out_t) == out.nbytes
            ctypes.memmove(out.ctypes.data, self.data(out_t), out.nbytes)
            return out
        finally:
            self.free(ctx)


GGML = _ggml()
needs_ggml = needs_reference(GGML is not None, "llama-cpp-python's libggml (AVX2 build) not available")


@needs_ggml
def test_ops_equal_libggml():
    G = GGML
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((9, 256)) * 2).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    y = G.run(lambda c, a: G.rms_norm(c, a, 1e-5), x, shape=x.shape) * w
    assert same(ops.rms_norm(x, w, f32(1e-5)), y)
    for n in (4, 8, 13, 32):
        x = (rng.standard_normal((9, n)) * 4).astype(np.float32)
        assert same(ops.softmax_rows(x), G.run(lambda c, a: G.soft_max_ext(c, a, None, 1.0, 0.0), x, shape=x.shape))
    g = (rng.standard_normal((5, 100)) * 3).astype(np.float32)
    u = (rng.standard_normal((5, 100)) * 3).astype(np.float32)
    assert same(ops.swiglu(g, u), G.run(G.swiglu_split, g, u, shape=g.shape))
    assert same(ops.silu(g), G.run(G.silu, g, shape=g.shape))
    assert same(ops.swiglu_oai(g, u, f32(1.702), f32(7.0)),
                G.run(lambda c, a, b: G.swiglu_oai(c, a, b, 1.702, 7.0), g, u, shape=g.shape))
    x = (rng.standard_normal((50, 4, 64)) * 3).astype(np.float32)
    pos = (np.arange(50) * 7).astype(np.int32)
    for neox in (False, True):
        for base, fs, ext in ((10000.0, 1.0, 0.0), (150000.0, 1 / 32, 1.0)):
            want = G.run(lambda c, a, p: G.rope_ext(c, a, p, None, 64, 2 if neox else 0, 4096, base, fs, ext, 1.0, 32.0, 1.0),
                         x, pos, shape=x.shape)
            tab = ops.rope_cache(pos.astype(np.int64), 64, base, fs, ext, 1.0, ops.yarn_corr_dims(64, 4096, base, 32.0, 1.0))
            assert same(ops.apply_rope(x, tab, 64, neox), want)
    ff = rng.uniform(1.0, 8.0, 32).astype(np.float32)  # rope_freqs.weight (llama3-style factors)
    want = G.run(lambda c, a, p, f: G.rope_ext(c, a, p, f, 64, 0, 4096, 500000.0, 1.0, 0.0, 1.0, 32.0, 1.0),
                 x, pos, ff, shape=x.shape)
    tab = ops.rope_cache(pos.astype(np.int64), 64, 500000.0, 1.0, 0.0, 1.0, (0.0, 0.0), freq_factors=ff)
    assert same(ops.apply_rope(x, tab, 64, False), want)


@needs_ggml
@pytest.mark.parametrize("T,start,H,Hkv,window,has_sinks", [
    (40, 0, 4, 2, 0, False), (33, 7, 8, 2, 8, True), (1, 70, 4, 2, 0, False), (1, 90, 8, 2, 8, True)])
def test_attention_equals_libggml(T, start, H, Hkv, window, has_sinks):
    """The non-flash-attention graph: kq = mul_mat(K f16, q), soft_max_ext(kq, mask, scale) (+ sinks),
    kqv = mul_mat(V^T f16, kq), over a 256-cell KV row as llama.cpp pads it."""
    G = GGML
    rng = np.random.default_rng(T + start)
    Dh, n_kv = 64, 256
    C = start + T
    k = _f16(rng.standard_normal((C, Hkv, Dh)).astype(np.float32) * 2)
    v = _f16(rng.standard_normal((C, Hkv, Dh)).astype(np.float32))
    q = _f16(rng.standard_normal((T, H, Dh)).astype(np.float32) * 2)
    pos = np.arange(start, start + T)
    scale = f32(1 / math.sqrt(Dh))
    sinks = (rng.standard_normal(H) * 2).astype(np.float32) if has_sinks else np.empty(0, np.float32)
    kf = np.zeros((Hkv, n_kv, Dh), np.float16)
    kf[:, :C] = k.transpose(1, 0, 2)
    vf = np.zeros((Hkv, Dh, n_kv), np.float16)
    vf[:, :, :C] = v.transpose(1, 2, 0)
    mask = np.full((T, n_kv), -np.inf, np.float32)
    for t, p in enumerate(pos):
        mask[t, (max(0, p - window + 1) if window else 0):p + 1] = 0

    def build(c, kt, qt, mt, vt, *st):
        sm = G.soft_max_ext(c, G.mul_mat(c, kt, qt), mt, float(scale), 0.0)
        if st:
            G.add_sinks(sm, st[0])
        return G.mul_mat(c, vt, sm)

    extra = (sinks,) if has_sinks else ()
    want = G.run(build, kf, q.transpose(1, 0, 2), mask, vf, *extra, shape=(H, T, Dh)).transpose(1, 0, 2)
    assert same(ops.attention(q, k, v, pos, scale, window, sinks, True), want)


MUL_MAT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]


@needs_ggml
@pytest.mark.parametrize("name", MUL_MAT_TYPES)
def test_mul_mat_equals_libggml(name):
    """matmul.linear ("ggml" numerics) against ggml_mul_mat (and one expert of ggml_mul_mat_id)
    itself, bit for bit, for every weight
    type moed supports: activation quantization to the vec_dot type, the integer block dots, the
    scale combination and the summation order. Row counts 1, 3, 8 and 17 cross the switches
    between llama.cpp's paths (vec_dot, tinyBLAS for >= 2 float rows, tiled K-quants for >= 8);
    13 output rows (N % 4 != 0) keep float weights off tinyBLAS."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gq

    from daemon.kernels import matmul as M
    from daemon.kernels import quants as Q
    from tests.kernels.test_quants import random_blocks

    qt, K = int(getattr(Q, name)), 512
    rng = np.random.default_rng(qt)
    for N in (12, 13):
        if qt in Q.FLOAT_TYPES:  # random bytes would be NaN / inf now and then
            w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
            raw = np.ascontiguousarray(gq.quantize(w, GGMLQuantizationType(qt))).view(np.uint8).reshape(N, -1)
        else:  # random codes, finite scales
            raw = random_blocks(qt, (N,), K, rng)
        for T in (1, 3, 8, 17):
            x = rng.standard_normal((T, K)).astype(np.float32)
            x[0, 32:64] = 0.0  # an all-zero activation block (scale 0)
            want = GGML.run(GGML.mul_mat, (raw, qt, (K, N)), x, shape=(T, N))
            assert same(M.linear(x, raw, qt, K), want), (name, N, T)
            # one expert of a MUL_MAT_ID (no tinyBLAS there) with all T rows routed to it
            ids = np.zeros((T, 1), np.int32)
            want = GGML.run(GGML.mul_mat_id, (raw, qt, (K, N, 1)), x[:, None, :], ids, shape=(T, N))
            assert same(M.linear(x, raw, qt, K, expert=True), want), (name, N, T, "expert")


def test_moe_mix_is_the_float32_chain_in_top_k_order():
    rng = np.random.default_rng(3)
    T, A, D, P = 5, 4, 24, 23
    y = rng.standard_normal((P, D)).astype(np.float32)
    slot_rows = rng.permutation(P)[:T * A].reshape(T, A).astype(np.int64)
    w = rng.random((T, A)).astype(np.float32)
    want = y[slot_rows[:, 0]] * w[:, :1]
    for a in range(1, A):
        want = want + y[slot_rows[:, a]] * w[:, a:a + 1]
    got = ops.moe_mix(y, slot_rows, w)
    assert same(got, want)
    # the order matters in float32: summing the slots the other way round differs somewhere
    rev = ops.moe_mix(y, slot_rows[:, ::-1].copy(), w[:, ::-1].copy())
    assert not same(rev, want)


def _route_with_numpy(logits, k, weight_softmax, norm_topk, scale):
    """The router's top-k and weights as numpy ops (the CPU backend's code before route_top_k)."""
    if weight_softmax:
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        w = ops.softmax_rows(np.take_along_axis(logits, ids, axis=1))
    else:
        probs = ops.softmax_rows(logits)
        ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, ids, axis=1)
    if norm_topk:
        total = w.astype(np.float64).sum(axis=1, keepdims=True).astype(np.float32)
        w = w / np.maximum(total, np.float32(6.103515625e-5))
    if scale:
        w = w * np.float32(scale)
    return ids, w.astype(np.float32)


@pytest.mark.parametrize("E,k", [(16, 4), (128, 8), (512, 10), (64, 16), (32, 3)])
@pytest.mark.parametrize("weight_softmax,norm_topk,scale", [(False, True, 0.0), (False, False, 2.5),
                                                            (True, False, 0.0), (False, True, 16.0)])
def test_route_top_k_is_the_numpy_routers_bits(E, k, weight_softmax, norm_topk, scale):
    """Wide logits (weights from 1 down to underflow), and rows of ties, where the lower index
    comes first (signed zeros tie)."""
    rng = np.random.default_rng(E + k)
    wide = (rng.standard_normal((40, E)) * rng.choice([0.5, 4, 30], (40, 1))).astype(np.float32)
    ties = np.round(rng.standard_normal((8, E)), 0).astype(np.float32)
    ties[0] = 0.0
    ties[1, ::2] = -0.0
    logits = np.concatenate([wide, ties])
    ids, w = ops.route_top_k(logits, k, weight_softmax, norm_topk, scale, np.zeros((0, 0), np.int64))
    want_ids, want_w = _route_with_numpy(logits, k, weight_softmax, norm_topk, scale)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(w.view(np.uint32), want_w.view(np.uint32))
