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


def _row_kernel(k: int):
    from daemon.kernels.cuda.quantize import quantize_row_shared

    n_words, n_ds = k // 4, k // 16  # shared sizes: constants of the kernel

    @cuda.jit
    def kern(x, words, ds):
        # block r quantizes row r into shared memory, then copies it out
        sq = cuda.shared.array(n_words, np.uint32)
        sd = cuda.shared.array(n_ds, np.float32)
        quantize_row_shared(x, cuda.blockIdx.x, k, sq, sd, cuda.threadIdx.x, cuda.blockDim.x)
        for i in range(cuda.threadIdx.x, n_words, cuda.blockDim.x):
            words[cuda.blockIdx.x, i] = sq[i]
        for i in range(cuda.threadIdx.x, n_ds, cuda.blockDim.x):
            ds[cuda.blockIdx.x, i] = sd[i]

    return kern


def test_a_row_quantized_in_shared_memory_has_quantize_q8_1s_bits():
    """quantize_row_shared (the GEMVs' own quantization of a one-token row) against
    quantize_q8_1: the same quants, d and s, bit for bit. K = 160: a warp's 128-value span and
    a partial one (gpt-oss's K is 2880 = 22.5 spans); two warps, so spans alternate."""
    rng = np.random.default_rng(6)
    k = 160
    x = (rng.standard_normal((3, k)) * rng.uniform(0.01, 50, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block
    x[2, :32] = np.arange(32) - 15.5  # .5 ties
    x[2, 31] = 127.0
    x[0, 130] = -1e4  # one large value: the rest of its block rounds to small quants
    words = cuda.to_device(np.zeros((3, k // 4), np.uint32))
    ds = cuda.to_device(np.zeros((3, k // 16), np.float32))
    _row_kernel(k)[3, 64](cuda.to_device(x), words, ds)
    qs_ref, ds_ref = (a.copy_to_host() for a in quantize_q8_1(cuda.to_device(x)))
    np.testing.assert_array_equal(words.copy_to_host().view(np.int8).reshape(3, k), qs_ref)
    np.testing.assert_array_equal(ds.copy_to_host().reshape(3, k // 32, 2), ds_ref)
