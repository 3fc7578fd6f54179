"""GEMV kernels (mmvq.py): dense, per-expert (ids) and fused gate+up+GLU, for every weight type,
against float64 references (refs.py) on tiny shapes (CI runs them under the simulator)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from daemon.kernels import quants as Q
from daemon.kernels.cuda import grouping, mmvq
from daemon.kernels.cuda.layout import repack
from daemon.kernels.cuda.mmvq import Q8
from daemon.kernels.cuda.quantize import quantize_q8_1
from tests.kernels.cuda import refs

# float32 products and sums: each rounding is <= 2**-24 relative, and a dot of K <= 512 terms
# accumulates at most ~K of them, so |err| <= 512 * 6e-8 * sum|w x| ~ 3e-5 * sum|w x|. A wrong
# decode of even one value in 512 is ~1e-3 of that scale.
RTOL = 3e-5


def _k(qt: int) -> int:
    return 512 if qt in refs.QK_K_TYPES else 256


def _act(qt: int, x: np.ndarray):
    """Device activations for weights of type qt, and the reference's view of them."""
    if qt in refs.FLOAT:
        return cuda.to_device(x), None
    q, d, s = refs.q8_1(x)
    ds = np.stack([d, s], axis=-1).astype(np.float32)
    return Q8(cuda.to_device(q), cuda.to_device(ds)), (q, d, s)


def _close(got, want, scale):
    assert np.all(np.isfinite(got))
    err = np.abs(got - want)
    assert np.all(err <= RTOL * scale + 1e-30), f"max err/scale {np.max(err / scale):.3g}"


@pytest.mark.parametrize("qt", refs.ALL, ids=[refs.NAMES[t] for t in refs.ALL])
def test_dense_matches_reference(qt):
    rng = np.random.default_rng(10 + qt)
    k, n, t = _k(qt), 5, 3  # 5 rows: the last row group is partly empty
    raw = refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((t, k)).astype(np.float32)
    act, ref_act = _act(qt, x)
    out = cuda.to_device(np.full((t, n), np.nan, np.float32))
    mmvq.mul_mat_vec(cuda.to_device(repack(raw, qt)), qt, k, act, out=out)
    _close(out.copy_to_host(), refs.matvec(raw, qt, x, ref_act), refs.magnitude(raw, qt, x))


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K, Q.MXFP4, Q.F16], ids=lambda t: refs.NAMES[t])
@pytest.mark.parametrize("lpr,unroll", [(4, 2), (4, 1), (4, 4), (16, 2), (32, 2)])
def test_dense_lanes_per_row(qt, lpr, unroll):
    """Several chunks per lane (lpr 4, each unroll path) and idle lanes (lpr 16 or 32 over fewer
    chunks); 1 token; a bias."""
    rng = np.random.default_rng(20 + qt)
    k, n = _k(qt), 3
    raw = refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    act, ref_act = _act(qt, x)
    got = mmvq.mul_mat_vec(cuda.to_device(repack(raw, qt)), qt, k, act,
                           bias=cuda.to_device(bias),
                           tuning=mmvq.Tuning(lpr=lpr, unroll=unroll)).copy_to_host()
    _close(got, refs.matvec(raw, qt, x, ref_act) + bias, refs.magnitude(raw, qt, x) + np.abs(bias))


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.MXFP4, Q.F16], ids=lambda t: refs.NAMES[t])
def test_unroll_is_a_shape_not_a_change_of_bits(qt):
    """7 chunks a lane (one round of 4, one of 2, one alone at unroll 4): the loads in flight
    change with `unroll`, each sum's order does not, so 1, 2 and 4 give the same bits, for one
    column and for three, plain and with gate + up fused."""
    rng = np.random.default_rng(30 + qt)
    lpr = 4
    k, n = 7 * lpr * mmvq.VALUES[qt], 3
    gate, up = (cuda.to_device(repack(refs.weights(qt, (n,), k, rng), qt)) for _ in range(2))
    x = rng.standard_normal((3, k)).astype(np.float32)
    for t in (1, 3):
        act, _ = _act(qt, x[:t])
        outs = {}
        for unroll in (1, 2, 4):
            tuning = mmvq.Tuning(lpr=lpr, unroll=unroll)
            outs[unroll] = (mmvq.mul_mat_vec(gate, qt, k, act, tuning=tuning).copy_to_host(),
                            mmvq.mul_mat_vec_glu(gate, up, qt, k, act, tuning=tuning).copy_to_host())
        for unroll in (2, 4):
            for got, want in zip(outs[unroll], outs[1]):
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qt", [Q.Q5_1, Q.BF16], ids=lambda t: refs.NAMES[t])
def test_dense_more_than_16_tokens_runs_in_tiles(qt):
    rng = np.random.default_rng(80 + qt)
    k, n, t = 256, 2, 19  # a tile of 16 and a tile of 3
    raw = refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((t, k)).astype(np.float32)
    act, ref_act = _act(qt, x)
    got = mmvq.mul_mat_vec(cuda.to_device(repack(raw, qt)), qt, k, act).copy_to_host()
    _close(got, refs.matvec(raw, qt, x, ref_act), refs.magnitude(raw, qt, x))


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K, Q.MXFP4, Q.F16], ids=lambda t: refs.NAMES[t])
def test_a_token_gives_its_bits_alone_in_any_tile(qt):
    """Batch invariance: a token's row is the same bits in a tile of 16, in the last tile of 2
    (whose 14 spare columns repeat its last token, not stored), and alone."""
    rng = np.random.default_rng(90 + qt)
    k, n, t = _k(qt), 3, 18
    w = cuda.to_device(repack(refs.weights(qt, (n,), k, rng), qt))
    x = rng.standard_normal((t, k)).astype(np.float32)
    tile = mmvq.mul_mat_vec(w, qt, k, _act(qt, x)[0]).copy_to_host()
    for r in (0, 9, 16, 17):
        alone = mmvq.mul_mat_vec(w, qt, k, _act(qt, x[r:r + 1])[0]).copy_to_host()
        np.testing.assert_array_equal(alone[0].view(np.uint32), tile[r].view(np.uint32))


def test_dense_takes_device_quantized_activations():
    rng = np.random.default_rng(30)
    qt, k, n = Q.Q4_K, 512, 4
    raw = refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((2, k)).astype(np.float32)
    qs, ds = quantize_q8_1(cuda.to_device(x))
    got = mmvq.mul_mat_vec(cuda.to_device(repack(raw, qt)), qt, k, Q8(qs, ds)).copy_to_host()
    _close(got, refs.matvec(raw, qt, x), refs.magnitude(raw, qt, x))


def _experts(qt, rng, n=3, s=3, e=5):
    k = _k(qt)
    raw = refs.weights(qt, (s, n), k, rng)  # [S, N, rb]
    slot_of = np.array([2, -1, 0, 1, -1], np.int32)[:e]  # experts 0, 2, 3 loaded
    return k, raw, slot_of


@pytest.mark.parametrize("per_pair", [False, True], ids=["per_token", "per_pair"])
@pytest.mark.parametrize("qt", refs.ALL, ids=[refs.NAMES[t] for t in refs.ALL])
def test_experts_one_launch_per_projection(qt, per_pair):
    """per_pair: down-projection style, one activation row per (token, expert) pair."""
    rng = np.random.default_rng(40 + qt)
    k, raw, slot_of = _experts(qt, rng)
    ids = np.array([[3, 0], [2, 3], [0, 2]], np.int32)  # [T, A]; tokens share experts
    T, A = ids.shape
    x = rng.standard_normal((T * A if per_pair else T, k)).astype(np.float32)
    bias = rng.standard_normal((5, raw.shape[1])).astype(np.float32)  # [E, N]
    act, ref_act = _act(qt, x)
    got = mmvq.mul_mat_vec_ids(cuda.to_device(repack(raw, qt)), qt, k, act, cuda.to_device(ids),
                               cuda.to_device(slot_of), bias=cuda.to_device(bias),
                               act_per_pair=per_pair).copy_to_host()
    assert got.shape == (T, A, raw.shape[1])
    for t in range(T):
        for a in range(A):
            row = t * A + a if per_pair else t
            w = raw[slot_of[ids[t, a]]]
            sub = None if ref_act is None else tuple(v[row:row + 1] for v in ref_act)
            want = refs.matvec(w, qt, x[row:row + 1], sub)[0] + bias[ids[t, a]]
            scale = refs.magnitude(w, qt, x[row:row + 1])[0] + np.abs(bias[ids[t, a]])
            _close(got[t, a], want, scale)


def test_experts_not_held_are_not_written():
    rng = np.random.default_rng(50)
    qt = Q.Q8_0
    k, raw, slot_of = _experts(qt, rng)
    ids = np.array([[0, 1]], np.int32)  # expert 1 has no slot
    x = rng.standard_normal((1, k)).astype(np.float32)
    act, _ = _act(qt, x)
    out = cuda.to_device(np.full((1, 2, raw.shape[1]), 7.0, np.float32))  # expert 1's pair stays as it was
    got = mmvq.mul_mat_vec_ids(cuda.to_device(repack(raw, qt)), qt, k, act, cuda.to_device(ids),
                               cuda.to_device(slot_of), out=out).copy_to_host()
    assert np.all(np.isfinite(got[0, 0])) and (got[0, 0] != 7.0).any() and np.all(got[0, 1] == 7.0)


# every token chooses expert 0 (runs of 4 and 3 at 4 columns), 3 and 2 are shared, 1 and 4 are
# not held (slot -1, their pairs left as they were)
_SHARED_IDS = np.array([[0, 3], [2, 0], [0, 1], [3, 0], [0, 2], [4, 0], [0, 3]], np.int32)


@pytest.mark.parametrize("qt,proj,cols", [(qt, proj, 4) for qt in (Q.Q8_0, Q.Q4_K, Q.MXFP4, Q.F16)
                                           for proj in ("glu", "per_token", "per_pair")]
                         + [(Q.Q8_0, "glu", 2), (Q.Q4_K, "per_pair", 16)],
                         ids=lambda v: refs.NAMES.get(v, str(v)) if isinstance(v, int) else v)
def test_grouped_experts_give_each_pair_its_own_bits(qt, proj, cols):
    """Batch invariance: read once for a run of its pairs, an expert gives every pair the bits
    of the one-pair launch; experts not held stay unwritten."""
    rng = np.random.default_rng(100 + qt)
    k, raw, slot_of = _experts(qt, rng)
    ids = _SHARED_IDS
    T, A = ids.shape
    x = rng.standard_normal((T * A if proj == "per_pair" else T, k)).astype(np.float32)
    act, _ = _act(qt, x)
    d_ids, d_slots = cuda.to_device(ids), cuda.to_device(slot_of)
    w = cuda.to_device(repack(raw, qt))
    groups = grouping.group_by_expert(d_ids, len(slot_of))
    tuning = mmvq.Tuning(group_cols=cols)
    outs = []
    for g in (None, groups):
        out = cuda.to_device(np.full((T, A, raw.shape[1]), 7.0, np.float32))
        if proj == "glu":
            up = cuda.to_device(repack(refs.weights(qt, raw.shape[:2], k, np.random.default_rng(1)), qt))
            mmvq.mul_mat_vec_glu_ids(w, up, qt, k, act, d_ids, d_slots, "swiglu_oai", out=out,
                                     groups=g, tuning=tuning)
        else:
            mmvq.mul_mat_vec_ids(w, qt, k, act, d_ids, d_slots, out=out, groups=g,
                                 act_per_pair=proj == "per_pair", tuning=tuning)
        outs.append(out.copy_to_host())
    alone, grouped = outs
    np.testing.assert_array_equal(grouped.view(np.uint32), alone.view(np.uint32))
    held = slot_of[ids] >= 0
    assert np.all(grouped[~held] == 7.0) and np.all(grouped[held] != 7.0)


@pytest.mark.parametrize("qt,glu", [(Q.MXFP4, True), (Q.MXFP4, False), (Q.Q8_0, True)],
                         ids=["MXFP4-glu", "MXFP4-down", "Q8_0-glu"])
def test_the_backends_grouped_shapes_keep_each_pairs_bits(qt, glu):
    """expert_tuning's grouped launch against its launch a block a pair, as the backend makes
    them (a pair's sums run in the same order at any launch shape)."""
    rng = np.random.default_rng(110 + qt)
    k, raw, slot_of = _experts(qt, rng)
    ids = _SHARED_IDS
    T, A = ids.shape
    x = rng.standard_normal((T if glu else T * A, k)).astype(np.float32)
    act, _ = _act(qt, x)
    d_ids, d_slots = cuda.to_device(ids), cuda.to_device(slot_of)
    w = cuda.to_device(repack(raw, qt))
    outs = []
    for grouped in (False, True):
        kw = dict(tuning=mmvq.expert_tuning(qt, glu, grouped))
        if grouped:
            kw["groups"] = grouping.group_by_expert(d_ids, len(slot_of))
        if glu:
            outs.append(mmvq.mul_mat_vec_glu_ids(w, w, qt, k, act, d_ids, d_slots, "swiglu_oai", **kw).copy_to_host())
        else:
            outs.append(mmvq.mul_mat_vec_ids(w, qt, k, act, d_ids, d_slots, act_per_pair=True, **kw).copy_to_host())
    held = slot_of[ids] >= 0
    np.testing.assert_array_equal(outs[1][held].view(np.uint32), outs[0][held].view(np.uint32))


def test_grouped_experts_check_their_groups():
    qt = Q.Q8_0
    k, raw, slot_of = _experts(qt, np.random.default_rng(0))
    ids = cuda.to_device(_SHARED_IDS)
    act, _ = _act(qt, np.zeros((_SHARED_IDS.shape[0], k), np.float32))
    w, slots = cuda.to_device(repack(raw, qt)), cuda.to_device(slot_of)
    kern = mmvq.mul_mat_vec_ids(w, qt, k, act, ids, slots, prepare_only=True,
                                groups=grouping.group_by_expert(ids, len(slot_of)))[0]
    assert "_grouped_" in kern.__name__ and "_c2_" in kern.__name__  # the grouped kernel runs
    groups = grouping.group_by_expert(ids[:2], len(slot_of))  # buffers for 4 pairs, not 14
    with pytest.raises(ValueError, match="do not fit"):
        mmvq.mul_mat_vec_ids(w, qt, k, act, ids, slots, groups=groups)


def _silu(g):
    return g * 0.5 * (1 + np.tanh(g / 2))  # g * sigmoid(g), without exp overflow


def _oai(g, u, alpha=1.702, limit=7.0):
    x = np.minimum(g, limit)
    y = np.clip(u, -limit, limit)
    return x * 0.5 * (1 + np.tanh(alpha * x / 2)) * (y + 1)


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.MXFP4, Q.Q6_K, Q.BF16], ids=lambda t: refs.NAMES[t])
def test_fused_gate_up_glu(qt):
    rng = np.random.default_rng(60 + qt)
    k, gate, slot_of = _experts(qt, rng)
    up = refs.weights(qt, gate.shape[:2], k, rng)
    ids = np.array([[0, 2], [3, 0]], np.int32)
    # scaled so that gate/up values reach the clamp at +-7
    x = (rng.standard_normal((2, k)) * 4).astype(np.float32)
    bg, bu = (rng.standard_normal((5, gate.shape[1])).astype(np.float32) for _ in range(2))
    act, ref_act = _act(qt, x)
    dev = [cuda.to_device(repack(w, qt)) for w in (gate, up)]
    clamped = False
    for glu in ("swiglu", "swiglu_oai"):
        got = mmvq.mul_mat_vec_glu_ids(*dev, qt, k, act, cuda.to_device(ids),
                                       cuda.to_device(slot_of), glu, cuda.to_device(bg),
                                       cuda.to_device(bu)).copy_to_host()
        for t in range(2):
            for a in range(2):
                e = ids[t, a]
                sub = None if ref_act is None else tuple(v[t:t + 1] for v in ref_act)
                g = refs.matvec(gate[slot_of[e]], qt, x[t:t + 1], sub)[0] + bg[e]
                u = refs.matvec(up[slot_of[e]], qt, x[t:t + 1], sub)[0] + bu[e]
                want = _silu(g) * u if glu == "swiglu" else _oai(g, u)
                clamped |= bool((g > 7).any() and (np.abs(u) > 7).any())
                # the inputs carry RTOL-sized errors; the GLU's slope is at most ~|u| + 1
                scale = (refs.magnitude(gate[slot_of[e]], qt, x[t:t + 1])[0] + np.abs(bg[e])
                         + refs.magnitude(up[slot_of[e]], qt, x[t:t + 1])[0] + np.abs(bu[e])
                         ) * (np.abs(u) + 2)
                _close(got[t, a], want, scale)
    assert clamped  # the clamps of swiglu_oai were exercised


def test_dense_glu_without_experts():
    rng = np.random.default_rng(70)
    qt, k, n = Q.Q4_0, 256, 4
    gate, up = refs.weights(qt, (n,), k, rng), refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((2, k)).astype(np.float32)
    act, ref_act = _act(qt, x)
    got = mmvq.mul_mat_vec_glu(cuda.to_device(repack(gate, qt)), cuda.to_device(repack(up, qt)),
                               qt, k, act).copy_to_host()
    g = refs.matvec(gate, qt, x, ref_act)
    u = refs.matvec(up, qt, x, ref_act)
    scale = (refs.magnitude(gate, qt, x) + refs.magnitude(up, qt, x)) * (np.abs(u) + 2)
    _close(got, _silu(g) * u, scale)


def test_bad_inputs_are_errors():
    qt, k = Q.Q8_0, 256
    w = cuda.to_device(repack(refs.weights(qt, (2,), k, np.random.default_rng(0)), qt))
    x = np.zeros((1, k), np.float32)
    with pytest.raises(ValueError, match="q8_1"):
        mmvq.mul_mat_vec(w, qt, k, cuda.to_device(x[:1]))
    with pytest.raises(ValueError, match="bytes repacked"):  # rows of 256 values, not 512
        mmvq.mul_mat_vec(w, qt, 512, _act(qt, np.zeros((1, 512), np.float32))[0])


def test_prepare_only_returns_the_launch():
    """prepare_only: the launch a backend makes itself gives what the launcher gives."""
    rng = np.random.default_rng(90)
    qt = Q.Q6_K
    k, raw, slot_of = _experts(qt, rng)
    ids = cuda.to_device(np.array([[0, 3]], np.int32))
    act, _ = _act(qt, rng.standard_normal((1, k)).astype(np.float32))
    w, slots = cuda.to_device(repack(raw, qt)), cuda.to_device(slot_of)
    want = mmvq.mul_mat_vec_ids(w, qt, k, act, ids, slots).copy_to_host()
    out = cuda.to_device(np.full(want.shape, np.nan, np.float32))
    kern, grid, block, args = mmvq.mul_mat_vec_ids(w, qt, k, act, ids, slots, out=out,
                                                   prepare_only=True)
    assert np.isnan(out.copy_to_host()).all()  # nothing launched yet
    kern[grid, block](*args)
    np.testing.assert_array_equal(out.copy_to_host(), want)
