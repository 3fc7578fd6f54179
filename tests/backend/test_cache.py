"""Per-layer caches: a sequence's layer caches, its n_ctx bound, growth, independence.
The attention op is the only way a backend's KV cells are read, so the generic tests read them
through it, against a numpy attention over the rows written."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.backend import SequenceCache, Step
from daemon.backend.cpu_cache import FIRST_CELLS, KVCache
from daemon.errors import RequestError

from . import reference as R


def _kv(rng, T, hp):
    q = rng.standard_normal((T, hp.n_head, hp.head_dim)).astype(np.float32)
    k = rng.standard_normal((T, hp.n_head_kv, hp.head_dim)).astype(np.float32)
    v = rng.standard_normal((T, hp.n_head_kv, hp.head_dim_v)).astype(np.float32)
    return q, k, v


def _append(backend, layer, cache, q, k, v, scale):
    """One step of len(q) rows of one sequence at one layer (n_past is the model's to advance)."""
    step = Step.append([np.zeros(len(q), np.int64)], [cache], True)
    return backend.attention(layer, q, k, v, step, scale, 0, None)


def test_new_cache_has_a_layer_cache_per_layer(backend):
    hp = R.small_hparams(n_layer=3)
    cache = backend.new_cache(hp, 40)
    assert isinstance(cache, SequenceCache)
    assert (len(cache.layers), cache.n_past, cache.n_ctx) == (3, 0, 40)


def test_context_full_is_a_request_error(backend):
    cache = backend.new_cache(R.small_hparams(), 5)
    cache.reserve(5)
    with pytest.raises(RequestError, match="context full"):
        cache.reserve(6)


def test_growth_keeps_the_cells(backend):
    """Rows written before the cache grows are still attended to after it grew."""
    hp = R.small_hparams(n_layer=1)
    rng = np.random.default_rng(0)
    cache = backend.new_cache(hp, 4 * FIRST_CELLS)
    # cells allocated up front (the backend's choice; a GPU maps whole 2 MiB granules, which may
    # hold every cell: then nothing grows, and the test still checks the attention)
    first = min(cache.layers[0].capacity, FIRST_CELLS)
    scale = 1 / np.sqrt(hp.head_dim)
    ks, vs = [], []
    for n in (first - 1, 3, first + 2):  # the second and third steps need more cells
        q, k, v = _kv(rng, n, hp)
        cache.reserve(cache.n_past + n)
        got = _append(backend, 0, cache, q, k, v, scale)
        ks.append(k)
        vs.append(v)
        pos = np.arange(cache.n_past, cache.n_past + n)
        cache.n_past += n
        want = R.attention(q, np.concatenate(ks), np.concatenate(vs), pos, scale)
        assert R.rel_err(backend.to_host(got), want) < R.tolerance(backend)


def test_layers_and_sequences_are_independent(backend):
    """Layer 1's cells do not show in layer 0, nor one sequence's in another's."""
    hp = R.small_hparams(n_layer=2)
    rng = np.random.default_rng(1)
    scale = 1 / np.sqrt(hp.head_dim)
    caches = [backend.new_cache(hp, 16) for _ in range(2)]
    written = {}
    for s, cache in enumerate(caches):
        cache.reserve(4)
        for layer in (0, 1):
            q, k, v = _kv(rng, 4, hp)
            _append(backend, layer, cache, q, k, v, scale)
            written[s, layer] = (k, v)
        cache.n_past = 4
    # a decode step of both sequences at layer 0: each reads its own layer-0 cells
    q, k, v = _kv(rng, 2, hp)
    for c in caches:
        c.reserve(5)
    step = Step.append([np.zeros(1, np.int64)] * 2, caches, True)
    got = backend.to_host(backend.attention(0, q, k, v, step, scale, 0, None))
    for s in range(2):
        k0, v0 = written[s, 0]
        want = R.attention(q[s:s + 1], np.concatenate([k0, k[s:s + 1]]), np.concatenate([v0, v[s:s + 1]]),
                           np.array([4]), scale)
        assert R.rel_err(got[s:s + 1], want) < R.tolerance(backend)


class _Recurrent:
    """A fixed-size layer state (as a hybrid family's linear-attention layer): never grows."""
    capacity = 1 << 62

    def __init__(self):
        self.reserved = []

    def reserve(self, n):
        self.reserved.append(n)


def test_sequence_cache_asks_layers_only_when_they_lack_room():
    rec = _Recurrent()
    kv = KVCache(1, 1, 4, 4, 600)  # one more layer kind: its KV layer
    cache = SequenceCache([rec, kv.layers[0]], 600)
    cache.reserve(10)
    assert rec.reserved == []  # within every layer's capacity: no calls
    cache.reserve(FIRST_CELLS + 1)
    assert rec.reserved == [FIRST_CELLS + 1] and kv.layers[0].capacity >= FIRST_CELLS + 1


def test_cpu_kv_cache_grows_by_doubling_up_to_n_ctx():
    cache = KVCache(n_layer=2, n_head_kv=2, head_dim=4, head_dim_v=3, n_ctx=600)
    assert cache.k.shape == (2, FIRST_CELLS, 2, 4) and cache.v.shape == (2, FIRST_CELLS, 2, 3)
    cache.layers[1].write(0, np.ones((3, 2, 4), np.float32), np.full((3, 2, 3), 2, np.float32))
    cache.reserve(FIRST_CELLS + 1)
    assert cache.k.shape[1] == 2 * FIRST_CELLS
    cache.reserve(2 * FIRST_CELLS + 1)
    assert cache.k.shape[1] == 600  # capped at n_ctx
    assert np.array_equal(cache.layers[1].keys(3), np.ones((3, 2, 4)))
    assert np.array_equal(cache.layers[1].values(3), np.full((3, 2, 3), 2))
    assert not cache.layers[0].keys(3).any() and not cache.k[1, 3:].any()
    assert KVCache(1, 1, 4, 4, 10).k.shape[1] == 10  # small contexts allocate n_ctx cells
