"""The inline-PTX intrinsics (on a GPU) or their simulator twins (in CI), against numpy."""

from __future__ import annotations

import numpy as np
from numba import cuda

import pytest

from daemon.kernels.cuda.ptx import (bits_to_f32, dp4a, f16_to_f32, ldg_u8, ldg_u16, ldg_u32,
                                     ldg_v4, mma_f16, mma_k16, mma_k32, pack_f16x2, prmt, round_f16, warp_max,
                                     warp_sum)


@cuda.jit
def _int_ops(a, b, c, sel, out):
    # one thread per element: a, b, c, sel int32/uint32 [n]; out int64 [n, 2]
    i = cuda.grid(1)
    if i < a.shape[0]:
        out[i, 0] = dp4a(a[i], b[i], c[i])
        out[i, 1] = prmt(a[i], b[i], sel[i])


def _bytes_i8(x):
    return np.asarray(x, dtype=np.uint32).view(np.uint8).reshape(-1, 4).view(np.int8)


def _prmt_ref(a, b, sel):
    src = np.array([a, b], np.uint32).view(np.uint8)  # bytes 0-3 of a, then 4-7 of b
    out = []
    for n in range(4):
        s = (int(sel) >> (4 * n)) & 0xF
        byte = int(src[s & 7])
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out.append(byte)
    return int(np.array(out, np.uint8).view(np.uint32)[0])


def test_dp4a_and_prmt_match_numpy():
    rng = np.random.default_rng(1)
    n = 64
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    c = rng.integers(-2**20, 2**20, n).astype(np.int32)
    sel = rng.integers(0, 2**16, n).astype(np.uint32)
    a[0], b[0] = 0x80808080, 0x80808080  # -128 * -128 four times
    out = np.zeros((n, 2), np.int64)
    _int_ops[2, 32](a.view(np.int32), b.view(np.int32), c, sel, out)
    want_dp = (_bytes_i8(a).astype(np.int64) * _bytes_i8(b)).sum(axis=1) + c
    np.testing.assert_array_equal(out[:, 0], want_dp)
    want_perm = [_prmt_ref(x, y, s) for x, y, s in zip(a, b, sel)]
    np.testing.assert_array_equal(out[:, 1] & 0xFFFFFFFF, want_perm)


@cuda.jit
def _loads(buf, offs, out):
    # buf: uint8 [bytes]; offs: int64 [n] (multiples of 16); out: uint32 [n, 8]
    i = cuda.grid(1)
    if i < offs.shape[0]:
        o = offs[i]
        w0, w1, w2, w3 = ldg_v4(buf, o)
        out[i, 0] = w0
        out[i, 1] = w1
        out[i, 2] = w2
        out[i, 3] = w3
        out[i, 4] = ldg_u32(buf, o + 4)
        out[i, 5] = ldg_u16(buf, o + 6)
        out[i, 6] = ldg_u8(buf, o + 13)
        out[i, 7] = ldg_v4(buf, o + 16)[3]


def test_loads_read_the_bytes_at_byte_offsets():
    rng = np.random.default_rng(2)
    buf = rng.integers(0, 256, 512, dtype=np.uint8)
    offs = np.array([0, 16, 64, 480, 240], np.int64)
    out = np.zeros((offs.size, 8), np.uint32)
    _loads[1, 32](cuda.to_device(buf), offs, out)
    words = buf.view(np.uint32)
    for i, o in enumerate(offs):
        np.testing.assert_array_equal(out[i, :4], words[o // 4:o // 4 + 4])
        assert out[i, 4] == words[o // 4 + 1]
        assert out[i, 5] == buf[o + 6:o + 8].view(np.uint16)[0]
        assert out[i, 6] == buf[o + 13]
        assert out[i, 7] == words[o // 4 + 7]


@cuda.jit
def _floats(h, u, x, out):
    # h: uint16 [n] half bits; u: uint32 [n] float bits; x: float32 [n]; out: float32 [n, 3]
    i = cuda.grid(1)
    if i < h.shape[0]:
        out[i, 0] = f16_to_f32(h[i])
        out[i, 1] = bits_to_f32(u[i])
        out[i, 2] = round_f16(x[i])


def test_float_conversions():
    rng = np.random.default_rng(3)
    n = 64
    h = rng.integers(0, 2**16, n, dtype=np.uint16)
    h[:4] = [0x0001, 0x7BFF, 0x8400, 0x3C00]  # subnormal, max, -2^-14, 1.0
    h[(h & 0x7C00) == 0x7C00] = 0x3555  # no inf/nan
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(np.float32)
    x[0] = np.float32(1 + 2.0**-11)  # a tie: rounds to even (1.0)
    u = x.view(np.uint32)
    out = np.zeros((n, 3), np.float32)
    _floats[2, 32](h, u, x, out)
    np.testing.assert_array_equal(out[:, 0], h.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(out[:, 1], x)
    np.testing.assert_array_equal(out[:, 2], x.astype(np.float16).astype(np.float32))


@cuda.jit
def _reduce(x, width, out):
    # x: float32 [n] (n = threads); out: float32 [n, 2] = (group sum, group max)
    i = cuda.grid(1)
    v = x[i]
    out[i, 0] = warp_sum(v, width)
    out[i, 1] = warp_max(v, width)


def test_warp_reductions_over_lane_groups():
    rng = np.random.default_rng(4)
    x = rng.integers(-100, 100, 64).astype(np.float32)  # integers: sums exact in any order
    for width in (32, 8):
        out = np.zeros((64, 2), np.float32)
        _reduce[1, 64](x, width, out)
        g = x.reshape(-1, width)
        np.testing.assert_array_equal(out[:, 0], np.repeat(g.sum(axis=1), width))
        np.testing.assert_array_equal(out[:, 1], np.repeat(g.max(axis=1), width))


@cuda.jit
def _mma(a, b, k32, out):
    # one warp per 16 x 8 tile: a uint32 [W, 16, K/4] (4 int8 of a row each), b uint32 [W, 8, K/4]
    # (4 int8 of a column each), out int32 [W, 16, 8]; K = 32 (k32) or 16
    w = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    if k32:
        c = mma_k32(a[w, g, t], a[w, g + 8, t], a[w, g, t + 4], a[w, g + 8, t + 4], b[w, g, t], b[w, g, t + 4])
    else:
        c = mma_k16(a[w, g, t], a[w, g + 8, t], b[w, g, t])
    out[w, g, 2 * t] = c[0]
    out[w, g, 2 * t + 1] = c[1]
    out[w, g + 8, 2 * t] = c[2]
    out[w, g + 8, 2 * t + 1] = c[3]


@pytest.mark.parametrize("k", [32, 16])
def test_tensor_core_mma_is_the_exact_int8_product(k):
    rng = np.random.default_rng(5)
    tiles = 3
    a = rng.integers(-128, 128, (tiles, 16, k), dtype=np.int64).astype(np.int8)
    b = rng.integers(-128, 128, (tiles, k, 8), dtype=np.int64).astype(np.int8)
    a[0], b[0] = -128, -128  # the largest sums: 32 * 16384 fits int32
    words_a = np.ascontiguousarray(a).view(np.uint32)  # [W, 16, K/4]: row-major k
    words_b = np.ascontiguousarray(b.transpose(0, 2, 1)).view(np.uint32)  # [W, 8, K/4]: k of a column
    out = np.zeros((tiles, 16, 8), np.int32)
    _mma[tiles, 32](words_a, words_b, k == 32, out)
    np.testing.assert_array_equal(out, np.einsum("wik,wkj->wij", a.astype(np.int64), b.astype(np.int64)))


@cuda.jit
def _mma_half(a, b, c, out):
    # one warp per 16 x 8 tile: a uint32 [W, 16, 8] (2 halves of a row each), b uint32 [W, 8, 8]
    # (2 halves of a column each), c, out f32 [W, 16, 8]
    w = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    d = mma_f16(a[w, g, t], a[w, g + 8, t], a[w, g, t + 4], a[w, g + 8, t + 4], b[w, g, t], b[w, g, t + 4],
                c[w, g, 2 * t], c[w, g, 2 * t + 1], c[w, g + 8, 2 * t], c[w, g + 8, 2 * t + 1])
    out[w, g, 2 * t] = d[0]
    out[w, g, 2 * t + 1] = d[1]
    out[w, g + 8, 2 * t] = d[2]
    out[w, g + 8, 2 * t + 1] = d[3]


def test_f16_tensor_core_mma_is_the_product_plus_c():
    rng = np.random.default_rng(6)
    tiles = 3
    a = rng.standard_normal((tiles, 16, 16)).astype(np.float16)
    b = rng.standard_normal((tiles, 16, 8)).astype(np.float16)
    c = rng.standard_normal((tiles, 16, 8)).astype(np.float32)
    out = np.zeros((tiles, 16, 8), np.float32)
    words_a = np.ascontiguousarray(a).view(np.uint32)  # [W, 16, 8]: row-major k
    words_b = np.ascontiguousarray(b.transpose(0, 2, 1)).view(np.uint32)  # [W, 8, 8]: k of a column
    _mma_half[tiles, 32](words_a, words_b, c, out)
    want = np.einsum("wik,wkj->wij", a.astype(np.float64), b.astype(np.float64)) + c
    # 16 exact products summed in float32 (the GPU's order): a few ulp of sums of magnitude ~10
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)


@cuda.jit
def _pack(x, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = pack_f16x2(x[2 * i], x[2 * i + 1])


def test_pack_f16x2_rounds_each_half_to_nearest_even():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(64) * 100).astype(np.float32)
    x[:4] = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 70000.0, -0.0]  # ties (down, up), overflow to inf, signed zero
    out = np.zeros(32, np.uint32)
    _pack[1, 32](x, out)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
