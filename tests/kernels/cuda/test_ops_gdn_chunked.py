"""The chunked gated delta rule (daemon/kernels/cuda/gdn_chunked.py) against a float64 run of the
token-by-token recurrence: two sequences of different lengths in one call (several chunks and a
partial last one; one shorter than a chunk) from random states, both head layouts, spare value
rows; a sequence's bits the same alone as beside another; and gdn.gated_delta_net sending each
sequence to its form by its own rows. Tiny shapes: these run under numba's CUDA simulator in CI.

Tolerance: rtol = atol = 1e-4 on values of order 1. The chunked form is the recurrence
reassociated (products of decays become exps of sums, a triangular solve replaces the row
chain): f32 rounding of another order, which grows with the chunk (CH^2 terms) where the
recurrence's grows with the rows. Measured max abs error against float64 on these shapes: ~1e-7
under the simulator (which computes partly in f64). A wrong index, term or decay moves values by
> 1e-2."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda import gdn, gdn_chunked
from tests.kernels.cuda.test_ops_gdn import EPS, _dev, _offsets, inputs, l2, softplus

RTOL = ATOL = 1e-4


def ref64(qkv, b, a, dt_bias, ssm_a, M, Hk, Dk, tiled, eps):
    """One sequence's rows in float64: qkv [T, C], b, a [T, Hv], M [Hv, Dv, Dk] -> (o, M)."""
    T = qkv.shape[0]
    Hv, Dv = M.shape[0], M.shape[1]
    Kd = Hk * Dk
    kh = np.arange(Hv) % Hk if tiled else np.arange(Hv) // (Hv // Hk)
    q = l2(qkv[:, :Kd].reshape(T, Hk, Dk), eps)[:, kh]  # [T, Hv, Dk]
    k = l2(qkv[:, Kd:2 * Kd].reshape(T, Hk, Dk), eps)[:, kh]
    v = qkv[:, 2 * Kd:].reshape(T, Hv, Dv).astype(np.float64)
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    decay = np.exp(softplus(a.astype(np.float64) + dt_bias) * ssm_a)
    M = M.astype(np.float64).copy()
    o = np.empty((T, Hv, Dv))
    for t in range(T):
        M *= decay[t][:, None, None]
        delta = (v[t] - np.einsum("hji,hi->hj", M, k[t])) * beta[t][:, None]
        M += delta[:, :, None] * k[t][:, None, :]
        o[t] = np.einsum("hji,hi->hj", M, q[t]) / np.sqrt(Dv)
    return o, M


# (Hk, Hv, Dk, Dv, tiled): grouped and tiled heads; Dk = 40 and Dv = 5 (spare value rows in the
# last carry block, keys not a multiple of the threads)
SHAPES = {
    "grouped": (2, 4, 16, 8, False),
    "tiled": (2, 4, 16, 8, True),
    "odd": (1, 1, 40, 5, False),
}


def _call(fn, shape, counts, seq_slots, st0, data, layer=1, **kw):
    """fn (a gated_delta_net) over sequences of `counts` rows in `seq_slots` -> (out, state)."""
    Hk, Hv, Dk, Dv, tiled = shape
    qkv, b, a, dt_bias, ssm_a = data
    T = sum(counts)
    state = cuda.to_device(st0)
    out = cuda.to_device(np.full((T, Hv, Dv), np.nan, np.float32))
    slots = np.repeat(seq_slots, counts).astype(np.int32)
    fn(*_dev(qkv, b, a, dt_bias, ssm_a), state, layer, *_dev(slots, _offsets(counts)), len(counts), Hk, Dk, tiled,
       EPS, out, **kw)
    return out.copy_to_host(), state.copy_to_host()


def _data(rng, shape, T):
    Hk, Hv, Dk, Dv, _ = shape
    return inputs(rng, T, Hk, Hv, Dk, Dv)


def _states(rng, shape, SL=3, NR=2):
    Hk, Hv, Dk, Dv, _ = shape
    return (0.3 * rng.standard_normal((SL, NR, Hv, Dv, Dk))).astype(np.float32)


@pytest.mark.parametrize("chunk", [4, 8])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_chunked_matches_the_float64_recurrence(shape, chunk):
    """Sequences of 2.75 chunks and of fewer rows than a chunk, in slots 2 and 0 of layer 1 of 2,
    from random states: outputs and states within tolerance of float64; slot 1 and layer 0 not
    touched."""
    Hk, Hv, Dk, Dv, tiled = SHAPES[shape]
    rng = np.random.default_rng(chunk + len(shape))
    counts, seq_slots, layer = [2 * chunk + 3 * chunk // 4, 3], [2, 0], 1
    data = _data(rng, SHAPES[shape], sum(counts))
    st0 = _states(rng, SHAPES[shape])
    got, got_state = _call(gdn_chunked.gated_delta_net, SHAPES[shape], counts, seq_slots, st0, data, layer,
                           chunk=chunk)
    o = _offsets(counts)
    qkv, b, a, dt_bias, ssm_a = data
    for s, slot in enumerate(seq_slots):
        r = slice(o[s], o[s + 1])
        want, want_state = ref64(qkv[r], b[r], a[r], dt_bias, ssm_a, st0[slot, layer], Hk, Dk, tiled, EPS)
        np.testing.assert_allclose(got[r], want, rtol=RTOL, atol=ATOL, err_msg=f"sequence {s}")
        np.testing.assert_allclose(got_state[slot, layer], want_state, rtol=RTOL, atol=ATOL, err_msg=f"state {s}")
    assert np.array_equal(got_state[1], st0[1]) and np.array_equal(got_state[:, 0], st0[:, 0])


def test_a_sequence_gets_the_same_bits_alone():
    """Each sequence of a two-sequence call (3 and 9 rows, chunks of 4) the same bits as in a
    call of its own."""
    shape = SHAPES["grouped"]
    rng = np.random.default_rng(11)
    counts, seq_slots = [3, 9], [0, 2]
    data = _data(rng, shape, sum(counts))
    st0 = _states(rng, shape)
    both, both_state = _call(gdn_chunked.gated_delta_net, shape, counts, seq_slots, st0, data, chunk=4)
    o = _offsets(counts)
    for s, slot in enumerate(seq_slots):
        r = slice(o[s], o[s + 1])
        alone, alone_state = _call(gdn_chunked.gated_delta_net, shape, [counts[s]], [slot], st0,
                                   [x[r] if x.ndim == 2 else x for x in data], chunk=4)
        assert np.array_equal(alone, both[r]) and np.array_equal(alone_state[slot], both_state[slot])


def test_each_sequence_takes_its_form_by_its_own_rows():
    """gdn.gated_delta_net with the row counts: a sequence of MIN_ROWS rows the chunked form's
    bits, one of MIN_ROWS - 1 the sequential kernel's, in one call."""
    shape = SHAPES["odd"]
    rng = np.random.default_rng(12)
    n = gdn_chunked.MIN_ROWS
    counts, seq_slots = [n - 1, n], [1, 2]
    data = _data(rng, shape, sum(counts))
    st0 = _states(rng, shape)
    mixed, mixed_state = _call(gdn.gated_delta_net, shape, counts, seq_slots, st0, data, rows=np.array(counts))
    chunked, chunked_state = _call(gdn_chunked.gated_delta_net, shape, counts, seq_slots, st0, data)
    plain, plain_state = _call(gdn.gated_delta_net, shape, counts, seq_slots, st0, data)
    o = _offsets(counts)
    for s, slot in enumerate(seq_slots):
        r = slice(o[s], o[s + 1])
        want, want_state = (chunked, chunked_state) if counts[s] >= n else (plain, plain_state)
        assert np.array_equal(mixed[r], want[r]) and np.array_equal(mixed_state[slot], want_state[slot]), s
    assert not np.array_equal(chunked[o[1]:], plain[o[1]:])  # the two forms differ in their bits


def test_min_rows_leaves_the_shorter_sequences_alone():
    """min_rows: a sequence of fewer rows keeps its state and its output rows."""
    shape = SHAPES["grouped"]
    rng = np.random.default_rng(13)
    counts, seq_slots = [5, 2], [0, 1]
    data = _data(rng, shape, sum(counts))
    st0 = _states(rng, shape)
    got, got_state = _call(gdn_chunked.gated_delta_net, shape, counts, seq_slots, st0, data, min_rows=3,
                           chunks=gdn_chunked.n_chunks(counts, 4, 3), chunk=4)
    assert np.isnan(got[5:]).all() and np.array_equal(got_state[1], st0[1])
    assert np.isfinite(got[:5]).all() and not np.array_equal(got_state[0, 1], st0[0, 1])
