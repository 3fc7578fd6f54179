"""The repacked weight layout (layout.py): planes hold the ggml fields, the repack is lossless,
and the device repack equals the host one."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from daemon.errors import UnsupportedError
from daemon.kernels import quants as Q
from daemon.kernels.cuda.layout import plane_offsets, repack, repack_device, repacked_stride, unpack
from tests.kernels.cuda import refs


@pytest.mark.parametrize("qt", refs.ALL, ids=[refs.NAMES[t] for t in refs.ALL])
def test_repack_round_trips_and_aligns(qt):
    rng = np.random.default_rng(qt)
    k = 512
    raw = refs.weights(qt, (2, 3), k, rng)  # an expert stack [S, N, rb]
    packed = repack(raw, qt)
    assert packed.shape == (2, 3, repacked_stride(qt, k)) and packed.shape[-1] % 16 == 0
    np.testing.assert_array_equal(unpack(packed, qt, k), raw)


def test_q8_0_planes_are_the_quants_then_the_scales():
    rng = np.random.default_rng(1)
    k = 64  # 2 blocks: 68 raw bytes, padded to 80
    raw = refs.weights(Q.Q8_0, (1,), k, rng)
    packed = repack(raw, Q.Q8_0)[0]
    blocks = raw[0].reshape(2, 34)
    assert plane_offsets(Q.Q8_0, k) == (0, 64)
    np.testing.assert_array_equal(packed[:64], blocks[:, 2:].reshape(-1))
    np.testing.assert_array_equal(packed[64:68], blocks[:, :2].reshape(-1))
    assert packed.size == 80 and not packed[68:].any()


def test_q6_k_planes():
    rng = np.random.default_rng(2)
    raw = refs.weights(Q.Q6_K, (1,), 512, rng)[0].reshape(2, 210)
    packed = repack(raw.reshape(1, -1), Q.Q6_K)[0]
    ql, qh, sc, d = plane_offsets(Q.Q6_K, 512)
    np.testing.assert_array_equal(packed[ql:qh], raw[:, :128].reshape(-1))
    np.testing.assert_array_equal(packed[qh:sc], raw[:, 128:192].reshape(-1))
    np.testing.assert_array_equal(packed[sc:d], raw[:, 192:208].reshape(-1))
    np.testing.assert_array_equal(packed[d:d + 4], raw[:, 208:].reshape(-1))


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.MXFP4, Q.Q5_K, Q.F16], ids=lambda t: refs.NAMES[t])
def test_device_repack_equals_host(qt):
    rng = np.random.default_rng(3)
    k = 256 if qt != Q.Q5_K else 512
    raw = refs.weights(qt, (3,), k, rng)
    out = cuda.to_device(np.zeros((3, repacked_stride(qt, k)), np.uint8))
    repack_device(cuda.to_device(raw), out, qt)
    np.testing.assert_array_equal(out.copy_to_host(), repack(raw, qt))


def test_unsupported_layouts_are_errors():
    with pytest.raises(UnsupportedError):
        repacked_stride(Q.Q8_K, 256)
    with pytest.raises(UnsupportedError):
        repacked_stride(Q.F16, 4)  # 8-byte rows cannot be read 16 bytes at a time
