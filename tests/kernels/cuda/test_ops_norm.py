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


@pytest.mark.parametrize("fused", ["rms_norm", "add_rms_norm", "add_rms_norm_bias"])
@pytest.mark.parametrize("D", [64, 96, 2880 // 10])
def test_a_norm_writing_q8_1_gives_quantize_q8_1s_bits(fused, D):
    """The q8_1 blocks a norm makes are quantize_q8_1 of its output, bit for bit, and the output
    is the one it gives without them. D 96 and 288 leave a warp of spare threads (a block of 32 or
    64 threads holds 8 values each); rows of very different scales give blocks of every size."""
    from daemon.kernels.cuda.quantize import quantize_q8_1

    rng = np.random.default_rng(D)
    T = 3
    x, delta = (rng.standard_normal((2, T, D)) * np.array([[1e-3], [1.0], [40.0]])).astype(np.float32)
    x[1, :32] = 0.0  # a block of zeros: d = 0, quants 0
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    outs = []
    for q8 in (None, (cuda.device_array((T, D), np.int8), cuda.device_array((T, D // 32, 2), np.float32))):
        out = cuda.to_device(np.full((T, D), np.nan, np.float32))
        dx, dw = cuda.to_device(x), cuda.to_device(w)
        if fused == "rms_norm":
            rms_norm(dx, dw, EPS, out, q8=q8)
        else:
            add_rms_norm(dx, cuda.to_device(delta), dw, EPS, out, q8=q8,
                         bias=cuda.to_device(b) if fused.endswith("bias") else None)
        outs.append((out.copy_to_host(), q8))
    (plain, _), (with_q8, (qs, ds)) = outs
    np.testing.assert_array_equal(with_q8.view(np.uint32), plain.view(np.uint32))
    ref_qs, ref_ds = quantize_q8_1(cuda.to_device(plain))
    np.testing.assert_array_equal(qs.copy_to_host(), ref_qs.copy_to_host())
    np.testing.assert_array_equal(ds.copy_to_host().view(np.uint32), ref_ds.copy_to_host().view(np.uint32))


def test_q8_1_blocks_are_checked():
    x = cuda.device_array((2, 64), np.float32)
    w = cuda.device_array(64, np.float32)
    with pytest.raises(ValueError, match="q8_1"):
        rms_norm(x, w, EPS, x, q8=(cuda.device_array((2, 32), np.int8), cuda.device_array((2, 1, 2), np.float32)))
    with pytest.raises(ValueError, match="rows"):
        rms_norm(cuda.device_array((2, 2, 32), np.float32), cuda.device_array(32, np.float32), EPS,
                 cuda.device_array((2, 2, 32), np.float32), q8=(None, None))
