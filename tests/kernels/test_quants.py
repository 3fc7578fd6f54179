"""Block formats: dequantize must equal gguf.quants.dequantize bit for bit."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from daemon.errors import UnsupportedError
from daemon.kernels import quants as Q

ALL = sorted(Q.SUPPORTED_TYPES)
NAMES = {t: Q.type_name(t) for t in ALL}

# byte offsets of the fp16 scale fields (d, dmin/m) inside one block
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2),
              Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qt: int, shape: tuple[int, ...], k: int, rng) -> np.ndarray:
    """uint8 [*shape, row_bytes]: random bytes with the fp16 scales set to small finite values
    (random fp16 bit patterns would be inf/nan now and then); MXFP4 exponents in a range that
    neither overflows nor is all denormal, plus the e8m0 edge codes 0, 1, 2."""
    qk, bb = GGML_QUANT_SIZES[GGMLQuantizationType(qt)]
    if qt == Q.F32:
        return rng.standard_normal(shape + (k,)).astype(np.float32).view(np.uint8)
    if qt == Q.F16:
        return rng.standard_normal(shape + (k,)).astype(np.float16).view(np.uint8)
    raw = rng.integers(0, 256, size=shape + (k // qk, bb), dtype=np.uint8)
    for o in F16_FIELDS.get(qt, ()):
        v = rng.uniform(1e-3, 1e-1, raw.shape[:-1]).astype(np.float16)
        raw[..., o:o + 2] = v.view(np.uint8).reshape(raw.shape[:-1] + (2,))
    if qt == Q.MXFP4:
        e = rng.integers(100, 140, raw.shape[:-1], dtype=np.uint8)
        e.reshape(-1)[:3] = [0, 1, 2]
        raw[..., 0] = e
    return raw.reshape(shape + (k // qk * bb,))


@pytest.mark.parametrize("qt", ALL, ids=[NAMES[t] for t in ALL])
def test_dequantize_random_blocks_equals_gguf(qt):
    rng = np.random.default_rng(qt)
    raw = random_blocks(qt, (2, 3), 512, rng)  # leading dims [2, 3]
    got = Q.dequantize(raw, qt)
    ref = gq.dequantize(raw, GGMLQuantizationType(qt))
    assert got.dtype == np.float32 and got.shape == (2, 3, 512)
    assert np.array_equal(got, ref, equal_nan=True)


GGUF_QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4, Q.BF16, Q.F16, Q.F32]


@pytest.mark.parametrize("qt", GGUF_QUANTIZABLE, ids=[NAMES[t] for t in GGUF_QUANTIZABLE])
def test_dequantize_quantized_weights_equals_gguf(qt):
    rng = np.random.default_rng(100 + qt)
    w = (rng.standard_normal((5, 256)) * 0.05).astype(np.float32)
    raw = np.ascontiguousarray(gq.quantize(w, GGMLQuantizationType(qt))).view(np.uint8).reshape(5, -1)
    got = Q.dequantize(raw, qt, 256)
    assert np.array_equal(got, gq.dequantize(raw, GGMLQuantizationType(qt)))
    assert np.abs(got - w).max() < 0.05  # and it is a real approximation of w


def test_dequantize_one_row_and_readonly_view():
    rng = np.random.default_rng(7)
    raw = random_blocks(Q.Q4_K, (4,), 256, rng)
    ro = raw.view()
    ro.flags.writeable = False  # as an mmapped file is
    got = Q.dequantize(ro[1], Q.Q4_K)
    assert got.shape == (256,)
    assert np.array_equal(got, gq.dequantize(raw[1], GGMLQuantizationType.Q4_K))
    stacked = raw.reshape(2, 2, -1)  # [E, N, row_bytes]: an expert slice is a plain 2-D view
    assert np.array_equal(Q.dequantize(stacked[1], Q.Q4_K), Q.dequantize(raw[2:], Q.Q4_K))


def test_row_bytes_and_errors():
    assert Q.row_bytes(Q.Q8_0, 64) == 68
    assert Q.row_bytes(Q.Q4_K, 512) == 288
    assert Q.row_bytes(Q.MXFP4, 32) == 17
    assert Q.row_bytes(Q.F16, 3) == 6
    assert Q.row_bytes(Q.BF16, 5) == 10
    with pytest.raises(UnsupportedError):
        Q.row_bytes(Q.Q4_K, 128)  # not whole super-blocks
    with pytest.raises(UnsupportedError):
        Q.row_bytes(int(GGMLQuantizationType.Q2_K), 256)
    with pytest.raises(UnsupportedError):
        Q.row_bytes(12345, 256)
    with pytest.raises(UnsupportedError):
        Q.dequantize(np.zeros((1, 84), np.uint8), int(GGMLQuantizationType.Q2_K))
    with pytest.raises(UnsupportedError):
        Q.dequantize(np.zeros((1, 35), np.uint8), Q.Q8_0)  # ragged row
    with pytest.raises(ValueError):
        Q.dequantize(np.zeros((1, 34), np.uint8), Q.Q8_0, n_values=64)
    with pytest.raises(TypeError):
        Q.dequantize(np.zeros((1, 34), np.int8), Q.Q8_0)


def test_supported_types():
    names = {Q.type_name(t) for t in Q.SUPPORTED_TYPES}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"} <= names


def test_fp16_conversions_exhaustive():
    import numba

    @numba.njit
    def to_f32(h, out):
        for i in range(h.shape[0]):
            out[i] = Q.f16_to_f32(h[i])

    @numba.njit
    def to_f16(x, out):
        for i in range(x.shape[0]):
            out[i] = Q.f32_to_f16_bits(x[i])

    h = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, np.float32)
    to_f32(h, got)
    ref = h.view(np.float16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32)[~np.isnan(ref)], ref.view(np.uint32)[~np.isnan(ref)])
    assert np.isnan(got[np.isnan(ref)]).all()

    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    # plus every fp16 value and the midpoints between neighbours (ties to even)
    h32 = ref[np.isfinite(ref)].astype(np.float32)
    mids = ((h32[:-1].astype(np.float64) + h32[1:]) / 2).astype(np.float32)
    x = np.concatenate([bits.view(np.float32), h32, mids, np.float32([65520.0, 65519.99, 6e-8, 2.98e-8])])
    out = np.empty(x.shape[0], np.int64)
    to_f16(x, out)
    with np.errstate(over="ignore"):
        ref16 = x.astype(np.float16)
    ok = ~np.isnan(x)
    assert np.array_equal(out[ok].astype(np.uint16), ref16[ok].view(np.uint16))
    assert np.isnan(out[~ok].astype(np.uint16).view(np.float16)).all()
