"""Device RMSNorm (rows, per head, fused residual add) against float64 numpy."""

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda.norm import add_rms_norm, rms_norm

EPS = 1e-5
# float32 sums of squares over <= 100 values and a few roundings per output: relative error a few
# 1e-7; 2e-6 leaves room and is far below any real mistake (a wrong mean moves outputs by > 1e-2).
RTOL = 2e-6


def _ref(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS) * w.astype(np.float64)


@pytest.mark.parametrize("shape", [(3, 96), (2, 3, 16)], ids=["rows", "per-head"])
def test_rms_norm(shape):
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    out = cuda.to_device(np.full(shape, np.nan, np.float32))
    rms_norm(cuda.to_device(x), cuda.to_device(w), EPS, out)
    np.testing.assert_allclose(out.copy_to_host(), _ref(x, w), rtol=RTOL, atol=1e-7)


def test_rms_norm_in_place():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 40)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 40).astype(np.float32)
    dx = cuda.to_device(x)
    rms_norm(dx, cuda.to_device(w), EPS, dx)
    np.testing.assert_allclose(dx.copy_to_host(), _ref(x, w), rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("with_bias", [False, True])
def test_add_rms_norm(with_bias):
    rng = np.random.default_rng(7)
    T, D = 3, 200
    x, delta = (rng.standard_normal((2, T, D)) * 2).astype(np.float32)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    dx = cuda.to_device(x)
    out = cuda.to_device(np.full((T, D), np.nan, np.float32))
    add_rms_norm(dx, cuda.to_device(delta), cuda.to_device(w), EPS, out,
                 bias=cuda.to_device(b) if with_bias else None)
    x_new = x.astype(np.float64) + delta + (b if with_bias else 0)
    np.testing.assert_allclose(dx.copy_to_host(), x_new, rtol=1e-6, atol=1e-6)  # two f32 adds
    np.testing.assert_allclose(out.copy_to_host(), _ref(x_new, w), rtol=RTOL, atol=1e-6)


def test_shapes_are_checked():
    x = cuda.device_array((2, 8), np.float32)
    with pytest.raises(ValueError):
        rms_norm(x, cuda.device_array(6, np.float32), EPS, x)
    with pytest.raises(ValueError):
        add_rms_norm(x, cuda.device_array((2, 4), np.float32), cuda.device_array(8, np.float32), EPS, x)


@pytest.mark.parametrize("with_shared,split", [(False, False), (True, False), (True, True)])
def test_mix_add_rms_norm_gives_the_separate_kernels_bits(with_shared, split):
    """The MoE mix, the shared expert's add, the residual add and the norm in one launch: the bits
    of glu.moe_mix, glu.add and add_rms_norm one after another. split: several blocks a row, the
    last to finish normalising it; its tickets are back at zero after."""
    from daemon.kernels.cuda.glu import add, moe_mix
    from daemon.kernels.cuda.norm import mix_add_rms_norm

    rng = np.random.default_rng(11)
    T, A, D = 3, 4, 600  # 600: 128 threads holding up to 5 values each, 5 blocks a row when split
    y = rng.standard_normal((T * A, D)).astype(np.float32)
    wts = rng.uniform(0.05, 1.0, (T, A)).astype(np.float32)
    x, shared = (rng.standard_normal((2, T, D)) * 2).astype(np.float32)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    dy, dw, dx, dn = (cuda.to_device(a) for a in (y, wts, x, w))
    ds = cuda.to_device(shared) if with_shared else None
    mixed = cuda.device_array((T, D), np.float32)
    moe_mix(dy, dw, mixed)
    if with_shared:
        add(mixed, ds, mixed)
    want_x = cuda.device_array((T, D), np.float32)
    want = cuda.device_array((T, D), np.float32)
    add_rms_norm(dx, mixed, dn, EPS, want, x_out=want_x)
    got_x = cuda.to_device(np.full((T, D), np.nan, np.float32))
    got = cuda.to_device(np.full((T, D), np.nan, np.float32))
    tickets = cuda.to_device(np.zeros(T, np.int32)) if split else None
    mix_add_rms_norm(dy, dw, dx, dn, EPS, got, got_x, shared=ds, tickets=tickets)
    if split:
        assert not tickets.copy_to_host().any()
    assert np.array_equal(got_x.copy_to_host(), want_x.copy_to_host())
    assert np.array_equal(got.copy_to_host(), want.copy_to_host())
    x_new = x + (wts[:, :, None].astype(np.float64) * y.reshape(T, A, D)).sum(1) + (shared if with_shared else 0)
    np.testing.assert_allclose(got.copy_to_host(), _ref(x_new, w), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        mix_add_rms_norm(dy, dw, dx, dn, EPS, got, cuda.device_array((T, D + 1), np.float32))
