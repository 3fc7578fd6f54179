"""The CUDA backend's hybrid-family (qwen3next, qwen35moe) cache and Gated DeltaNet ops: KV only
for the attention layers (found through each sequence's layer cache), conv and delta-rule
states for the recurrent ones in slots shared with the KV, zeroed for a sequence that takes a
slot, kept when the pool grows; and the ops (conv_silu, gated_delta_net, gated_rms_norm,
sigmoid_mul, split_heads) against the CPU backend ("float32" numerics; the delta-net ops compute
as llama.cpp's CPU in both) over a batched prefill of sequences of different lengths and decode
steps carrying the state on. Tiny shapes: these run under numba's CUDA simulator in CI.

Tolerance: rtol = atol = 1e-5 on values of order 1 (see tests/kernels/cuda/test_ops_gdn.py: f32
on both sides, different exp/log, sum orders and FMA contraction)."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest

from daemon.backend import CPUBackend, Step
from daemon.model.hparams import Ssm

from . import reference as R
from .conftest import CUDA_SKIP_REASON

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

RTOL = ATOL = 1e-5
EPS = 1e-6
SSM = Ssm(conv_kernel=4, n_k_head=2, n_v_head=4, head_k=4, head_v=4, tiled=False)  # C = 32
RECURRENT = (True, False, True, True)  # layers 0, 2, 3 recurrent; layer 1 attention


def hybrid_hparams(ssm=SSM, recurrent=RECURRENT):
    hp = R.small_hparams(n_layer=len(recurrent), n_head=2, n_head_kv=1, head_dim=8, head_dim_v=8)
    return dataclasses.replace(hp, ssm=ssm, recurrent=recurrent)


@pytest.fixture(scope="module")
def cuda_backend():
    from daemon.backend.cuda import CUDABackend

    return CUDABackend(0)


def _host(b, x):
    return np.asarray(b.to_host(x))


def _pool_host(b, a) -> np.ndarray:
    """A pool array on the host, once the backend's stream (which writes and zeroes it) is done."""
    b.stream.synchronize()
    return a.copy_to_host()


# -- the cache -------------------------------------------------------------------------------


def test_hybrid_cache_layers_and_pool(cuda_backend):
    """Attention layer 1 is the pool's KV layer 0; recurrent layers 0, 2, 3 are state layers
    0, 1, 2; the states are f32 [slots, 3, ...] (counted in the backend's VRAM); a non-hybrid model
    of the same attention shape gets its own all-KV pool."""
    from daemon.backend.cuda_cache import DeviceKVLayer, DeviceStateLayer

    b = cuda_backend
    before = b.bytes["kv"]
    c = b.new_cache(hybrid_hparams(), 16)
    kinds = [(type(layer).__name__, layer.layer if isinstance(layer, DeviceKVLayer) else layer.index)
             for layer in c.layers]
    assert kinds == [("DeviceStateLayer", 0), ("DeviceKVLayer", 0), ("DeviceStateLayer", 1), ("DeviceStateLayer", 2)]
    pool = c.pool
    assert len(pool.k) == len(pool.v) == 1
    S = pool.slots
    assert pool.conv.shape == (S, 3, SSM.conv_channels, SSM.conv_kernel - 1)
    assert pool.state.shape == (S, 3, SSM.n_v_head, SSM.head_v, SSM.head_k)
    assert pool.conv.dtype == pool.state.dtype == np.float32
    assert b.bytes["kv"] - before == pool.nbytes
    kv = 2 * pool.cells * S * 1 * 8 * 2  # K and V of the one attention layer: cells x slots x 1 head x 8 x f16
    # (cells: whole blocks of attention.KV_BLOCK)
    mapped = sum(a.nbytes for a in (*pool._k, *pool._v))  # whole granules on a GPU
    assert mapped >= kv and pool.nbytes == mapped + pool.conv.nbytes + pool.state.nbytes
    c.reserve(16)  # the state layers never limit the room, the KV layer's cells do
    assert isinstance(c.layers[0], DeviceStateLayer) and c.layers[0].capacity > 2**40

    plain = b.new_cache(R.small_hparams(n_layer=4, n_head=2, n_head_kv=1, head_dim=8, head_dim_v=8), 16)
    assert plain.pool is not pool and plain.pool.conv is None and len(plain.pool.k) == 4
    assert [layer.layer for layer in plain.layers] == [0, 1, 2, 3]


def test_attention_of_a_hybrid_model_uses_its_kv_layer(cuda_backend):
    """Model layer 1's keys land in the pool's KV array 0, at the sequence's slot."""
    b = cuda_backend
    c = b.new_cache(hybrid_hparams(), 16)
    c.reserve(1)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 1, 8)).astype(np.float32)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    out = b.attention(1, q, k, k, Step.append([np.zeros(1, np.int64)], [c], True), 1.0, 0, None)
    assert np.array_equal(_pool_host(b, c.pool.k[0][:1])[0, c.slot, 0, 0], k[0, 0].astype(np.float16))
    np.testing.assert_allclose(_host(b, out), np.broadcast_to(k.astype(np.float16), (1, 2, 8)), rtol=1e-6)


def _gdn_inputs(rng, T, ssm=SSM):
    C, Hv = ssm.conv_channels, ssm.n_v_head
    return (rng.standard_normal((T, C)).astype(np.float32), rng.standard_normal((T, Hv)).astype(np.float32),
            (rng.standard_normal((T, Hv)) - 1).astype(np.float32))


def _layer_weights(rng, ssm=SSM):
    Hv = ssm.n_v_head
    return (rng.standard_normal((ssm.conv_channels, ssm.conv_kernel)).astype(np.float32) * 0.5,
            rng.standard_normal(Hv).astype(np.float32), -rng.uniform(0.2, 3.0, Hv).astype(np.float32))


def _run_layer(b, il, step, x, bb, aa, weights, ssm=SSM):
    conv_w, dt_bias, ssm_a = weights
    h = b.conv_silu(il, x, conv_w, step)
    o = b.gated_delta_net(il, h, bb, aa, dt_bias, ssm_a, step, ssm, EPS)
    return _host(b, h), _host(b, o)


def test_a_reused_slot_starts_from_zero_state(cuda_backend):
    """A sequence runs two rows through recurrent layer 2 (its states non-zero), then goes; the
    next sequence gets its slot with zero states and computes as a sequence in a fresh slot does."""
    b = cuda_backend
    hp = hybrid_hparams()
    rng = np.random.default_rng(1)
    weights = _layer_weights(rng)
    gc.collect()  # an earlier test's caches on this backend free their slots now, not below
    first = b.new_cache(hp, 16)
    slot, pool = first.slot, first.pool
    x, bb, aa = _gdn_inputs(rng, 2)
    _run_layer(b, 2, Step.append([np.zeros(2, np.int64)], [first], True), x, bb, aa, weights)
    assert np.abs(_pool_host(b, pool.state)[slot, 1]).max() > 0 and np.abs(_pool_host(b, pool.conv)[slot, 1]).max() > 0
    del first
    gc.collect()
    again = b.new_cache(hp, 16)
    assert again.slot == slot
    assert not _pool_host(b, pool.state)[slot].any() and not _pool_host(b, pool.conv)[slot].any()
    fresh = b.new_cache(hp, 16)
    assert fresh.slot != slot
    x, bb, aa = _gdn_inputs(rng, 3)
    got = [_run_layer(b, 2, Step.append([np.zeros(3, np.int64)], [c], True), x, bb, aa, weights)
           for c in (again, fresh)]
    assert all(np.array_equal(u, v) for u, v in zip(*got))


def test_states_are_kept_when_the_pool_grows(cuda_backend):
    """A fifth live sequence doubles the slots; the first four keep their conv and delta-rule
    states (and the VRAM tally follows)."""
    from daemon.backend.cuda import CUDABackend

    b = CUDABackend(0)  # a pool of its own: 4 slots at first
    hp = hybrid_hparams()
    rng = np.random.default_rng(2)
    weights = _layer_weights(rng)
    caches = [b.new_cache(hp, 16) for _ in range(4)]
    pool = caches[0].pool
    assert pool.slots == 4
    x, bb, aa = _gdn_inputs(rng, 4)
    _run_layer(b, 0, Step.append([np.zeros(1, np.int64)] * 4, caches, True), x, bb, aa, weights)
    conv, state = _pool_host(b, pool.conv), _pool_host(b, pool.state)
    caches.append(b.new_cache(hp, 16))
    assert pool.slots == 8 and caches[-1].slot >= 4
    assert np.array_equal(_pool_host(b, pool.conv)[:4], conv) and np.array_equal(_pool_host(b, pool.state)[:4], state)
    assert not _pool_host(b, pool.state)[4:].any()
    assert b.bytes["kv"] == pool.nbytes


# -- the ops against the CPU backend ---------------------------------------------------------


def _long_rows():
    from daemon.kernels.cuda.gdn_chunked import MIN_ROWS

    return MIN_ROWS + 3


@pytest.mark.parametrize("tiled,long", [(False, False), (True, False), (True, True)],
                         ids=["grouped", "tiled", "tiled-chunked"])
def test_delta_net_ops_match_the_cpu_backend(cuda_backend, tiled, long, monkeypatch):
    """Two sequences in slots the CUDA backend chose, a batched prefill of 3 and 1 rows (the
    second shorter than Kc-1: its conv state keeps zeros; `long`: the first of
    gdn_chunked.MIN_ROWS + 3 rows, the chunked form with a partial last chunk), then a decode step
    of both, through recurrent layers 0 and 3 of the model: conv_silu, gated_delta_net and
    (layer 3) gated_rms_norm equal the CPU backend's within f32 tolerance at every step, and so
    do the states."""
    from daemon.kernels.cuda import launch

    record = []
    monkeypatch.setattr(launch, "RECORD", record)
    ssm = dataclasses.replace(SSM, tiled=tiled)
    hp = hybrid_hparams(ssm)
    cpu, gpu = CPUBackend("float32"), cuda_backend
    rng = np.random.default_rng(3)
    weights = {il: _layer_weights(rng, ssm) for il in (0, 3)}
    norm_w = rng.uniform(0.5, 1.5, ssm.head_v).astype(np.float32)
    first = _long_rows() if long else 3
    n_ctx = max(16, first + 1)
    caches = {be: [be.new_cache(hp, n_ctx) for _ in range(2)] for be in (cpu, gpu)}
    for counts in ([first, 1], [1, 1]):
        T = sum(counts)
        per_layer = {il: (*_gdn_inputs(rng, T, ssm), rng.standard_normal((T, ssm.v_dim)).astype(np.float32))
                     for il in (0, 3)}
        results = {}
        for be in (cpu, gpu):
            step = Step.append([np.zeros(n, np.int64) for n in counts], caches[be], True)
            outs = []
            for il, (x, bb, aa, z) in per_layer.items():
                h, o = _run_layer(be, il, step, x, bb, aa, weights[il], ssm)
                outs += [h, o]
            outs.append(_host(be, be.gated_rms_norm(o, norm_w, z, EPS)))
            for c, n in zip(caches[be], counts):
                c.n_past += n
            results[be] = outs
        for name, g, c in zip(["conv 0", "delta 0", "conv 3", "delta 3", "norm 3"], results[gpu],
                              results[cpu]):
            np.testing.assert_allclose(g, c, rtol=RTOL, atol=ATOL, err_msg=f"{name} after {counts}")
    pool = caches[gpu][0].pool
    for s in range(2):
        stores, slot = caches[cpu][s].states, caches[gpu][s].slot
        np.testing.assert_allclose(_pool_host(gpu, pool.state)[slot], stores.ssm, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(_pool_host(gpu, pool.conv)[slot], stores.conv, rtol=0, atol=0)
    assert ("carry" in record) == long  # the chunked form ran, in the long case only


@pytest.mark.parametrize("per_row", [False, True])
def test_sigmoid_mul_matches_the_cpu_backend(cuda_backend, per_row):
    rng = np.random.default_rng(4)
    y = rng.standard_normal((3, 12)).astype(np.float32)
    z = (3 * rng.standard_normal((3, 1 if per_row else 12))).astype(np.float32)
    np.testing.assert_allclose(_host(cuda_backend, cuda_backend.sigmoid_mul(y, z)),
                               CPUBackend("float32").sigmoid_mul(y, z), rtol=4e-6, atol=1e-7)


def test_split_heads_matches_the_cpu_backend(cuda_backend):
    x = np.arange(2 * 3 * 2 * 4, dtype=np.float32).reshape(2, 24)
    got = cuda_backend.split_heads(x, 3, 2)
    want = CPUBackend("float32").split_heads(x, 3, 2)
    assert len(got) == 2 and all(np.array_equal(_host(cuda_backend, g), w) for g, w in zip(got, want))
    assert all(g.shape == (2, 3, 4) for g in got)


def test_delta_net_decode_is_the_three_ops(cuda_backend, monkeypatch):
    """Backend.delta_net of a decode step (one launch on the GPU, gdn.decode_step) against
    compose_delta_net on the same backend, for two pairs of sequences prefilled alike: the same
    outputs and the same conv and delta-rule states, bit for bit, over two steps."""
    from daemon.backend.base import compose_delta_net
    from daemon.kernels.cuda import launch

    b = cuda_backend
    record: list[str] = []
    monkeypatch.setattr(launch, "RECORD", record)
    hp = hybrid_hparams()
    rng = np.random.default_rng(7)
    conv_w, dt_bias, ssm_a = _layer_weights(rng)
    norm_w = rng.uniform(0.5, 1.5, SSM.head_v).astype(np.float32)
    pairs = [[b.new_cache(hp, 16) for _ in range(2)] for _ in range(2)]  # [fused, composed]
    for counts in ([2, 1], [1, 1], [1, 1]):
        T = sum(counts)
        x, bb, aa = _gdn_inputs(rng, T)
        z = rng.standard_normal((T, SSM.v_dim)).astype(np.float32)
        outs = []
        for fused, caches in enumerate(pairs):
            step = Step.append([np.zeros(n, np.int64) for n in counts], caches, True)
            run = b.delta_net if fused and T == len(counts) else (lambda *a: compose_delta_net(b, *a))
            outs.append(_host(b, run(3, x, conv_w, bb, aa, dt_bias, ssm_a, norm_w, z, step, SSM, EPS)))
            for c, n in zip(caches, counts):
                c.n_past += n
        assert np.array_equal(outs[0], outs[1]) and np.isfinite(outs[0]).all(), counts
    pool = pairs[0][0].pool
    conv, state = _pool_host(b, pool.conv), _pool_host(b, pool.state)
    for f, c in zip(*pairs):
        assert np.array_equal(conv[f.slot], conv[c.slot]) and np.array_equal(state[f.slot], state[c.slot])
    assert not _pool_host(b, pool.tickets).any()
    assert record.count("decode") == 2  # the decode steps' fused launches (the prefill composes)
