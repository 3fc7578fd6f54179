"""Device router against a float64 numpy reference of each family's routing (moe.route's rules)."""

import numpy as np
import pytest
from numba import cuda

from daemon.errors import UnsupportedError
from daemon.kernels import quants as Q
from daemon.kernels.cuda.layout import repack
from daemon.kernels.cuda.router import FUSED_ROWS, count_experts, replay_routes, route, route_fused

from . import refs

T, E, A = 3, 40, 4  # E not a power of two and above the simulator's 32 threads per row


def _ref(logits, bias, gating, norm_topk, scale):
    z = logits.astype(np.float64) + (0 if bias is None else bias)
    if gating == "softmax":
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        ids = np.argsort(-p, axis=1, kind="stable")[:, :A]
        w = np.take_along_axis(p, ids, axis=1)
    else:
        ids = np.argsort(-z, axis=1, kind="stable")[:, :A]
        s = np.take_along_axis(z, ids, axis=1)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
    if norm_topk:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), 2.0 ** -14)
    if scale:
        w = w * scale
    return ids, w


def _logits(rng):
    """Distinct values at least 1e-3 apart (float32 rounding cannot reorder them)."""
    z = rng.permutation(E * T).reshape(T, E).astype(np.float64) * 4.0 / (E * T)
    return (z + rng.uniform(0, 1e-4, z.shape)).astype(np.float32)


FAMILIES = {  # (gating, norm_topk, scale, bias)
    "qwen3moe": ("softmax", True, 0.0, False),
    "qwen2moe": ("softmax", False, 0.0, False),
    "scaled": ("softmax", True, 2.5, True),
    "gpt-oss": ("softmax_weight", False, 0.0, True),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_route(family):
    gating, norm_topk, scale, with_bias = FAMILIES[family]
    rng = np.random.default_rng(len(family))
    logits = _logits(rng)
    bias = (rng.standard_normal(E) * 0.5).astype(np.float32) if with_bias else None
    ids = cuda.to_device(np.full((T, A), -1, np.int32))
    w = cuda.to_device(np.full((T, A), np.nan, np.float32))
    route(cuda.to_device(logits), gating, norm_topk, scale, ids, w, bias=None if bias is None else cuda.to_device(bias))
    ref_ids, ref_w = _ref(logits, bias, gating, norm_topk, scale)
    assert np.array_equal(ids.copy_to_host(), ref_ids)
    # float32 exps (<= 2 ulp) and sums over <= 40 terms: relative error ~1e-6
    np.testing.assert_allclose(w.copy_to_host(), ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("gating", ["softmax", "softmax_weight"])
def test_ties_keep_the_lower_index(gating):
    logits = np.zeros((1, E), np.float32)
    logits[0, [33, 7, 21, 2, 38]] = 1.0  # five equal maxima: the four lowest indices, ascending
    ids = cuda.to_device(np.zeros((1, A), np.int32))
    w = cuda.device_array((1, A), np.float32)
    route(cuda.to_device(logits), gating, True, 0.0, ids, w)
    assert ids.copy_to_host().tolist() == [[2, 7, 21, 33]]
    np.testing.assert_allclose(w.copy_to_host(), 0.25, rtol=1e-6)


def test_many_experts_rank_by_value_then_index_with_nan_as_minus_infinity():
    """300 experts (ten a lane, reduced as a tree): equal maxima and the two zeros in index order,
    NaN and -inf below every number and chosen, by index, only when nothing else is left."""
    n_exp, used = 300, 8
    lg = np.full((2, n_exp), -5.0, np.float32)
    lg[0, [250, 17, 299, 100, 5, 0, 1]] = [3.0, 3.0, 2.0, 0.0, -0.0, np.nan, -np.inf]
    lg[1, :] = np.nan
    lg[1, [40, 3]] = [1.0, -np.inf]
    ids = cuda.to_device(np.zeros((2, used), np.int32))
    w = cuda.device_array((2, used), np.float32)
    route(cuda.to_device(lg), "softmax_weight", False, 0.0, ids, w)
    got = ids.copy_to_host()
    assert got[0].tolist() == [17, 250, 299, 5, 100, 2, 3, 4]
    assert got[1].tolist() == [40, 0, 1, 2, 3, 4, 5, 6]
    chosen = lg[0, got[0]].astype(np.float64)
    ref = np.exp(chosen - chosen.max())
    np.testing.assert_allclose(w.copy_to_host()[0], ref / ref.sum(), rtol=1e-5)


def test_given_ids_are_weighed_not_chosen():
    rng = np.random.default_rng(3)
    logits = _logits(rng)
    given = np.array([[0, 5, 9, 39]] * T, np.int32)
    ids = cuda.to_device(given)
    w = cuda.device_array((T, A), np.float32)
    route(cuda.to_device(logits), "softmax", True, 0.0, ids, w, given=True)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ref = np.take_along_axis(p, given.astype(np.int64), axis=1)
    ref /= ref.sum(axis=1, keepdims=True)
    assert np.array_equal(ids.copy_to_host(), given)
    np.testing.assert_allclose(w.copy_to_host(), ref, rtol=1e-5)


def test_route_checks_arguments():
    lg = cuda.device_array((2, 8), np.float32)
    with pytest.raises(ValueError):
        route(lg, "sigmoid", False, 0.0, cuda.device_array((2, 2), np.int32), cuda.device_array((2, 2), np.float32))
    with pytest.raises(ValueError):  # more used than experts
        route(lg, "softmax", False, 0.0, cuda.device_array((2, 9), np.int32), cuda.device_array((2, 9), np.float32))


def test_count_experts_adds_each_pairs_expert():
    ids = cuda.to_device(np.array([[0, 2], [2, 3], [2, 9]], np.int32))  # 9: out of range, not counted
    usage = cuda.to_device(np.array([5, 0, 0, 0], np.int32))
    count_experts(ids, usage)
    assert usage.copy_to_host().tolist() == [6, 0, 3, 1]


def test_count_experts_flags_a_pair_whose_expert_is_in_no_tier():
    """With a slot map (>= 0 VRAM, <= -2 host row, -1 in no tier) the count also raises the cold
    flag when a pair routes to an expert mapped -1, and leaves it as it was otherwise."""
    slot_of = cuda.to_device(np.array([0, -2, -1, -3], np.int32))
    usage = cuda.to_device(np.zeros(4, np.int32))
    cold = cuda.to_device(np.zeros(1, np.int32))
    count_experts(cuda.to_device(np.array([[0, 1], [3, 1]], np.int32)), usage, 0, slot_of, cold)
    assert cold.copy_to_host().tolist() == [0] and usage.copy_to_host().tolist() == [1, 2, 0, 1]
    count_experts(cuda.to_device(np.array([[3, 2]], np.int32)), usage, 0, slot_of, cold)
    assert cold.copy_to_host().tolist() == [1] and usage.copy_to_host().tolist() == [1, 2, 1, 2]


def test_replay_routes_reads_each_layers_row_at_the_position_mod_the_trace_length():
    table = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)  # [L 2, N 3, A 2]
    positions = np.array([0, 4, 2, 7], np.int32)
    out = cuda.device_array((2, 4, 2), np.int32)
    replay_routes(cuda.to_device(table), cuda.to_device(positions), out)
    expected = np.stack([table[layer][positions % 3] for layer in range(2)])
    assert out.copy_to_host().tolist() == expected.tolist()
    with pytest.raises(ValueError):
        replay_routes(cuda.to_device(table), cuda.to_device(positions), cuda.device_array((2, 3, 2), np.int32))


# -- the fused router: the router's product and the routing in one launch --------------------

EF, KF = 12, 32  # experts and values per row of the fused router's tests (small: simulated threads are slow)


def _fused(qt, x, raw, bias, gating, norm_topk, scale, given=None):
    """route_fused on the device -> (logits, ids, weights) on the host, and its counter."""
    T = x.shape[0]
    done = cuda.to_device(np.zeros(1, np.int32))
    logits = cuda.to_device(np.full((T, raw.shape[0]), np.nan, np.float32))
    ids = cuda.to_device(np.full((T, A), -1, np.int32) if given is None else given)
    w = cuda.to_device(np.full((T, A), np.nan, np.float32))
    route_fused(cuda.to_device(repack(raw, qt)), qt, cuda.to_device(x), None if bias is None else cuda.to_device(bias),
                gating, norm_topk, scale, logits, ids, w, done, given=given is not None)
    return logits.copy_to_host(), ids.copy_to_host(), w.copy_to_host(), int(done.copy_to_host()[0])


@pytest.mark.parametrize("qt, family", [(Q.F32, "qwen3moe"), (Q.F32, "gpt-oss"), (Q.F16, "gpt-oss"),
                                        (Q.BF16, "qwen3moe")], ids=["F32-qwen3moe", "F32-gpt-oss", "F16", "BF16"])
def test_fused_router_makes_the_logits_and_routes_them(qt, family):
    """The logits within float32 rounding of a float64 product (+ bias), the ids and weights those
    logits give (the reference routes the device's own logits: a near-tie cannot flip the test),
    and the ticket counter back at zero. Up to FUSED_ROWS rows are routed in the launch; past
    that, the product takes tiles of rows and `route` follows."""
    gating, norm_topk, scale, with_bias = FAMILIES[family]
    rng = np.random.default_rng(qt)
    raw = refs.weights(qt, (EF,), KF, rng)
    bias = (rng.standard_normal(EF) * 0.5).astype(np.float32) if with_bias else None
    for T in (3, FUSED_ROWS + 1):
        x = rng.standard_normal((T, KF)).astype(np.float32)
        logits, ids, w, done = _fused(qt, x, raw, bias, gating, norm_topk, scale)
        want = x.astype(np.float64) @ refs.dequant(raw, qt).T + (0 if bias is None else bias)
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
        ref_ids, ref_w = _ref(logits, None, gating, norm_topk, scale)
        assert np.array_equal(ids, ref_ids), T
        np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-7)
        assert done == 0


def test_a_rows_routing_is_the_same_bits_whatever_rows_share_the_call():
    """Row r alone (a one-column launch), among 3 rows (routed in a launch of 4 columns) and among
    FUSED_ROWS + 2 (two tiles, then `route`): the same logits, ids and weights, bit for bit."""
    rng = np.random.default_rng(11)
    raw = refs.weights(Q.F32, (EF,), KF, rng)
    bias = (rng.standard_normal(EF) * 0.5).astype(np.float32)
    x = rng.standard_normal((FUSED_ROWS + 2, KF)).astype(np.float32)
    alone = _fused(Q.F32, x[2:3], raw, bias, "softmax_weight", False, 0.0)[:3]
    for T in (3, FUSED_ROWS + 2):
        shared = _fused(Q.F32, x[:T], raw, bias, "softmax_weight", False, 0.0)[:3]
        for a, b in zip(alone, shared):
            assert np.array_equal(a[0], b[2]), T


@pytest.mark.parametrize("qt", [Q.F32, Q.BF16], ids=["F32", "BF16"])
def test_a_row_longer_than_a_warps_loads_and_an_expert_count_the_warps_do_not_divide(qt):
    """K past one round of a warp's loads (lanes take several rounds of chunks, some lanes one
    fewer) and E = 5 (a block's spare warp writes nothing): the logits within float32 rounding,
    a row alone the same bits as among FUSED_ROWS + 1 rows (the tiled launch)."""
    rng = np.random.default_rng(7)
    K, n_exp = 1000, 5
    raw = refs.weights(qt, (n_exp,), K, rng)
    x = rng.standard_normal((FUSED_ROWS + 1, K)).astype(np.float32)
    logits, ids, _, done = _fused(qt, x, raw, None, "softmax", True, 0.0)
    want = x.astype(np.float64) @ refs.dequant(raw, qt).T
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    assert np.array_equal(ids, _ref(logits, None, "softmax", True, 0.0)[0]) and done == 0
    alone = _fused(qt, x[1:2], raw, None, "softmax", True, 0.0)
    assert np.array_equal(alone[0][0], logits[1]) and np.array_equal(alone[1][0], ids[1])


def test_fused_router_weighs_given_ids_and_refuses_quantized_routers():
    rng = np.random.default_rng(5)
    raw = refs.weights(Q.F32, (EF,), KF, rng)
    x = rng.standard_normal((T, KF)).astype(np.float32)
    given = np.array([[0, 5, 9, 11]] * T, np.int32)
    logits, ids, w, _ = _fused(Q.F32, x, raw, None, "softmax", True, 0.0, given=given)
    assert np.array_equal(ids, given)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    ref = np.take_along_axis(p / p.sum(axis=1, keepdims=True), given.astype(np.int64), axis=1)
    np.testing.assert_allclose(w, ref / np.maximum(ref.sum(axis=1, keepdims=True), 2.0 ** -14), rtol=1e-5)
    with pytest.raises(UnsupportedError):
        _fused(Q.Q8_0, x, refs.weights(Q.Q8_0, (EF,), KF, rng), None, "softmax", True, 0.0)
