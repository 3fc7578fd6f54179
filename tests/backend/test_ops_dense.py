"""Dense ops of every backend against numpy: embed, linear (+bias, grouped rows), norms, RoPE,
GLUs, the shared-expert gate, add, take_rows, upload."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.backend import Step
from daemon.backend.cpu_cache import KVCache
from daemon.kernels import quants as Q
from daemon.model.hparams import Rope

from . import reference as R
from .conftest import simulated

TYPES = [Q.F32, Q.F16, Q.Q8_0, Q.MXFP4, Q.Q4_K, Q.Q6_K]
K, N = 256, 24


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.F16, Q.Q4_K])
def test_embed(backend, qt):
    rng = np.random.default_rng(qt)
    host = R.qweight(qt, 10, K, rng)
    table = backend.upload(host)
    tokens = np.array([3, 0, 9, 3], np.int64)
    got = backend.to_host(backend.embed(table, tokens))
    assert got.shape == (4, K) and got.dtype == np.float32
    assert np.allclose(got, R.dequant(host.raw, qt)[tokens], rtol=1e-6, atol=0)


@pytest.mark.parametrize("qt", TYPES, ids=[Q.type_name(t) for t in TYPES])
@pytest.mark.parametrize("T", [1, 3, 9, 20])  # 20: the tiled matmul on a GPU
def test_linear(backend, qt, T):
    rng = np.random.default_rng(10 * qt + T)
    host = R.qweight(qt, N, K, rng)
    w = backend.upload(host)
    x = rng.standard_normal((T, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    want = x.astype(np.float64) @ R.dequant(host.raw, qt).T
    got = backend.to_host(backend.linear(x, w))
    assert got.shape == (T, N) and got.dtype == np.float32
    assert R.rel_err(got, want) < R.tolerance(backend, qt)
    with_bias = backend.to_host(backend.linear(backend.prepare(x), w, None, bias))
    assert R.rel_err(with_bias, want + bias) < R.tolerance(backend, qt)


@pytest.mark.parametrize("T", [1, 3])
def test_linears_of_an_upload_group(backend, T):
    """q, k and v uploaded as a group and applied by one `linears` call: the same bits as each
    uploaded and applied alone (a GPU makes a one-row call one launch), biases where given."""
    rng = np.random.default_rng(T)
    hosts = [R.qweight(Q.Q8_0, n, K, rng) for n in (N, 8, 16)]
    biases = [rng.standard_normal(N).astype(np.float32), None, rng.standard_normal(16).astype(np.float32)]
    x = rng.standard_normal((T, K)).astype(np.float32)
    got = backend.linears(backend.prepare(x), backend.upload_group(hosts), None, biases)
    for g, h, b in zip(got, hosts, biases):
        alone = backend.to_host(backend.linear(x, backend.upload(h), None, b))
        assert np.array_equal(backend.to_host(g), alone)
        want = x.astype(np.float64) @ R.dequant(h.raw, Q.Q8_0).T + (0 if b is None else b)
        assert R.rel_err(alone, want) < R.tolerance(backend, Q.Q8_0)
    mixed = [R.qweight(Q.Q8_0, N, K, rng), R.qweight(Q.F16, 8, K, rng)]  # types differ: uploaded apart
    for g, h in zip(backend.linears(x, backend.upload_group(mixed)), mixed):
        assert np.array_equal(backend.to_host(g), backend.to_host(backend.linear(x, backend.upload(h))))


def test_add_rms_norm_is_add_then_norm(backend):
    rng = np.random.default_rng(5)
    x, d = (rng.standard_normal((3, K)).astype(np.float32) for _ in range(2))
    w = backend.upload(rng.standard_normal(K).astype(np.float32))
    s, h = backend.add_rms_norm(x, d, w, 1e-6)
    s, h = backend.to_host(s), backend.to_host(h)
    assert np.array_equal(s, x + d)
    ref = (x + d).astype(np.float64)
    ref = ref / np.sqrt((ref ** 2).mean(1, keepdims=True) + 1e-6) * backend.to_host(w)
    assert R.rel_err(h, ref) < 1e-5
    assert np.array_equal(backend.to_host(x), x)  # the input is left as it was


@pytest.mark.parametrize("qt", [Q.F16, Q.Q4_K, Q.Q8_0], ids=["F16", "Q4_K", "Q8_0"])
def test_linear_computes_each_sequence_as_alone(backend, qt):
    """Batch invariance: in batched prefills (rows of 9, 1 and 3; of 17, 1 and 2, which take
    different kernels on a GPU) and in a decode step (one row each), every sequence's rows come
    out bit-identical to a step holding that sequence only."""
    rng = np.random.default_rng(7)
    w = backend.upload(R.qweight(qt, N, K, rng))
    caches = [KVCache(1, 1, 4, 4, 32) for _ in range(3)]
    steps = ((9, 1, 3), (17, 1, 2), (1, 1, 1))
    if simulated(backend):  # a device thread takes ~1 ms there: the step of two kernels only
        steps = ((17, 1, 2),)
    for counts in steps:
        x = rng.standard_normal((sum(counts), K)).astype(np.float32)
        step = Step.append([np.zeros(n, np.int64) for n in counts], caches, True)
        together = backend.to_host(backend.linear(x, w, step))
        for s in range(3):
            r0, r1 = step.offsets[s], step.offsets[s + 1]
            alone = backend.to_host(backend.linear(x[r0:r1], w, Step.append([np.zeros(r1 - r0, np.int64)],
                                                                           caches[s:s + 1], True)))
            assert np.array_equal(together[r0:r1], alone), (counts, s)


def test_prepared_activations_serve_weights_of_several_types(backend):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, K)).astype(np.float32)
    xa = backend.prepare(x)
    for qt in (Q.Q8_0, Q.Q4_K, Q.F16, Q.Q8_0):
        w = R.qweight(qt, N, K, rng)
        assert np.array_equal(backend.to_host(backend.linear(xa, w)), backend.to_host(backend.linear(x, w)))


def test_rms_norm(backend):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    got = backend.to_host(backend.rms_norm(x, w, 1e-5))
    assert R.rel_err(got, R.rms_norm(x, w, 1e-5)) < 1e-6
    xh = rng.standard_normal((5, 3, 16)).astype(np.float32)
    wh = rng.standard_normal(16).astype(np.float32)
    got = backend.to_host(backend.rms_norm_heads(xh, wh, 1e-6))
    assert R.rel_err(got, R.rms_norm(xh, wh, 1e-6)) < 1e-6


ROPES = {
    "norm": Rope(n_dims=16, freq_base=10000.0, neox=False),
    "neox-partial": Rope(n_dims=8, freq_base=500000.0, neox=True),
    "yarn": Rope(n_dims=16, freq_base=150000.0, neox=True, freq_scale=0.25, ext_factor=1.0, attn_factor=1.0,
                 corr_dims=(3.0, 6.0)),
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope(backend, name):
    r = ROPES[name]
    rng = np.random.default_rng(2)
    caches = [KVCache(1, 1, 4, 4, 64) for _ in range(2)]
    caches[1].n_past = 40
    step = Step.append([np.zeros(3, np.int64), np.zeros(2, np.int64)], caches, True)  # positions 0-2, 40-41
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    got = backend.to_host(backend.rope(x, step, r))
    assert R.rel_err(got, R.rope(x, step.positions, r)) < 1e-5
    assert np.array_equal(got[..., r.n_dims:], x[..., r.n_dims:])  # dimensions past n_dims pass through


@pytest.mark.parametrize("normed", [False, True], ids=["rope", "norm+rope"])
@pytest.mark.parametrize("name", ["norm", "neox-partial"])
def test_rope_qk(backend, name, normed):
    """q and k normed per head (qwen3) and rotated by one op: as rms_norm_heads then rope."""
    r = ROPES[name]
    rng = np.random.default_rng(4)
    caches = [KVCache(1, 1, 4, 4, 64) for _ in range(2)]
    caches[1].n_past = 40
    step = Step.append([np.zeros(3, np.int64), np.zeros(2, np.int64)], caches, True)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((5, 2, 16)).astype(np.float32)
    qn, kn = (rng.standard_normal(16).astype(np.float32) if normed else None for _ in range(2))
    gq, gk = backend.rope_qk(q, k, step, r, qn, kn, 1e-6)
    for got, x, w in ((gq, q, qn), (gk, k, kn)):
        want = x if w is None else R.rms_norm(x, w, 1e-6)
        assert R.rel_err(backend.to_host(got), R.rope(want, step.positions, r)) < 1e-5


def test_glu(backend):
    rng = np.random.default_rng(3)
    g, u = (rng.standard_normal((4, 40)).astype(np.float32) * 4 for _ in range(2))
    got = backend.to_host(backend.glu(g, u, "silu"))
    assert R.rel_err(got, R.silu(g.astype(np.float64)) * u) < 1e-6
    got = backend.to_host(backend.glu(g, u, "oai", 1.702, 7.0))
    assert R.rel_err(got, R.swiglu_oai(g.astype(np.float64), u, 1.702, 7.0)) < 1e-6


def test_sigmoid_gate_add_take_rows(backend):
    rng = np.random.default_rng(4)
    y = rng.standard_normal((4, 12)).astype(np.float32)
    z = rng.standard_normal((4, 1)).astype(np.float32) * 3
    got = backend.to_host(backend.sigmoid_gate(y, z))
    assert R.rel_err(got, y / (1 + np.exp(-z.astype(np.float64)))) < 1e-6
    b = rng.standard_normal((4, 12)).astype(np.float32)
    assert np.array_equal(backend.to_host(backend.add(y, b)), y + b)
    rows = backend.to_host(backend.take_rows(y, np.array([3, 1])))
    assert np.array_equal(rows, y[[3, 1]]) and rows.flags.c_contiguous


def test_upload_keeps_what_a_weight_computes(backend):
    rng = np.random.default_rng(6)
    w = R.qweight(Q.Q8_0, N, K, rng)
    x = rng.standard_normal((2, K)).astype(np.float32)
    assert np.array_equal(backend.to_host(backend.linear(x, backend.upload(w))),
                          backend.to_host(backend.linear(x, w)))
