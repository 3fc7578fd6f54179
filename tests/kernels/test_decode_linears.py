"""kernels/decode_linears.py: up to four projections of one row in one call give the bits of
separate one-row calls (matmul.linear_prepared), for each quantized family; the CPU backend's
`linears` takes it for a one-row step and keeps the separate calls otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.backend.cpu import CPUBackend
from daemon.kernels import decode_linears
from daemon.kernels import quants as Q
from daemon.kernels.matmul import linear_prepared, prepare
from tests.backend import reference as R

K = 512


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_1, Q.MXFP4, Q.Q4_K, Q.Q6_K], ids=Q.type_name)
@pytest.mark.parametrize("n_out", [(64, 32, 32), (96, 8), (16, 24, 40, 8)], ids=["qkv", "two", "four"])
def test_one_call_gives_the_separate_calls_bits(qt, n_out):
    rng = np.random.default_rng(qt + len(n_out))
    raws = [R.raw_weights(qt, (n,), K, rng) for n in n_out]
    x = rng.standard_normal((1, K)).astype(np.float32)
    if qt not in R.QUANTIZABLE:
        x *= np.float32(0.02)
    xp = prepare(x, qt)
    got = decode_linears.linears(xp, raws, qt)
    for g, raw in zip(got, raws):
        np.testing.assert_array_equal(g, linear_prepared(xp, raw, qt, K))


def test_the_backend_fuses_only_one_quantized_row_of_one_type():
    from daemon.model.weights import QWeight

    rng = np.random.default_rng(0)
    ws = [QWeight(R.raw_weights(Q.Q8_0, (n,), K, rng), Q.Q8_0, K, n) for n in (32, 16)]
    biases = [rng.standard_normal(32).astype(np.float32), None]
    cpu = CPUBackend()
    for T in (1, 3):
        x = rng.standard_normal((T, K)).astype(np.float32)
        got = cpu.linears(x, ws, None, biases)
        want = [cpu.linear(x, w, None, b) for w, b in zip(ws, biases)]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert decode_linears.supports([Q.Q8_0] * 3, [K] * 3)
    assert not decode_linears.supports([Q.Q8_0, Q.Q4_K], [K, K])  # types differ
    assert not decode_linears.supports([Q.F16] * 3, [K] * 3)  # float weights: tinyBLAS paths
    assert not decode_linears.supports([Q.Q8_0] * 5, [K] * 5)
