"""Device RoPE (NORM/NEOX, linear scaling, YaRN, freq_factors, partial rotary) against float64 numpy."""

import math

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda.rope import apply_rope_qk, rope_cache

POSITIONS = np.array([0, 1, 5, 77, 300], np.int32)


def _ref_angles(pos, n_dims, base, freq_scale, ext_factor, corr, ff):
    """theta [T, P] in float64, ggml rope_yarn's mix; mscale."""
    P = n_dims // 2
    i = np.arange(P)
    extrap = pos[:, None].astype(np.float64) * base ** (-2.0 * i / n_dims) / ff
    interp = freq_scale * extrap
    theta = interp
    if ext_factor:
        y = (i - corr[0]) / max(0.001, corr[1] - corr[0])
        mix = (1 - np.clip(y, 0, 1)) * ext_factor
        theta = interp * (1 - mix) + extrap * mix
    return theta


def _ref_rotate(x, theta, mscale, n_dims, neox):
    x = x.astype(np.float64).copy()
    P = n_dims // 2
    c = (np.cos(theta) * mscale)[:, None, :]  # [T, 1, P]
    s = (np.sin(theta) * mscale)[:, None, :]
    a, b = (np.arange(P), np.arange(P) + P) if neox else (np.arange(0, n_dims, 2), np.arange(1, n_dims, 2))
    x0, x1 = x[..., a].copy(), x[..., b].copy()
    x[..., a] = x0 * c - x1 * s
    x[..., b] = x0 * s + x1 * c
    return x


CASES = {
    "norm": dict(neox=False, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, corr=(0.0, 0.0), ff=False),
    "neox-linear": dict(neox=True, freq_scale=0.5, ext_factor=0.0, attn_factor=1.0, corr=(0.0, 0.0), ff=False),
    "neox-yarn-ff": dict(neox=True, freq_scale=0.25, ext_factor=1.0, attn_factor=0.9, corr=(1.0, 4.0), ff=True),
    "norm-yarn": dict(neox=False, freq_scale=0.125, ext_factor=1.0, attn_factor=1.0, corr=(2.0, 3.0), ff=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rope(case):
    c = CASES[case]
    rng = np.random.default_rng(len(case))
    T, H, Hkv, Dh, n_dims, base = POSITIONS.size, 3, 1, 16, 12, 10000.0  # dims 12..15 pass through
    q = rng.standard_normal((T, H, Dh)).astype(np.float32)
    k = rng.standard_normal((T, Hkv, Dh)).astype(np.float32)
    ff = rng.uniform(1.0, 4.0, n_dims // 2).astype(np.float32) if c["ff"] else np.ones(n_dims // 2)
    cache = cuda.to_device(np.full((T, n_dims // 2, 2), np.nan, np.float32))
    rope_cache(cuda.to_device(POSITIONS), n_dims, base, c["freq_scale"], c["ext_factor"], c["attn_factor"],
               c["corr"], cache, freq_factors=cuda.to_device(ff) if c["ff"] else None)
    dq, dk = cuda.to_device(q), cuda.to_device(k)
    apply_rope_qk(dq, dk, cache, c["neox"])
    theta = _ref_angles(POSITIONS, n_dims, base, c["freq_scale"], c["ext_factor"], c["corr"], ff)
    mscale = c["attn_factor"] * (1 + 0.1 * math.log(1 / c["freq_scale"]) if c["ext_factor"] else 1)
    # float32 angles up to 300 rad are off by ~|theta| * 2^-22 (powf, the position product, the
    # YaRN mix), which moves cos/sin by as much; then a few roundings of the rotation.
    tol = 300 * 2.0 ** -21 + 2.0 ** -20
    for got, x in ((dq, q), (dk, k)):
        ref = _ref_rotate(x, theta, mscale, n_dims, c["neox"])
        np.testing.assert_allclose(got.copy_to_host(), ref, rtol=0, atol=tol * 2 * np.abs(x).max())
        assert np.array_equal(got.copy_to_host()[..., n_dims:], x[..., n_dims:])  # untouched


def test_shapes_are_checked():
    pos = cuda.to_device(POSITIONS)
    with pytest.raises(ValueError):
        rope_cache(pos, 12, 1e4, 1.0, 0.0, 1.0, (0.0, 0.0), cuda.device_array((5, 5, 2), np.float32))
    q = cuda.device_array((5, 2, 8), np.float32)
    with pytest.raises(ValueError):
        apply_rope_qk(q, cuda.device_array((5, 1, 6), np.float32), cuda.device_array((5, 4, 2), np.float32), True)


@pytest.mark.parametrize("normed", [False, True])
def test_norm_rope_qk_with_append_stores_what_kv_append_stores(normed):
    """The rotation's launch also storing k and v in the cache: the same q, k and cache bits as
    norm_rope_qk and then attention.kv_append (partial rotary: dims past n_dims stored as they are)."""
    from daemon.kernels.cuda.attention import kv_append, new_kv_cache
    from daemon.kernels.cuda.rope import norm_rope_qk

    rng = np.random.default_rng(8)
    T, H, Hkv, Dh, Dv, n_dims = 3, 4, 2, 16, 12, 12
    slots, positions = np.array([1, 0, 1], np.int32), np.array([0, 9, 21], np.int32)
    q, k = (rng.standard_normal((T, n, Dh)).astype(np.float32) for n in (H, Hkv))
    v = rng.standard_normal((T, Hkv, Dv)).astype(np.float32)
    wq, wk = (cuda.to_device(rng.uniform(0.5, 1.5, Dh).astype(np.float32)) if normed else None for _ in range(2))
    table = cuda.device_array((T, n_dims // 2, 2), np.float32)
    rope_cache(cuda.to_device(positions), n_dims, 10000.0, 1.0, 0.0, 1.0, (0.0, 0.0), table)
    ds, dp, dv = cuda.to_device(slots), cuda.to_device(positions), cuda.to_device(v)
    results = []
    for fused in (False, True):
        dq, dk = cuda.to_device(q), cuda.to_device(k)
        kc, vc = new_kv_cache(2, Hkv, 32, Dh, Dv)
        if fused:
            norm_rope_qk(dq, dk, table, True, wq, wk, 1e-6, append=(dv, ds, dp, kc, vc))
        else:
            norm_rope_qk(dq, dk, table, True, wq, wk, 1e-6)
            kv_append(dk, dv, ds, dp, kc, vc)
        results.append([a.copy_to_host() for a in (dq, dk, kc, vc)])
    for got, want in zip(results[1], results[0]):
        assert np.array_equal(got, want)
    assert results[1][2].any() and results[1][3].any()  # the cells were written
