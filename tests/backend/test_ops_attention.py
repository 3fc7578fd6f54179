"""Attention of every backend against numpy: prefill, decode batches and batched prefills, with
GQA, sinks and a sliding window; each sequence sees only its own cells."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.backend import Step
from daemon.kernels import quants as Q

from . import reference as R

CASES = {  # H, Hkv, Dh, Dv, window, sinks
    "mha": (4, 4, 16, 16, 0, False),
    "gqa": (8, 2, 32, 32, 0, False),
    "gqa-sinks-window": (4, 2, 16, 16, 5, True),
    "dv-differs": (2, 1, 8, 12, 0, False),
    "gqa-3-per-kv-head": (9, 3, 64, 64, 0, False),  # SmolLM2's heads
}


def _rows(rng, T, H, Hkv, Dh, Dv):
    return (rng.standard_normal((T, H, Dh)).astype(np.float32), rng.standard_normal((T, Hkv, Dh)).astype(np.float32),
            rng.standard_normal((T, Hkv, Dv)).astype(np.float32))


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_then_decode_batches(backend, case):
    """Three sequences: a batched prefill (rows 7, 1, 12), two decode steps of all three, then
    a prefill of 4 more rows of the first alone; every step against numpy over all cells."""
    H, Hkv, Dh, Dv, window, has_sinks = CASES[case]
    hp = R.small_hparams(n_layer=2, n_head=H, n_head_kv=Hkv, head_dim=Dh, head_dim_v=Dv)
    rng = np.random.default_rng(len(case))
    sinks = rng.standard_normal(H).astype(np.float32) if has_sinks else None
    scale = 1 / np.sqrt(Dh)
    layer = 1
    caches = [backend.new_cache(hp, 64) for _ in range(3)]
    cells = [([], []) for _ in caches]  # what each sequence stored: k, v per step
    for counts, which in (((7, 1, 12), (0, 1, 2)), ((1, 1, 1), (0, 1, 2)), ((1, 1, 1), (2, 0, 1)), ((4,), (0,))):
        seqs = [caches[i] for i in which]
        for c, n in zip(seqs, counts):
            c.reserve(c.n_past + n)
        step = Step.append([np.zeros(n, np.int64) for n in counts], seqs, True)
        q, k, v = _rows(rng, step.T, H, Hkv, Dh, Dv)
        got = backend.to_host(backend.attention(layer, q, k, v, step, scale, window, sinks))
        assert got.shape == (step.T, H, Dv)
        for s, i in enumerate(which):
            r0, r1 = step.offsets[s], step.offsets[s + 1]
            cells[i][0].append(k[r0:r1])
            cells[i][1].append(v[r0:r1])
            want = R.attention(q[r0:r1], np.concatenate(cells[i][0]), np.concatenate(cells[i][1]),
                               step.positions[r0:r1], scale, window, sinks)
            assert R.rel_err(got[r0:r1], want) < R.tolerance(backend), (counts, s)
        for c, n in zip(seqs, counts):
            c.n_past += n


def test_sliding_window_hides_old_cells(backend):
    """With window 2 the query at position 3 ignores cells 0 and 1 entirely: changing them
    changes nothing."""
    hp = R.small_hparams(n_layer=1, n_head=2, n_head_kv=1, head_dim=8, head_dim_v=8)
    rng = np.random.default_rng(9)
    q, k, v = _rows(rng, 4, 2, 1, 8, 8)
    outs = []
    for k0 in (k, np.concatenate([k[:2] * 5, k[2:]])):
        cache = backend.new_cache(hp, 8)
        cache.reserve(4)
        step = Step.append([np.zeros(4, np.int64)], [cache], True)
        outs.append(backend.to_host(backend.attention(0, q, k0, v, step, 0.3, 2, None))[3])
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("normed", [False, True], ids=["rope", "norm+rope"])
def test_attention_with_rope_is_rope_qk_then_attention(backend, normed):
    """attention(..., rope) norms and rotates q and k itself (on a GPU in the launch that stores
    the cache): the bits of rope_qk and then attention, for a prefill and for the decode step
    after it, which reads the cells the first step stored."""
    from daemon.model.hparams import Rope

    rope = Rope(n_dims=8, freq_base=10000.0, neox=True)  # partial rotary: dims 8.. pass through
    hp = R.small_hparams(n_layer=1, n_head=4, n_head_kv=2, head_dim=16, head_dim_v=16)
    rng = np.random.default_rng(12)
    qn, kn = (rng.uniform(0.5, 1.5, 16).astype(np.float32) if normed else None for _ in range(2))
    caches = [backend.new_cache(hp, 16) for _ in range(2)]  # [unfused, fused]
    for n in (5, 1):
        q, k, v = _rows(rng, n, 4, 2, 16, 16)
        outs = []
        for fused, cache in enumerate(caches):
            cache.reserve(cache.n_past + n)
            step = Step.append([np.zeros(n, np.int64)], [cache], True)
            if fused:
                out = backend.attention(0, q.copy(), k.copy(), v, step, 0.25, 0, None, rope, qn, kn, 1e-6)
            else:
                rq, rk = backend.rope_qk(q.copy(), k.copy(), step, rope, qn, kn, 1e-6)
                out = backend.attention(0, rq, rk, v, step, 0.25, 0, None)
            outs.append(backend.to_host(out))
            cache.n_past += n
        assert np.array_equal(outs[1], outs[0]) and np.isfinite(outs[0]).all()


@pytest.mark.parametrize("qt", [Q.F32, Q.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("counts", [(1,), (1, 1), (5,)], ids=["one-row", "decode", "prefill"])
def test_attention_into_a_linear_gives_the_plain_bits(backend, qt, counts):
    """attention(..., into=w) is the plain output as [T, H*Dv] (on a GPU, for one row, carrying
    the q8_1 blocks its combine wrote), and the linear it goes to gives the bits of that linear on
    the plain output, whose blocks the linear makes itself."""
    H, Hkv, Dh, Dv = 4, 2, 32, 32  # value heads of 32: one q8_1 block a head
    hp = R.small_hparams(n_layer=1, n_head=H, n_head_kv=Hkv, head_dim=Dh, head_dim_v=Dv)
    rng = np.random.default_rng(30 + len(counts))
    w = backend.upload(R.qweight(qt, 24, H * Dv, rng))
    q, k, v = _rows(rng, sum(counts), H, Hkv, Dh, Dv)
    outs = []
    for into in (None, w):
        caches = [backend.new_cache(hp, 8) for _ in counts]
        for c, n in zip(caches, counts):
            c.reserve(n)
        step = Step.append([np.zeros(n, np.int64) for n in counts], caches, True)
        out = backend.attention(0, q, k, v, step, 0.3, 0, None, into=into)
        if into is not None and backend.name.startswith("cuda"):  # the combine's blocks, or none
            assert (getattr(out, "q8_1", None) is not None) == (counts == (1,) and qt == Q.Q8_0)
        if into is None:
            out = backend.to_host(out).reshape(step.T, H * Dv)  # a new array: no q8_1 blocks of its own
        outs.append((backend.to_host(out), backend.to_host(backend.linear(out, w, step))))
    (plain, plain_y), (flat, y) = outs
    assert flat.shape == (sum(counts), H * Dv)
    assert np.array_equal(flat.view(np.uint32), plain.view(np.uint32))
    assert np.array_equal(y.view(np.uint32), plain_y.view(np.uint32))
