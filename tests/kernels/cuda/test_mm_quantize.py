"""q8_1 activation quantization on the device against a numpy reference of llama.cpp's definition
(quantize.cu: d = amax/127, q = roundf(x/d), s = sum(x), d and s stored as fp16)."""

from __future__ import annotations

import numpy as np
from numba import cuda

from daemon.kernels.cuda.quantize import quantize_q8_1
from tests.kernels.cuda.refs import q8_1 as q8_1_reference


def test_q8_1_matches_the_reference():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 96)) * rng.uniform(0.01, 50, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, :32] = np.arange(32) - 15.5  # values with |x/d| on .5 ties
    x[2, 31] = 127.0  # amax 127 -> d = 1: x = 0.5, -0.5, 1.5 ... round away from zero
    qs, ds = quantize_q8_1(cuda.to_device(x))
    qs, ds = qs.copy_to_host(), ds.copy_to_host()
    q, d, s = q8_1_reference(x)
    np.testing.assert_array_equal(qs, q)
    np.testing.assert_array_equal(ds[..., 0], d)
    np.testing.assert_array_equal(qs[2, 15:17], [-1, 1])  # -0.5 -> -1, 0.5 -> 1
    # s: the device sums in float32 in a butterfly order; rounded to fp16 it may land one half
    # ulp away from the float64 sum's rounding.
    ulp = np.spacing(np.abs(s).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(ds[..., 1] - s) <= ulp)
    assert ds[1, 1, 0] == 0 and not qs[1, 32:64].any()
