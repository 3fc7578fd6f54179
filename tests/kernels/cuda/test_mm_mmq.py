"""Tiled prefill matmul (mmq.py): dense and grouped by expert, every quantized weight type, on
the tensor cores (mmq_mma.py) and with dp4a (before sm_80), against float64 references
(refs.py); the device grouping of pairs by expert."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from daemon.errors import UnsupportedError
from daemon.kernels import quants as Q
from daemon.kernels.cuda import grouping, mmq
from daemon.kernels.cuda.layout import repack
from daemon.kernels.cuda.ptx import SIMULATOR
from tests.kernels.cuda import refs
from tests.kernels.cuda.test_mm_mmvq import _act, _close

# the dp4a kernel runs for a few types only under the simulator (its Python threads are slow)
_DP4A_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4)


@pytest.fixture(params=["mma", "dp4a"])
def path(request, monkeypatch):
    monkeypatch.setattr(mmq, "USE_MMA", request.param == "mma")
    return request.param


def _skip_slow(path, qt):
    if SIMULATOR and path == "dp4a" and qt not in _DP4A_TYPES:
        pytest.skip("the dp4a kernel: a few types under the simulator")


@pytest.mark.parametrize("qt", refs.QUANT, ids=[refs.NAMES[t] for t in refs.QUANT])
def test_dense_tiles_match_reference(qt, path):
    _skip_slow(path, qt)
    rng = np.random.default_rng(100 + qt)
    k, n, t = 256, 18, 20  # two K steps; partial row and token tiles
    raw = refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((t, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    act, ref_act = _act(qt, x)
    out = cuda.to_device(np.full((t, n), np.nan, np.float32))
    mmq.mul_mat_q(cuda.to_device(repack(raw, qt)), qt, k, act, out=out, bias=cuda.to_device(bias))
    want = refs.matvec(raw, qt, x, ref_act, exact_sums=True) + bias
    _close(out.copy_to_host(), want, refs.magnitude(raw, qt, x) + np.abs(bias))  # bias: rounded too


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.MXFP4, Q.Q5_1], ids=lambda t: refs.NAMES[t])
def test_a_last_k_step_of_fewer_values(qt, path):
    """K = 160: one whole K step of 128 and one of 32 (gpt-oss's K is 2880 = 22.5 steps)."""
    _skip_slow(path, qt)
    rng = np.random.default_rng(105 + qt)
    k, n, t = 160, 18, 20
    raw = refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((t, k)).astype(np.float32)
    act, ref_act = _act(qt, x)
    got = mmq.mul_mat_q(cuda.to_device(repack(raw, qt)), qt, k, act).copy_to_host()
    _close(got, refs.matvec(raw, qt, x, ref_act, exact_sums=True), refs.magnitude(raw, qt, x))


def test_k_not_a_multiple_of_32_is_refused():
    rng = np.random.default_rng(106)
    act, _ = _act(Q.Q8_0, rng.standard_normal((20, 64)).astype(np.float32))
    w = cuda.to_device(repack(refs.weights(Q.Q8_0, (4,), 64, rng), Q.Q8_0))
    with pytest.raises(UnsupportedError, match="multiple of 32"):
        mmq.mul_mat_q(w, Q.Q8_0, 48, act)


def test_float_weights_take_the_gemv_tiles():
    rng = np.random.default_rng(110)
    qt, k, n, t = Q.F16, 128, 5, 18
    raw = refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((t, k)).astype(np.float32)
    got = mmq.mul_mat_q(cuda.to_device(repack(raw, qt)), qt, k, cuda.to_device(x)).copy_to_host()
    _close(got, refs.matvec(raw, qt, x), refs.magnitude(raw, qt, x))


@pytest.mark.parametrize("tokens", [11, 300])  # 300 * 3 pairs: many 32-pair steps a warp
def test_group_by_expert_lists_pairs_in_order(tokens):
    rng = np.random.default_rng(120)
    ids = np.stack([rng.choice(7, 3, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[: tokens // 2, 0] = 3  # runs of one expert: a step's lanes ranked among each other
    g = grouping.group_by_expert(cuda.to_device(ids), 8)  # expert 7 is never chosen
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(g.pairs.copy_to_host(), order)
    np.testing.assert_array_equal(g.starts.copy_to_host(),
                                  np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=8))]))


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K, Q.MXFP4, Q.Q6_K, Q.Q5_0],
                         ids=lambda t: refs.NAMES[t])
def test_experts_grouped_tiles(qt, path):
    _skip_slow(path, qt)
    rng = np.random.default_rng(130 + qt)
    # MXFP4: a partial last K step, as gpt-oss's K = 2880
    k = 256 if qt in refs.QK_K_TYPES else 160 if qt == Q.MXFP4 else 128
    n, s, e, t, a = 6, 3, 5, 18, 2
    raw = refs.weights(qt, (s, n), k, rng)
    slot_of = np.array([2, -1, 0, 1, 2], np.int32)  # expert 1 not loaded; 0 and 4 share a slot
    ids = np.stack([rng.choice([0, 2, 3, 4], a, replace=False) for _ in range(t)]).astype(np.int32)
    per_pair = qt in (Q.Q4_K, Q.Q5_0)
    x = rng.standard_normal((t * a if per_pair else t, k)).astype(np.float32)
    bias = rng.standard_normal((e, n)).astype(np.float32)
    act, ref_act = _act(qt, x)
    d_ids = cuda.to_device(ids)
    groups = grouping.group_by_expert(d_ids, e)
    got = mmq.mul_mat_q_ids(cuda.to_device(repack(raw, qt)), qt, k, act, d_ids,
                            cuda.to_device(slot_of), groups, bias=cuda.to_device(bias),
                            act_per_pair=per_pair).copy_to_host()
    for ti in range(t):
        for ai in range(a):
            row = ti * a + ai if per_pair else ti
            w = raw[slot_of[ids[ti, ai]]]
            sub = tuple(v[row:row + 1] for v in ref_act)
            want = refs.matvec(w, qt, x[row:row + 1], sub, exact_sums=True)[0] + bias[ids[ti, ai]]
            scale = refs.magnitude(w, qt, x[row:row + 1])[0] + np.abs(bias[ids[ti, ai]])
            _close(got[ti, ai], want, scale)


def test_experts_not_loaded_give_nan(path):
    rng = np.random.default_rng(140)
    qt, k = Q.Q8_0, 128
    raw = refs.weights(qt, (2, 4), k, rng)
    ids = np.array([[0, 1], [1, 0]], np.int32)
    slot_of = np.array([1, -1], np.int32)
    act, _ = _act(qt, rng.standard_normal((2, k)).astype(np.float32))
    d_ids = cuda.to_device(ids)
    out = cuda.to_device(np.full((2, 2, 4), 7.0, np.float32))  # pairs of expert 1 must stay as they were
    got = mmq.mul_mat_q_ids(cuda.to_device(repack(raw, qt)), qt, k, act, d_ids, cuda.to_device(slot_of),
                            grouping.group_by_expert(d_ids, 2), out=out).copy_to_host()
    assert np.isfinite(got[0, 0]).all() and np.isfinite(got[1, 1]).all() and (got[0, 0] != 7.0).any()
    assert (got[0, 1] == 7.0).all() and (got[1, 0] == 7.0).all()


def _dense(qt, raw, x, k):
    act, _ = _act(qt, x)
    return mmq.mul_mat_q(cuda.to_device(repack(raw, qt)), qt, k, act).copy_to_host()


@pytest.mark.parametrize("qt", [Q.Q6_K, Q.Q4_K], ids=lambda t: refs.NAMES[t])
def test_a_tokens_bits_do_not_depend_on_its_tile(qt, monkeypatch):
    """Tensor cores: a token alone gives the bits it gives among 19 others (a prefill's result does
    not depend on its batching). Q6_K's groups of 16 keep the dp4a kernel's order: the same bits."""
    rng = np.random.default_rng(150 + qt)
    k, n, t = 256, 18, 20
    raw = refs.weights(qt, (n,), k, rng)
    x = rng.standard_normal((t, k)).astype(np.float32)
    monkeypatch.setattr(mmq, "USE_MMA", True)
    tile = _dense(qt, raw, x, k)
    alone = _dense(qt, raw, x[7:8], k)
    np.testing.assert_array_equal(alone[0].view(np.uint32), tile[7].view(np.uint32))
    if qt == Q.Q6_K:
        monkeypatch.setattr(mmq, "USE_MMA", False)
        np.testing.assert_array_equal(_dense(qt, raw, x, k).view(np.uint32), tile.view(np.uint32))
