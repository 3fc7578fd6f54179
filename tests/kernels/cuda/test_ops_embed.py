"""Device embedding (get_rows + dequantization) against gguf.quants.dequantize of the same rows."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gq
from numba import cuda

from daemon.errors import UnsupportedError
from daemon.kernels import quants as Q
from daemon.kernels.cuda.embed import embed
from tests.kernels.test_quants import random_blocks

ALL = sorted(Q.SUPPORTED_TYPES)


def _matrix(qt: int, V: int, D: int, rng) -> np.ndarray:
    """uint8 [V, RB] of finite random values of type qt."""
    if qt == Q.BF16:  # bf16 = the high half of f32 bits
        f = rng.standard_normal((V, D)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return random_blocks(qt, (V,), D, rng)


@pytest.mark.parametrize("qt", ALL, ids=[Q.type_name(t) for t in ALL])
def test_embed_matches_gguf_dequantize(qt):
    rng = np.random.default_rng(qt)
    V, D = 5, 256
    raw = _matrix(qt, V, D, rng)
    tokens = np.array([3, 0, 3, 4], np.int32)  # a repeated token, first and last rows
    out = cuda.to_device(np.full((tokens.size, D), np.nan, np.float32))  # poisoned: all must be written
    embed(cuda.to_device(raw), qt, cuda.to_device(tokens), out)
    got = out.copy_to_host()
    ref = gq.dequantize(raw, GGMLQuantizationType(qt)).reshape(V, D)[tokens]
    # Same float32 operations as the reference; the GPU may contract d*q + m into one FMA, one
    # rounding fewer: at most 1 ulp of the block's largest term, bounded by 2^-23 * max|row|.
    atol = 2.0 ** -22 * np.abs(ref).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - ref) <= atol), np.abs(got - ref).max()


def test_embed_refuses_wrong_row_size_and_type():
    out = cuda.device_array((1, 64), np.float32)
    tok = cuda.to_device(np.zeros(1, np.int32))
    with pytest.raises(ValueError):
        embed(cuda.to_device(np.zeros((2, 10), np.uint8)), Q.Q8_0, tok, out)
    with pytest.raises(UnsupportedError):
        embed(cuda.to_device(np.zeros((2, 64), np.uint8)), Q.Q8_K, tok, out)
