"""Device Gated DeltaNet kernels (daemon/kernels/cuda/gdn.py) against the numpy reference
tests/model/gdn_reference.py: the conv with its rolling state and the fused recurrence over
several sequences of different lengths in one call, decode calls carrying the state on, and the
small elementwise ops. Tiny shapes: these run under numba's CUDA simulator in CI.

Tolerances: the device computes in f32 with its own expf/logf and butterfly sums (the
simulator in f64 where Python floats creep in), the reference in f32 with numpy's sums, so
values agree to a few f32 roundings per op; the recurrence compounds them over the rows of a
call. rtol = atol = 1e-5 on values of order 1 (the state's entries and outputs are O(0.1..1)
here) holds with a margin of ~10x and catches any wrong index or term (those move values by
> 1e-2)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda import gdn
from daemon.kernels.cuda.device import SIM
from tests.model.gdn_reference import conv_step, recurrent

RTOL = ATOL = 1e-5
EPS = 1e-6


# -- references --------------------------------------------------------------------------------


def l2(x, eps):
    """ggml_scale(ggml_rms_norm(x, eps/D), 1/sqrt(D)) over the last axis, in f64."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps / d) / np.sqrt(d)


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def ref_gdn(qkv, b, a, dt_bias, ssm_a, M, Hk, Dk, tiled, eps):
    """One sequence's rows: qkv [T, C], b, a [T, Hv], M [Hv, Dv, Dk] -> (o [T, Hv, Dv], M)."""
    T = qkv.shape[0]
    Hv, Dv = M.shape[0], M.shape[1]
    Kd = Hk * Dk
    q = l2(qkv[:, :Kd].reshape(T, Hk, Dk), eps)
    k = l2(qkv[:, Kd:2 * Kd].reshape(T, Hk, Dk), eps)
    v = qkv[:, 2 * Kd:].reshape(T, Hv, Dv)
    kh = np.arange(Hv) % Hk if tiled else np.arange(Hv) // (Hv // Hk)
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    g = softplus(a.astype(np.float64) + dt_bias) * ssm_a
    f32 = np.float32
    return recurrent(q[:, kh].astype(f32), k[:, kh].astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32), M)


def inputs(rng, T, Hk, Hv, Dk, Dv):
    C = 2 * Hk * Dk + Hv * Dv
    qkv = rng.standard_normal((T, C)).astype(np.float32)
    b = rng.standard_normal((T, Hv)).astype(np.float32)
    a = (rng.standard_normal((T, Hv)) - 1).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    ssm_a = -rng.uniform(0.2, 3.0, Hv).astype(np.float32)
    return qkv, b, a, dt_bias, ssm_a


def _dev(*xs):
    return [cuda.to_device(np.ascontiguousarray(x)) for x in xs]


def _offsets(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


# -- conv ------------------------------------------------------------------------------------


@pytest.mark.parametrize("Kc", [4, 2, 1])
def test_conv_silu_batched_sequences_then_decode(Kc):
    """Three sequences of 1, 5 and 2 rows in one call (fewer rows than Kc-1 in one: the new
    state takes old entries), in slots 2, 0, 3 of layer 1 of 2, then a decode call of all three;
    the other slots and layer are untouched."""
    rng = np.random.default_rng(Kc)
    C, SL, NR, layer = 24, 4, 2, 1
    counts = [1, 5, 2]
    seq_slots = [2, 0, 3]
    w = rng.standard_normal((C, Kc)).astype(np.float32)
    st0 = rng.standard_normal((SL, NR, C, Kc - 1)).astype(np.float32)
    x = rng.standard_normal((sum(counts), C)).astype(np.float32)
    state = cuda.to_device(st0)
    out = cuda.to_device(np.full(x.shape, np.nan, np.float32))
    slots = np.repeat(seq_slots, counts).astype(np.int32)
    gdn.conv_silu(*_dev(x, w), state, layer, *_dev(slots, _offsets(counts)), 3, out)
    want_state = st0.copy()
    want = np.empty_like(x)
    offs = _offsets(counts)
    for s, slot in enumerate(seq_slots):
        y, want_state[slot, layer] = conv_step(x[offs[s]:offs[s + 1]], st0[slot, layer], w)
        want[offs[s]:offs[s + 1]] = y / (1 + np.exp(-y.astype(np.float64)))
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(state.copy_to_host(), want_state)  # exact copies of inputs

    xd = rng.standard_normal((3, C)).astype(np.float32)  # decode: one row each, no offsets
    out1 = cuda.to_device(np.full(xd.shape, np.nan, np.float32))
    gdn.conv_silu(*_dev(xd, w), state, layer, *_dev(np.array(seq_slots, np.int32)), None, 3, out1)
    after = want_state.copy()
    for s, slot in enumerate(seq_slots):
        y, after[slot, layer] = conv_step(xd[s:s + 1], want_state[slot, layer], w)
        np.testing.assert_allclose(out1.copy_to_host()[s], (y / (1 + np.exp(-y.astype(np.float64))))[0],
                                   rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(state.copy_to_host(), after)


def test_conv_silu_prefill_gives_its_rows_one_at_a_time_bits():
    """Sequences of 2 rows (fewer than Kc-1 = 3) and 6 in one call (a thread per row and channel,
    the state moved on by a second launch) against the same rows one call each (a row's window
    all in the state): outputs and states the same bits."""
    rng = np.random.default_rng(8)
    C, Kc, counts = 12, 4, [2, 6]
    w = rng.standard_normal((C, Kc)).astype(np.float32)
    st0 = rng.standard_normal((2, 1, C, Kc - 1)).astype(np.float32)
    x = rng.standard_normal((sum(counts), C)).astype(np.float32)
    slots = np.repeat([1, 0], counts).astype(np.int32)
    state = cuda.to_device(st0)
    out = cuda.device_array(x.shape, np.float32)
    gdn.conv_silu(*_dev(x, w), state, 0, *_dev(slots, _offsets(counts)), 2, out)
    one = cuda.to_device(st0)
    rows = []
    for t in range(x.shape[0]):
        o1 = cuda.device_array((1, C), np.float32)
        gdn.conv_silu(*_dev(x[t:t + 1], w), one, 0, *_dev(slots[t:t + 1]), None, 1, o1)
        rows.append(o1.copy_to_host())
    assert np.array_equal(out.copy_to_host(), np.concatenate(rows))
    assert np.array_equal(state.copy_to_host(), one.copy_to_host())


# -- the gated delta rule --------------------------------------------------------------------

# (Hk, Hv, Dk, Dv, tiled): lane groups of 16 (two value rows a warp); the real LW = 32 with 4
# keys a lane (Dk = 128); 2 keys a lane with masked lanes (Dk = 40) and spare value rows (Dv = 5)
SHAPES = {
    "grouped": (2, 4, 16, 8, False),
    "tiled": (2, 4, 16, 8, True),
    "dk128": (1, 2, 128, 4, False),
    "masked": (1, 1, 40, 5, False),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_gated_delta_net_batched_prefill_then_decode(shape):
    """Sequences of 3, 1 and 2 rows in one call from random states in slots 1, 3, 0 (layer 0 of
    2), then two decode calls (state carried): outputs and states match the reference run row
    by row; other slots and layers stay as they were."""
    Hk, Hv, Dk, Dv, tiled = SHAPES[shape]
    rng = np.random.default_rng(len(shape))
    SL, NR, layer = 4, 2, 0
    counts = [3, 1, 2] if shape in ("grouped", "tiled") else [2, 1]
    seq_slots = [1, 3, 0][:len(counts)]
    S = len(counts)
    st0 = (0.3 * rng.standard_normal((SL, NR, Hv, Dv, Dk))).astype(np.float32)
    state = cuda.to_device(st0)
    want_state = st0.copy()

    def call(counts):
        T = sum(counts)
        qkv, b, a, dt_bias, ssm_a = inputs(rng, T, Hk, Hv, Dk, Dv)
        if call.params is None:
            call.params = dt_bias, ssm_a
        dt_bias, ssm_a = call.params
        out = cuda.to_device(np.full((T, Hv, Dv), np.nan, np.float32))
        slots = np.repeat(seq_slots, counts).astype(np.int32)
        offs = None if T == S else cuda.to_device(_offsets(counts))
        gdn.gated_delta_net(*_dev(qkv, b, a, dt_bias, ssm_a), state, layer, cuda.to_device(slots), offs, S, Hk, Dk,
                            tiled, EPS, out)
        got = out.copy_to_host()
        o = _offsets(counts)
        for s, slot in enumerate(seq_slots):
            r = slice(o[s], o[s + 1])
            want, want_state[slot, layer] = ref_gdn(qkv[r], b[r], a[r], dt_bias, ssm_a, want_state[slot, layer], Hk,
                                                     Dk, tiled, EPS)
            np.testing.assert_allclose(got[r], want, rtol=RTOL, atol=ATOL, err_msg=f"sequence {s}")
        np.testing.assert_allclose(state.copy_to_host(), want_state, rtol=RTOL, atol=ATOL)

    call.params = None
    call(counts)
    call([1] * S)
    call([1] * S)


def test_gated_delta_net_from_zero_state_matches_a_prefill_split_in_decodes():
    """One sequence: a prefill of 4 rows equals 4 decode calls (same kernel, same row loop: the
    same bits)."""
    Hk, Hv, Dk, Dv = 1, 2, 16, 8
    rng = np.random.default_rng(9)
    qkv, b, a, dt_bias, ssm_a = inputs(rng, 4, Hk, Hv, Dk, Dv)
    params = _dev(dt_bias, ssm_a)
    outs = []
    for split in (False, True):
        state = cuda.to_device(np.zeros((1, 1, Hv, Dv, Dk), np.float32))
        rows = [slice(t, t + 1) for t in range(4)] if split else [slice(0, 4)]
        got = []
        for r in rows:
            T = r.stop - r.start
            out = cuda.device_array((T, Hv, Dv), np.float32)
            gdn.gated_delta_net(*_dev(qkv[r], b[r], a[r]), *params, state, 0, cuda.to_device(np.zeros(T, np.int32)),
                                cuda.to_device(np.array([0, T], np.int32)) if T > 1 else None, 1, Hk, Dk, False, EPS,
                                out)
            got.append(out.copy_to_host())
        outs.append((np.concatenate(got), state.copy_to_host()))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    want, _ = ref_gdn(qkv, b, a, dt_bias, ssm_a, np.zeros((Hv, Dv, Dk), np.float32), Hk, Dk, False, EPS)
    np.testing.assert_allclose(outs[0][0], want, rtol=RTOL, atol=ATOL)


def test_softplus_cutoff_and_shapes_are_checked():
    """a + dt_bias > 20 takes softplus(x) = x (no exp overflow); bad shapes are ValueErrors."""
    Hk, Hv, Dk, Dv = 1, 1, 8, 2
    rng = np.random.default_rng(3)
    qkv, b, a, dt_bias, ssm_a = inputs(rng, 1, Hk, Hv, Dk, Dv)
    a[:] = 30.0
    ssm_a[:] = -0.01
    M = np.ones((1, 1, Hv, Dv, Dk), np.float32)
    state = cuda.to_device(M)
    out = cuda.device_array((1, Hv, Dv), np.float32)
    slots = cuda.to_device(np.zeros(1, np.int32))
    gdn.gated_delta_net(*_dev(qkv, b, a, dt_bias, ssm_a), state, 0, slots, None, 1, Hk, Dk, False, EPS, out)
    want, _ = ref_gdn(qkv, b, a, dt_bias, ssm_a, M[0, 0], Hk, Dk, False, EPS)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError):
        gdn.gated_delta_net(*_dev(qkv, b, a, dt_bias, ssm_a), state, 0, slots, None, 1, Hk, Dk + 1, False, EPS, out)
    with pytest.raises(ValueError):  # two sequences of one row each need two rows
        gdn.conv_silu(*_dev(qkv, np.zeros((qkv.shape[1], 4), np.float32)),
                      cuda.to_device(np.zeros((1, 1, qkv.shape[1], 3), np.float32)), 0, slots, None, 2,
                      cuda.device_array(qkv.shape, np.float32))


# -- gated RMSNorm, sigmoid_mul, split_heads -------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the simulator's exp of -z
def test_gated_rms_norm():
    rng = np.random.default_rng(4)
    T, H, D = 3, 2, 20
    x = (rng.standard_normal((T, H, D)) * 2).astype(np.float32)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    z = (rng.standard_normal((T, H * D)) * 3).astype(np.float32)
    z[0, 0] = -100.0  # silu -> -0
    out = cuda.to_device(np.full((T, H * D), np.nan, np.float32))
    gdn.gated_rms_norm(*_dev(x, w, z), EPS, out)
    xd = x.astype(np.float64)
    normed = (xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + EPS) * w).reshape(T, H * D)
    want = normed * (z / (1 + np.exp(-z.astype(np.float64))))
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("per_row", [False, True])
def test_sigmoid_mul(per_row):
    rng = np.random.default_rng(5)
    T, N = 3, 37
    y = rng.standard_normal((T, N)).astype(np.float32)
    z = (rng.standard_normal((T, 1 if per_row else N)) * 4).astype(np.float32)
    out = cuda.to_device(np.full((T, N), np.nan, np.float32))
    gdn.sigmoid_mul(*_dev(y, z), out)
    np.testing.assert_allclose(out.copy_to_host(), y / (1 + np.exp(-z.astype(np.float64))), rtol=4e-6, atol=1e-7)


@pytest.mark.parametrize("H,P,d", [(3, 2, 4), (2, 2, 1), (1, 3, 5)])
def test_split_heads(H, P, d):
    T = 2
    x = np.arange(T * H * P * d, dtype=np.float32).reshape(T, H * P * d)
    out = cuda.to_device(np.full((P, T, H, d), np.nan, np.float32))
    gdn.split_heads(cuda.to_device(x), out)
    want = x.reshape(T, H, P, d).transpose(2, 0, 1, 3)
    np.testing.assert_array_equal(out.copy_to_host(), want)


@pytest.mark.parametrize("tiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    SIM, reason="the grouped case covers the kernel under the simulator (20 s each there)"))], ids=["grouped", "tiled"])
def test_fused_decode_gives_the_three_launches_bits(tiled):
    """decode_step (conv, delta rule and gated norm in one launch) against conv_silu,
    gated_delta_net and gated_rms_norm one after another, over two decode steps from random
    states (slots 2 and 0, layer 1 of 2): the outputs and both states the same bits, other slots
    and layers untouched, the tickets back at zero."""
    Hk, Hv, Dk, Dv, Kc = 2, 4, 16, 8, 4
    rng = np.random.default_rng(31 + tiled)
    SL, NR, layer, slots = 3, 2, 1, np.array([2, 0], np.int32)
    S, C = len(slots), 2 * Hk * Dk + Hv * Dv
    conv0 = rng.standard_normal((SL, NR, C, Kc - 1)).astype(np.float32)
    st0 = (0.3 * rng.standard_normal((SL, NR, Hv, Dv, Dk))).astype(np.float32)
    w = rng.standard_normal((C, Kc)).astype(np.float32) * 0.5
    norm_w = rng.uniform(0.5, 1.5, Dv).astype(np.float32)
    _, _, _, dt_bias, ssm_a = inputs(rng, 1, Hk, Hv, Dk, Dv)
    dw, dn, ddt, dsa, dslots = _dev(w, norm_w, dt_bias, ssm_a, slots)
    runs = []
    for fused in (False, True):
        conv, state = _dev(conv0, st0)
        tickets = cuda.to_device(np.zeros((SL, Hk + Hv), np.int32))
        outs = []
        step_rng = np.random.default_rng(5)
        for _ in range(2):
            x, b, a, _, _ = inputs(step_rng, S, Hk, Hv, Dk, Dv)
            z = step_rng.standard_normal((S, Hv * Dv)).astype(np.float32)
            dx, db, da, dz = _dev(x, b, a, z)
            out = cuda.to_device(np.full((S, Hv * Dv), np.nan, np.float32))
            o = cuda.to_device(np.full((S, Hv, Dv), np.nan, np.float32))
            if fused:
                gdn.decode_step(dx, dw, conv, db, da, ddt, dsa, state, layer, dslots, Hk, Dk, tiled, EPS, dn, dz, o,
                                out, tickets)
                assert not tickets.copy_to_host().any()
            else:
                c = cuda.device_array((S, C), np.float32)
                gdn.conv_silu(dx, dw, conv, layer, dslots, None, S, c)
                gdn.gated_delta_net(c, db, da, ddt, dsa, state, layer, dslots, None, S, Hk, Dk, tiled, EPS, o)
                gdn.gated_rms_norm(o, dn, dz, EPS, out)
            outs.append(out.copy_to_host())
        runs.append((outs, conv.copy_to_host(), state.copy_to_host()))
    (want, want_conv, want_state), (got, got_conv, got_state) = runs
    assert np.isfinite(want[0]).all() and np.isfinite(want[1]).all()
    for g, wv in zip(got, want):
        assert np.array_equal(g, wv)
    assert np.array_equal(got_conv, want_conv) and np.array_equal(got_state, want_state)
    assert np.array_equal(got_conv[1], conv0[1]) and np.array_equal(got_state[:, 0], st0[:, 0])  # untouched
    assert not np.array_equal(got_state[2, 1], st0[2, 1])  # the steps moved the states on
