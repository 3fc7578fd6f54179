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
