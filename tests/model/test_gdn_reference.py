"""The numpy Gated DeltaNet reference: the chunked prefill (CS = 64) equals T single steps up
to f32 rounding, and splitting a prefill changes nothing in the token-by-token form that
llama.cpp's CPU runs (docs/qwen3next.md, step 8)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.model.gdn_reference import chunked, conv_step, random_inputs, recurrent


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_chunked_prefill_equals_single_steps(T):
    q, k, v, g, beta, M = random_inputs(T)
    o_seq, M_seq = recurrent(q, k, v, g, beta, M)
    o_ch, M_ch = chunked(q, k, v, g, beta, M)
    # order effects only (measured: 1e-7 to 7e-7 of the max here): q scaled before vs after
    # the dot, exp of cumulative-sum differences vs products of per-token exps, the solve
    np.testing.assert_allclose(o_ch, o_seq, rtol=0, atol=1e-5 * np.abs(o_seq).max())
    np.testing.assert_allclose(M_ch, M_seq, rtol=0, atol=1e-5 * np.abs(M_seq).max())


def test_split_prefill_is_bit_identical_in_the_recurrent_form():
    q, k, v, g, beta, M = random_inputs(40, seed=3)
    o_all, M_all = recurrent(q, k, v, g, beta, M)
    o1, M1 = recurrent(q[:17], k[:17], v[:17], g[:17], beta[:17], M)
    o2, M2 = recurrent(q[17:], k[17:], v[17:], g[17:], beta[17:], M1)
    assert np.array_equal(np.concatenate([o1, o2]), o_all) and np.array_equal(M2, M_all)


def test_split_prefill_in_the_chunked_form_differs_only_by_rounding():
    """Chunk boundaries move when a prefill is split (17 + 83 vs 64 + 36): not bit-equal."""
    q, k, v, g, beta, M = random_inputs(100, seed=4)
    o_all, M_all = chunked(q, k, v, g, beta, M)
    o1, M1 = chunked(q[:17], k[:17], v[:17], g[:17], beta[:17], M)
    o2, M2 = chunked(q[17:], k[17:], v[17:], g[17:], beta[17:], M1)
    np.testing.assert_allclose(np.concatenate([o1, o2]), o_all, rtol=0, atol=1e-5 * np.abs(o_all).max())
    np.testing.assert_allclose(M2, M_all, rtol=0, atol=1e-5 * np.abs(M_all).max())


def test_conv_prefill_equals_decode_steps():
    r = np.random.default_rng(5)
    C, Kc, T = 24, 4, 10
    x = r.standard_normal((T, C)).astype(np.float32)
    w = r.standard_normal((C, Kc)).astype(np.float32)
    state0 = np.zeros((C, Kc - 1), np.float32)
    out_all, st_all = conv_step(x, state0, w)
    st, rows = state0, []
    for t in range(T):
        o, st = conv_step(x[t : t + 1], st, w)
        rows.append(o)
    assert np.array_equal(np.concatenate(rows), out_all) and np.array_equal(st, st_all)
    assert np.array_equal(st_all, x[-(Kc - 1) :].T)  # the state is the last Kc-1 inputs
    # causal: the first output only sees x[0] (through the last tap)
    np.testing.assert_allclose(out_all[0], x[0] * w[:, -1], rtol=1e-6)
