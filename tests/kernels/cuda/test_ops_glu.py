"""Device GLU variants, MoE combine, shared-expert gate and add against float64 numpy."""

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda.glu import add, glu, moe_mix, sigmoid_gate

# A handful of float32 roundings and one expf (<= 2 ulp) per value: relative error < 1e-6;
# RTOL leaves a margin, ATOL covers values that cancel to ~0.
RTOL, ATOL = 4e-6, 1e-6


def _silu_ref(g, u):
    g = g.astype(np.float64)
    return g / (1 + np.exp(-g)) * u


def _oai_ref(g, u, alpha, limit):
    x = np.minimum(g.astype(np.float64), limit)
    y = np.clip(u.astype(np.float64), -limit, limit)
    return x / (1 + np.exp(-alpha * x)) * (y + 1)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the simulator's float64 exp
def test_swiglu():
    rng = np.random.default_rng(0)
    g, u = (rng.standard_normal((2, 5, 37)) * 4).astype(np.float32)
    g[0, :3] = [-100.0, 100.0, 0.0]  # exp overflow -> silu = -0; large positive; zero
    out = cuda.to_device(np.full(g.shape, np.nan, np.float32))
    glu(cuda.to_device(g), cuda.to_device(u), out, "silu")
    np.testing.assert_allclose(out.copy_to_host(), _silu_ref(g, u), rtol=RTOL, atol=ATOL)


def test_swiglu_oai_with_expert_biases():
    rng = np.random.default_rng(1)
    T, A, E, F = 2, 3, 6, 20
    g, u = (rng.standard_normal((2, T * A, F)) * 6).astype(np.float32)  # beyond the clamp at 7
    gb, ub = rng.standard_normal((2, E, F)).astype(np.float32)
    ids = np.array([[5, 0, 2], [2, 4, 5]], np.int32)
    out = cuda.to_device(np.full(g.shape, np.nan, np.float32))
    glu(cuda.to_device(g), cuda.to_device(u), out, "oai", 1.702, 7.0, gate_bias=cuda.to_device(gb),
        up_bias=cuda.to_device(ub), ids=cuda.to_device(ids.reshape(-1)))
    flat = ids.reshape(-1)
    ref = _oai_ref(g + gb[flat].astype(np.float64), u + ub[flat].astype(np.float64), 1.702, 7.0)
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("variant", ["plain", "rows+bias"])
def test_moe_mix(variant):
    rng = np.random.default_rng(2)
    T, A, E, D = 3, 4, 7, 33
    y = rng.standard_normal((T * A, D)).astype(np.float32)
    w = rng.uniform(0, 1, (T, A)).astype(np.float32)
    ids = rng.integers(0, E, (T, A)).astype(np.int32)
    bias = rng.standard_normal((E, D)).astype(np.float32)
    out = cuda.to_device(np.full((T, D), np.nan, np.float32))
    if variant == "plain":
        moe_mix(cuda.to_device(y), cuda.to_device(w), out)
        rows, b = np.arange(T * A).reshape(T, A), np.zeros((T, A, D))
    else:  # y's rows in another order (grouped by expert), plus the down projection's biases
        rows = rng.permutation(T * A).reshape(T, A).astype(np.int32)
        moe_mix(cuda.to_device(y), cuda.to_device(w), out, rows=cuda.to_device(rows), down_bias=cuda.to_device(bias),
                ids=cuda.to_device(ids))
        b = bias[ids].astype(np.float64)
    ref = ((y[rows].astype(np.float64) + b) * w[..., None]).sum(axis=1)
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("accumulate", [False, True])
def test_sigmoid_gate(accumulate):
    rng = np.random.default_rng(3)
    y = rng.standard_normal((3, 50)).astype(np.float32)
    z = (rng.standard_normal((3, 1)) * 3).astype(np.float32)
    prev = rng.standard_normal((3, 50)).astype(np.float32)
    out = cuda.to_device(prev)
    sigmoid_gate(cuda.to_device(y), cuda.to_device(z), out, accumulate=accumulate)
    ref = y / (1 + np.exp(-z.astype(np.float64))) + (prev if accumulate else 0)
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=RTOL, atol=ATOL)


def test_add():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((2, 4, 30)).astype(np.float32)
    out = cuda.to_device(a)
    add(out, cuda.to_device(b), out)
    np.testing.assert_allclose(out.copy_to_host(), a.astype(np.float64) + b, rtol=1e-7, atol=1e-7)


def test_shapes_are_checked():
    x = cuda.device_array((2, 4), np.float32)
    with pytest.raises(ValueError):
        glu(x, cuda.device_array((2, 5), np.float32), x)
    with pytest.raises(ValueError):
        glu(x, x, x, "oai", gate_bias=cuda.device_array((3, 4), np.float32))
    with pytest.raises(ValueError):
        moe_mix(x, cuda.device_array((3, 2), np.float32), cuda.device_array((2, 4), np.float32))
