"""The VRAM expert cache (daemon/backend/cuda_expert_cache.py) over a host ExpertCache, on a tiny
qwen3moe Q8_0 fixture: tier logic and statistics, the order of copies, events and waits, the
fall-backs to the CPU, bit-identical results with hybrid compute off, host slots pinned until their
copies are done; its kernels (repack_into_slots, scatter_rows); and select._expert_budget.

Runs on a GPU, or under numba's simulator (CI), where every device thread runs in Python: the
fixture is as small as the kernels allow (32-wide experts), most tests call the MoE block of one
layer (moe_forward, with the routing chosen) rather than the whole model, and one test runs the
whole model. Under the simulator copies are synchronous and every event is done.

Hand-computed sizes of one expert of the fixture (n_embd = n_ff_exp = 32, Q8_0: 34 bytes a block
of 32 values): raw rows of 34 bytes, so 3 * 32 * 34 = 3264 bytes in host memory; repacked rows
padded to 48 bytes (34 rounded up to 16), so 3 * 32 * 48 = 4608 bytes in VRAM.
"""

from __future__ import annotations

import logging

# first: it picks the GPU or the simulator as numba.cuda is imported
from tests.kernels.cuda.conftest import SKIP_REASON as CUDA_SKIP_REASON  # isort: skip

import numpy as np
import pytest

from daemon.backend.select import MARGIN, VRAMEstimate, _expert_budget
from daemon.config import Settings
from daemon.errors import StorageError
from daemon.kernels.cuda.device import SIM
from daemon.model.moe import moe_forward
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

cuda_only = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

D = 32
TINY = dict(n_embd=D, n_head=4, n_head_kv=2, head_dim=8, n_ff=D, n_ff_exp=D, n_ff_shexp=D, n_expert=4,
            n_expert_used=2, n_layer=2)
N_LAYERS = 2  # MoE layers (every layer of the fixture)
HOST_EXPERT = 3 * 32 * 34  # raw bytes of one expert (module doc)
VRAM_EXPERT = 3 * 32 * 48  # repacked bytes of one expert
QUANT_TOL = 5e-2  # CPU-computed experts against the GPU's (test_cuda_model.py)
X = np.random.default_rng(7).standard_normal((4, D)).astype(np.float32)  # the MoE blocks' input rows


# -- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf(fixture_dir):
    g = GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **TINY))
    yield g
    g.close()


@pytest.fixture(scope="module")
def resident(gguf):
    """The model with every expert resident in VRAM (the reference)."""
    from daemon.backend.cuda import CUDABackend

    backend = CUDABackend(0)
    return Transformer(gguf, experts=backend.resident_experts(gguf), backend=backend)


def moe_out(model, chosen, layer: int = 0) -> np.ndarray:
    """The MoE block of `layer` on the first rows of X, routed to `chosen` ids [T, A] -> [T, D]."""
    chosen = np.asarray(chosen, np.int64)
    B = model.backend
    x = B.put(X[:chosen.shape[0]])
    y = moe_forward(model.layers[layer].ffn, model.family, model.experts, x, B, None, None, chosen)
    return np.array(B.to_host(y))


@pytest.fixture(scope="module")
def reference(resident):
    """chosen -> the resident model's MoE block output (computed once per routing)."""
    memo = {}

    def get(chosen, layer: int = 0):
        key = (layer, np.asarray(chosen).tobytes(), np.shape(chosen))
        if key not in memo:
            memo[key] = moe_out(resident, chosen, layer)
        return memo[key]

    return get


@pytest.fixture
def caches(gguf):
    """make(slots per layer, policy, host limit in MB, budget (bytes, instead of slots), settings
    (made by from_settings), **VRAMExpertCache options) -> (cache, model); every cache made is
    closed afterwards."""
    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_expert_cache import VRAMExpertCache
    from daemon.backend.cuda_transfer import pinned_empty
    from daemon.experts.offload import OffloadPolicy
    from daemon.backend.host_experts import host_expert_cache

    made = []

    def make(slots, policy=None, limit_mb=0.0, budget=None, settings=None, **kw):
        host = host_expert_cache(gguf, Settings.load(env={}, expert_cache_limit_mb=limit_mb), lambda _m: None,
                                 allocate=pinned_empty)
        backend = CUDABackend(0)
        if budget is None:
            budget = slots * VRAM_EXPERT * N_LAYERS
        if settings is not None:  # as the engine makes it
            backend.expert_budget = budget
            cache = VRAMExpertCache.from_settings(host, backend, settings)
        else:
            cache = VRAMExpertCache(host, backend, budget, OffloadPolicy(0) if policy is None else policy, **kw)
        made.append(cache)
        return cache, Transformer(gguf, experts=cache, backend=backend)

    yield make
    for c in made:
        c.close()


def _close(got, want, tol=QUANT_TOL) -> bool:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want)) <= tol


def _host_raw(cache, layer, e):
    """Expert e's raw rows (gate, up, down) as the host cache holds them."""
    with cache.host.fetch(layer, [e], count=False) as batch:
        return [np.array(s[batch.rows[e]]) for s in (batch.gate, batch.up, batch.down)]


def _synchronize(cache) -> None:
    cache.backend.stream.synchronize()
    cache.transfers.fetch.synchronize()


def _held(vl) -> dict[int, int]:
    """A layer's experts in VRAM -> their slots, read from its slot table."""
    return {int(e): si for si, e in enumerate(vl.table.expert_of.tolist()) if e >= 0}


def _pins_released(cache) -> bool:
    return all(not vl.table.pins.any() for vl in cache._layers.values())


# -- tier logic and statistics ------------------------------------------------------------------

@cuda_only
@pytest.mark.parametrize("per_layer, capacity, waves", [  # waves: of three experts (no slot: one, all on the CPU)
    (0, 0, 1), (VRAM_EXPERT - 1, 0, 1), (VRAM_EXPERT, 1, 3), (2 * VRAM_EXPERT, 2, 2), (4 * VRAM_EXPERT - 1, 3, 1),
    (4 * VRAM_EXPERT, 4, 1), (100 * VRAM_EXPERT, 4, 1),  # never more slots than experts (4)
])
def test_a_budget_of_n_slots_per_layer_gives_capacity_n(gguf, caches, per_layer, capacity, waves):
    cache, _ = caches(0, budget=per_layer * N_LAYERS)
    st = cache.stats()
    assert [vl.capacity for vl in cache._layers.values()] == [capacity] * N_LAYERS
    assert [st["layers"][il]["capacity"] for il in sorted(st["layers"])] == [capacity] * N_LAYERS
    assert st["budget_bytes"] == per_layer * N_LAYERS
    # the stacks: capacity experts of 4608 bytes a layer, at least
    assert st["vram_bytes"] >= capacity * VRAM_EXPERT * N_LAYERS
    assert len(cache.waves(0, [0, 1, 2])) == waves


@cuda_only
def test_hits_misses_evictions_and_the_replays(gguf, caches):
    from daemon.kernels.cuda.layout import repack
    from daemon.kernels.quants import Q8_0

    cache, _ = caches(2)
    # capacity 2, LRU. step: ids -> (hits, misses, evicted)
    #   {0,1} -> 0 hits, 2 misses;  {1} -> hit;  {2} -> miss, evicts 0 (least recent);
    #   {0} -> miss, evicts 1;  {1} -> miss, evicts 2;  {2} -> miss, evicts 0
    # live (= LRU replay): 1 hit of 7. Belady: {2} evicts 1 (used later than 0), {0} hits, {1}
    # evicts 0 (never used again), {2} hits: 3 hits of 7.
    steps = [[0, 1], [1], [2], [0], [1], [2]]
    for ids in steps:
        with cache.fetch(0, ids, routed=np.array([ids])) as batch:
            assert sorted(batch.rows) == sorted(ids)
            assert cache._layers[0].decision.cpu == []
    assert _pins_released(cache)
    st = cache.stats()
    assert (st["requests"], st["hits"], st["misses"]) == (7, 1, 6)
    assert st["requests"] == st["hits"] + st["misses"]
    assert (st["loads"], st["evictions"], st["copied_demand"]) == (6, 4, 6)
    assert st["bytes_copied"] == 6 * HOST_EXPERT
    assert (st["cpu_hybrid"], st["cpu_forced"], st["fallbacks"], st["admitted"]) == (0, 0, 0, 0)
    assert st["tokens"] == 6  # one row a step through the first MoE layer
    assert st["hit_rate"] == round(1 / 7, 6)
    assert st["lru_replay_hit_rate"] == round(1 / 7, 6)
    assert st["belady_hit_rate"] == round(3 / 7, 6)
    assert st["belady_hit_rate"] >= st["hit_rate"]
    assert st["replayed_requests"] == 7
    assert st["layers"][0]["cached"] == 2 and st["layers"][1]["cached"] == 0
    assert st["layers"][1]["requests"] == 0

    # the slots hold the experts' bytes, repacked, their padding zero
    vl = cache._layers[0]
    assert sorted(_held(vl)) == [1, 2]
    cache.transfers.fetch.synchronize()
    stacks = [s.copy_to_host() for s in vl.stacks]
    for e, si in _held(vl).items():
        for p, raw in enumerate(_host_raw(cache, 0, e)):
            np.testing.assert_array_equal(stacks[p][si], repack(raw, Q8_0))
            assert not stacks[p][si][:, 34:].any()

    cache.reset_stats()
    st = cache.stats()
    for k in ("requests", "hits", "misses", "loads", "evictions", "bytes_copied", "tokens", "fallbacks"):
        assert st[k] == 0, k
    assert st["belady_hit_rate"] is None and st["replayed_requests"] == 0
    assert st["layers"][0]["cached"] == 2  # the experts stay
    with cache.fetch(0, [2, 1]):
        pass
    st = cache.stats()
    assert (st["requests"], st["hits"], st["misses"], st["loads"]) == (2, 2, 0, 0)


@cuda_only
def test_prefetch_copies_ready_experts_and_counts_use_and_waste(gguf, caches):
    cache, _ = caches(2)
    cache.prefetch(0, [3])  # not in host memory yet: the host read starts (a copy only if it is done)
    _host_raw(cache, 0, 3)  # now it is read
    cache.prefetch(0, [3])
    st = cache.stats()
    assert (st["prefetch_issued"], st["loads"], st["requests"]) == (1, 1, 0)
    with cache.fetch(0, [3]):
        pass
    st = cache.stats()
    assert (st["hits"], st["misses"], st["prefetch_used"]) == (1, 0, 1)
    # a second prediction, never used, evicted by two misses
    _host_raw(cache, 0, 2)
    cache.prefetch(0, [2])
    with cache.fetch(0, [0, 1]):
        pass
    st = cache.stats()
    assert (st["prefetch_issued"], st["prefetch_wasted"], st["evictions"]) == (2, 1, 2)
    assert _pins_released(cache)


# -- event ordering -----------------------------------------------------------------------------

class _Recorder:
    """Logs the cache's Transfers calls and the backend's expert kernels, in order."""

    def __init__(self, cache, monkeypatch):
        self.log: list[tuple] = []
        tr, backend = cache.transfers, cache.backend
        for name in ("record", "wait", "done", "synchronize"):
            self._wrap(monkeypatch, tr, name)
        for name in ("expert_glu", "expert_linear"):
            self._wrap(monkeypatch, backend, name)
        self._wrap_copies(monkeypatch, tr)

    def _wrap_copies(self, monkeypatch, tr):
        """One ("h2d", dst, src, offset) a copy, whether issued alone or in a batch (which, without
        the driver's batch call, issues them through h2d: logged once)."""
        single, many = tr.h2d, tr.h2d_many
        in_batch = [False]

        def h2d(dst, src, offset=0):
            if not in_batch[0]:
                self.log.append(("h2d", dst, src, offset))
            return single(dst, src, offset)

        def h2d_many(dst, copies):
            self.log.extend(("h2d", dst, src, offset) for offset, src in copies)
            in_batch[0] = True
            try:
                return many(dst, copies)
            finally:
                in_batch[0] = False

        monkeypatch.setattr(tr, "h2d", h2d)
        monkeypatch.setattr(tr, "h2d_many", h2d_many)

    def _wrap(self, monkeypatch, obj, name):
        orig = getattr(obj, name)

        def logged(*a, **k):
            self.log.append((name, *a))
            return orig(*a, **k)

        monkeypatch.setattr(obj, name, logged)

    def mark(self) -> int:
        return len(self.log)


@cuda_only
def test_copies_events_and_waits_come_in_order(gguf, caches, reference, monkeypatch):
    from daemon.backend.cuda_transfer import Event

    cache, model = caches(2)
    rec = _Recorder(cache, monkeypatch)
    tr, compute = cache.transfers, cache.backend.stream
    vl = cache._layers[0]

    def check_step(start, n):
        """One step that copied n experts (every expert of the step)."""
        log = rec.log[start:]
        names = [x[0] for x in log]
        # the fetch stream: every gate and up (2n copies), the layer's gate/up event, every down
        # (n copies), its down event
        fetch_side = [x[0] for x in log if x[0] == "h2d" or (x[0] == "record" and x[1] in (vl.gu, vl.down))]
        assert fetch_side == ["h2d"] * 2 * n + ["record"] + ["h2d"] * n + ["record"]
        gu_rec = [i for i, x in enumerate(log) if x[0] == "record" and x[1] is vl.gu]
        down_rec = [i for i, x in enumerate(log) if x[0] == "record" and x[1] is vl.down]
        assert len(gu_rec) == len(down_rec) == 1 and gu_rec[0] < down_rec[0]
        assert all(log[i][2] is tr.fetch for i in gu_rec + down_rec)
        # the compute stream: the ready experts' gate/up, a wait on the gate/up event, the copied
        # experts' gate/up, a wait on the down event, then the down projection
        waits = [(i, x) for i, x in enumerate(log) if x[0] == "wait" and x[1] is compute]
        gu_waits = [i for i, x in waits if x[2] is vl.gu]
        down_waits = [i for i, x in waits if x[2] is vl.down]
        assert len(gu_waits) == len(down_waits) == 1
        glus = [i for i, nm in enumerate(names) if nm == "expert_glu"]
        downs = [i for i, x in enumerate(log) if x[0] == "expert_linear"]
        assert len(glus) == 2 and len(downs) == 1
        assert gu_rec[0] < glus[0] < gu_waits[0] < glus[1] < down_waits[0] < downs[0]
        assert down_rec[0] < down_waits[0]
        # afterwards the layer's freed event is recorded on the compute stream, once
        freed = [i for i, x in enumerate(log) if x[0] == "record" and x[1] is vl.freed]
        assert len(freed) == 1 and log[freed[0]][2] is compute and freed[0] > downs[0]

    # step A: experts 0 and 1 copied into the two fresh slots: no freed event to wait on yet
    a = rec.mark()
    np.testing.assert_array_equal(moe_out(model, [[0, 1]]), reference([[0, 1]]))
    slots_a = sorted(_held(vl).values())
    assert len(slots_a) == 2
    check_step(a, 2)
    assert not any(x[0] == "wait" and x[2] is vl.freed for x in rec.log[a:])

    # step B: 2 and 3 evict 0 and 1: the copies into used slots first make the fetch stream wait
    # on the layer's freed event (recorded at the end of step A)
    b = rec.mark()
    np.testing.assert_array_equal(moe_out(model, [[2, 3]]), reference([[2, 3]]))
    assert sorted(_held(vl).values()) == slots_a
    check_step(b, 2)
    log = rec.log
    first_copy = next(i for i in range(b, len(log)) if log[i][0] == "h2d")
    waits = [i for i in range(b, len(log)) if log[i][0] == "wait" and log[i][2] is vl.freed]
    assert len(waits) == 1 and log[waits[0]][1] is tr.fetch and waits[0] < first_copy
    assert any(x[0] == "record" and x[1] is vl.freed and x[2] is compute for x in log[a:b])

    # step C: 2 and 3 again, both ready: one gate/up launch, no wait, no copy
    c = rec.mark()
    np.testing.assert_array_equal(moe_out(model, [[2, 3]]), reference([[2, 3]]))
    assert [x[0] for x in rec.log[c:] if x[0] in ("h2d", "wait", "expert_glu")] == ["expert_glu"]

    # no wait is ever on a whole stream: every wait, query and synchronize names an event
    assert all(isinstance(x[2], Event) for x in log if x[0] == "wait")
    assert all(isinstance(x[1], Event) for x in log if x[0] in ("done", "synchronize"))
    assert _pins_released(cache)
    st = cache.stats()
    assert (st["loads"], st["evictions"], st["fallbacks"], st["hits"]) == (4, 2, 0, 2)


@cuda_only
@pytest.mark.parametrize("min_batch", [pytest.param(0, marks=pytest.mark.skipif(
    SIM, reason="two minutes in the simulator, where CI runs near its time limit: min_batch 2 stays there")), 2])
def test_a_captured_layers_launches_give_the_eager_bits(gguf, caches, reference, monkeypatch, min_batch):
    """A captured step launches every kernel a layer could need (both gate/up launches, both waits,
    the zeroed h, the CPU pairs' scatter), steered by what its host points write. With each
    decision made first, as a replay makes it, a layer gives the eager step's bits; hybrid off,
    the resident bits."""
    from daemon.backend.cuda_expert_cache import _Hold
    from daemon.backend.cuda_staged import StagedBatch
    from daemon.experts.offload import OffloadPolicy

    eager_cache, eager_model = caches(2, OffloadPolicy(min_batch))
    cache, model = caches(2, OffloadPolicy(min_batch))
    launched = []

    def as_replayed(layer, ids, routed=None):
        vl = cache._layers[layer]
        cache._decide(vl, layer, ids, routed)
        launched.append(vl.decision)
        return _Hold(cache, vl, StagedBatch(cache, vl, graph=True))

    monkeypatch.setattr(cache, "fetch", as_replayed)
    # misses, then hits with a copy, all hits, CPU pairs (min_batch 2: experts of one row), none again
    for chosen in ([[0, 1], [0, 1]], [[0, 2], [0, 2]], [[0, 2], [2, 0]], [[1, 3], [0, 2]], [[0, 2], [0, 2]]):
        want = moe_out(eager_model, chosen)
        np.testing.assert_array_equal(moe_out(model, chosen), want)
        if min_batch == 0:
            np.testing.assert_array_equal(want, reference(chosen))
    assert all(d.released for d in launched)
    assert _pins_released(cache)
    st, est = cache.stats(), eager_cache.stats()
    for k in ("hits", "misses", "loads", "cpu_hybrid", "admitted"):
        assert st[k] == est[k], k
    assert (st["cpu_hybrid"] > 0) == (min_batch == 2)


# -- fall-backs ---------------------------------------------------------------------------------

@cuda_only
def test_a_failed_copy_computes_on_the_cpu_and_warns_once(gguf, caches, reference, caplog):
    cache, model = caches(2)

    def fault():
        raise RuntimeError("injected copy failure")

    cache.transfers.fault = fault
    want = reference([[0, 1]])
    with caplog.at_level(logging.WARNING, "moed.device"):
        for _ in range(2):
            got = moe_out(model, [[0, 1]])
            assert _close(got, want)
    warned = [r for r in caplog.records if "copy" in r.getMessage() and "failed" in r.getMessage()]
    assert len(warned) == 1 and "injected copy failure" in warned[0].getMessage()
    st = cache.stats()
    assert (st["fallbacks"], st["loads"], st["bytes_copied"], st["misses"]) == (4, 0, 0, 4)
    assert st["layers"][0]["cached"] == 0
    assert _pins_released(cache)
    # the copies work again: the experts arrive, the same bits as resident ones
    cache.transfers.fault = None
    np.testing.assert_array_equal(moe_out(model, [[0, 1]]), want)
    st = cache.stats()
    assert (st["fallbacks"], st["loads"]) == (4, 2)
    assert _pins_released(cache)


@cuda_only
def test_force_cpu_computes_every_expert_on_the_cpu(gguf, caches, reference):
    """MOE_POSTFETCH_FORCE_CPU=1 through from_settings, as the engine makes the cache."""
    cfg = Settings.load(env={}, postfetch_force_cpu=True, offload_min_batch="0")
    cache, model = caches(4, settings=cfg)
    assert cache.force_cpu and all(vl.capacity == 0 for vl in cache._layers.values())
    assert cache.waves(0, [0, 1, 2]) == [[0, 1, 2]]
    assert _close(moe_out(model, [[0, 1], [2, 1]]), reference([[0, 1], [2, 1]]))
    st = cache.stats()
    assert (st["requests"], st["misses"], st["cpu_forced"]) == (3, 3, 3)
    assert (st["loads"], st["bytes_copied"], st["fallbacks"], st["admitted"]) == (0, 0, 0, 0)
    assert st["force_cpu"] is True and st["belady_hit_rate"] is None
    assert "MOE_OFFLOAD_MIN_BATCH=0" in st["offload"]


@cuda_only
def test_no_slot_at_all_computes_on_the_cpu(gguf, caches, reference):
    """A budget below one expert a layer: every expert a wave of its own, computed on the CPU."""
    cache, model = caches(0)
    assert all(vl.capacity == 0 for vl in cache._layers.values())
    assert _close(moe_out(model, [[0, 1]]), reference([[0, 1]]))
    st = cache.stats()
    assert (st["requests"], st["misses"], st["fallbacks"], st["loads"]) == (2, 2, 2, 0)


@cuda_only
def test_hybrid_compute_sends_single_token_experts_to_the_cpu_and_admits_them(gguf, caches, reference):
    from daemon.experts.offload import OffloadPolicy

    cache, model = caches(4, OffloadPolicy(2))
    chosen = [[0, 1], [0, 2]]  # expert 0: 2 tokens (copied); 1 and 2: one each (the CPU)
    want = reference(chosen)
    assert _close(moe_out(model, chosen), want)
    st = cache.stats()
    assert (st["misses"], st["cpu_hybrid"], st["copied_demand"], st["admitted"], st["loads"]) == (3, 2, 1, 2, 3)
    assert sorted(_held(cache._layers[0])) == [0, 1, 2]
    assert _pins_released(cache)
    # the admitted experts are in VRAM now: every expert on the GPU, the resident bits
    np.testing.assert_array_equal(moe_out(model, chosen), want)
    st = cache.stats()
    assert (st["hits"], st["prefetch_used"], st["cpu_hybrid"], st["loads"]) == (3, 2, 2, 3)


@cuda_only
def test_a_failed_admission_copy_leaves_no_slot_pinned(gguf, caches, reference):
    from daemon.experts.offload import OffloadPolicy

    cache, model = caches(4, OffloadPolicy(2))
    calls = []

    def fault():  # expert 0's three projections copy; the admission's first copy fails
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected copy failure")

    cache.transfers.fault = fault
    chosen = [[0, 1], [0, 2]]
    assert _close(moe_out(model, chosen), reference(chosen))
    assert _pins_released(cache)
    assert _held(cache._layers[0]) == {}  # expert 0 copied, but dropped with the admissions
    st = cache.stats()
    assert (st["cpu_hybrid"], st["fallbacks"], st["admitted"], st["copied_demand"]) == (2, 1, 0, 0)


@cuda_only
def test_a_failed_host_read_leaves_no_expert_in_a_slot_it_never_reached(gguf, caches, reference, monkeypatch):
    cache, model = caches(2)
    fetch = cache.host.fetch

    def failing(*a, **k):
        raise StorageError("injected read failure")

    monkeypatch.setattr(cache.host, "fetch", failing)
    with pytest.raises(StorageError):
        moe_out(model, [[0, 1]])
    monkeypatch.setattr(cache.host, "fetch", fetch)
    # the step after the failed one (today: experts 0 and 1 "ready" in slots never copied to:
    # zeros under the simulator; the slots pinned for good)
    np.testing.assert_array_equal(moe_out(model, [[0, 1]]), reference([[0, 1]]))
    assert _pins_released(cache)


@cuda_only
def test_tokens_count_each_row_once_whatever_the_waves(gguf, caches):
    cache, _ = caches(1)
    routed = np.array([[0, 1]])
    waves = cache.waves(0, [0, 1])
    assert len(waves) == 2
    for wave in waves:  # as moe_forward does
        with cache.fetch(0, wave, routed=routed):
            pass
    assert cache.stats()["tokens"] == 1


# -- bits with hybrid compute off -----------------------------------------------------------------

@cuda_only
@pytest.mark.parametrize("slots, postfetch, hits, loads, evictions", [
    # 2 slots: waves [0, 1] then [2] (evicts 0); again: [1, 2] (hits) then [0] (evicts 1)
    (2, True, 2, 4, 2),
    # 4 slots: one batch, copied, then every expert ready
    (4, False, 3, 3, 0),
], ids=["2-slots-postfetch", "4-slots-no-postfetch"])
def test_hybrid_off_gives_the_resident_bits_whatever_the_cache(gguf, caches, reference, slots, postfetch, hits,
                                                               loads, evictions):
    cache, model = caches(slots, postfetch=postfetch)
    chosen = [[0, 1], [2, 1]]  # three experts: two waves with 2 slots, one batch with 4
    want = reference(chosen)
    assert len(cache.waves(0, [0, 1, 2])) == (2 if slots == 2 else 1)
    np.testing.assert_array_equal(moe_out(model, chosen), want)  # copies
    np.testing.assert_array_equal(moe_out(model, chosen), want)  # with 4 slots: every expert ready
    st = cache.stats()
    assert (st["fallbacks"], st["cpu_hybrid"], st["admitted"]) == (0, 0, 0)
    assert (st["requests"], st["hits"], st["loads"], st["evictions"]) == (6, hits, loads, evictions)
    assert _pins_released(cache)


@cuda_only
def test_the_whole_model_through_a_small_cache_gives_the_resident_logits(gguf, resident, caches, monkeypatch):
    """Two slots a layer (of four experts), hybrid compute off: a prefill (its rows route to more
    experts than the slots: waves) and a decode step."""

    def run(model):
        c = model.new_cache(8)
        return np.concatenate([model.forward([1, 5], c).reshape(-1), model.forward([7], c).reshape(-1)])

    cache, model = caches(2)
    n_waves, waves = [], cache.waves
    monkeypatch.setattr(cache, "waves", lambda layer, ids: n_waves.append(len(w := waves(layer, ids))) or w)
    np.testing.assert_array_equal(run(model), run(resident))
    assert len(n_waves) == 2 * N_LAYERS and max(n_waves) > 1
    st = cache.stats()
    assert st["fallbacks"] == 0 and st["misses"] > 0 and st["loads"] > 0
    assert st["requests"] == st["hits"] + st["misses"]
    assert _pins_released(cache)


# -- host slots stay pinned until their copies are done ------------------------------------------

@cuda_only
def test_host_slots_are_reused_only_after_their_copies(gguf, caches, reference, monkeypatch):
    from daemon.backend import cuda_expert_cache as cec

    # one host slot and one VRAM slot a layer: every expert of a step is a wave of its own, and
    # each host read reuses the one slot unless a copy still reads it
    limit_mb = N_LAYERS * HOST_EXPERT / 2**20
    cache, model = caches(1, limit_mb=limit_mb)
    lc = cache.host._layers[0]
    assert lc.capacity == 1 and cache._layers[0].capacity == 1
    monkeypatch.setattr(cec, "STALE_S", 1e9)  # a copy never "done" below is not taken as failed
    done = {"now": False}
    real_done = cache.transfers.done
    monkeypatch.setattr(cache.transfers, "done", lambda ev: done["now"] and real_done(ev))

    # copies never done: the host entry of the first wave stays pinned, the second expert is read
    # into a buffer of its own, both holds wait in the reap list
    np.testing.assert_array_equal(moe_out(model, [[0, 1]]), reference([[0, 1]]))
    assert len(cache._reap_list) == 2
    assert [e for e, ent in lc.entries.items() if ent.pins] == [0]
    assert lc.entries[0].pins == 1
    assert cache.host.stats()["layers"][0]["evictions"] == 0

    # done: the next fetch reaps them, and the one host slot is reused for each new expert
    done["now"] = True
    _synchronize(cache)
    np.testing.assert_array_equal(moe_out(model, [[2, 3]]), reference([[2, 3]]))
    _synchronize(cache)
    cache._reap()
    assert cache._reap_list == []
    assert all(ent.pins == 0 for ent in lc.entries.values())
    host = cache.host.stats()["layers"][0]
    # the overflow buffer of expert 1 dropped, entry 0 evicted for 2, and 2 for 3 (on a GPU, 3
    # may get an overflow buffer instead if 2's copy is still running: dropped, counted the same)
    assert host["evictions"] == 3 and host["cached"] == 1
    assert _pins_released(cache)


# -- kernels ------------------------------------------------------------------------------------

@cuda_only
@pytest.mark.parametrize("wtype", ["Q8_0", "F16"])
def test_repack_into_slots_writes_only_its_slots(wtype):
    from numba import cuda

    from daemon.kernels.cuda.layout import repack, repack_into_slots
    from daemon.kernels.quants import F16, Q8_0

    ggml_type = {"Q8_0": Q8_0, "F16": F16}[wtype]
    # raw row bytes, repacked: Q8_0 of 64 values is 2 blocks of 34 bytes, padded to 80; F16 of 16
    # values is 32 bytes, already a multiple of 16
    rb, stride = {"Q8_0": (68, 80), "F16": (32, 32)}[wtype]
    rng = np.random.default_rng(3)
    n, rows, S = 2, 3, 5
    raw = rng.integers(0, 256, (n, rows, rb), dtype=np.uint8)
    fill = np.full((S, rows, stride), 0xA5, np.uint8)
    stack = cuda.to_device(fill)
    slots = [3, 0]  # out of order, not contiguous
    repack_into_slots(cuda.to_device(raw), stack, cuda.to_device(np.array(slots, np.int32)), ggml_type)
    cuda.synchronize()
    got = stack.copy_to_host()
    for i, si in enumerate(slots):
        want = repack(raw[i], ggml_type)
        np.testing.assert_array_equal(got[si][:, :rb], want[:, :rb])
        assert (got[si][:, rb:] == 0xA5).all()  # padding left as it was
    for si in set(range(S)) - set(slots):
        np.testing.assert_array_equal(got[si], fill[si])
    with pytest.raises(ValueError, match="stack must be"):
        repack_into_slots(cuda.to_device(raw), cuda.to_device(np.zeros((S, rows + 1, stride), np.uint8)),
                          cuda.to_device(np.array(slots, np.int32)), ggml_type)


@cuda_only
def test_scatter_rows():
    from numba import cuda

    from daemon.backend.cuda_weights import scatter_rows

    src = np.arange(15, dtype=np.float32).reshape(3, 5) + 1
    out = cuda.to_device(np.full((6, 5), -1, np.float32))
    scatter_rows(cuda.to_device(src), cuda.to_device(np.array([4, 0, 2], np.int32)), out)
    cuda.synchronize()
    want = np.full((6, 5), -1, np.float32)
    want[4], want[0], want[2] = src[0], src[1], src[2]
    np.testing.assert_array_equal(out.copy_to_host(), want)
    scatter_rows(cuda.to_device(src[:0]), cuda.to_device(np.zeros(0, np.int32)), out)  # nothing
    cuda.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), want)


# -- select._expert_budget (pure: no GPU) ---------------------------------------------------------

GIB = 2**30
NEED = VRAMEstimate(weights=4 * GIB, experts=8 * GIB, kv_per_sequence=GIB, scratch=GIB, n_ctx=4096)  # 14 GiB


def test_margin_is_one_gib():
    assert MARGIN == GIB


@pytest.mark.parametrize("setting, free, want", [
    ("auto", 14 * GIB, None),  # everything fits exactly
    ("auto", 16 * GIB, None),
    ("8192", 16 * GIB, None),  # asked for every expert's bytes, and all fits
    ("9000", 14 * GIB, None),
])
def test_experts_resident_when_they_fit(setting, free, want):
    assert _expert_budget(setting, NEED, free) == (want, "")


@pytest.mark.parametrize("setting, free, want", [
    # room = free - (14 - 8) GiB of the rest - 1 GiB margin
    ("auto", 12 * GIB, 5 * GIB),
    ("auto", 7 * GIB + 1, 1),
    ("1024", 16 * GIB, GIB),  # asked for less than every expert, though they would fit: asked
    ("1024", 12 * GIB, GIB),
    ("0.5", 12 * GIB, GIB // 2048),  # MiB, fractions allowed
    ("5120", 12 * GIB, 5 * GIB),  # exactly the room
])
def test_the_cache_gets_what_is_asked_or_the_room(setting, free, want):
    assert _expert_budget(setting, NEED, free) == (want, "")


@pytest.mark.parametrize("setting, free", [("6144", 12 * GIB), ("8192", 12 * GIB), ("100000", 12 * GIB)])
def test_more_than_the_room_is_clamped_with_a_warning(setting, free, caplog):
    with caplog.at_level(logging.WARNING, "moed.device"):
        assert _expert_budget(setting, NEED, free) == (5 * GIB, "")
    assert len(caplog.records) == 1
    assert f"MOE_GPU_CACHE_MB={setting}" in caplog.messages[0] and "5,120 MiB" in caplog.messages[0]


@pytest.mark.parametrize("setting", ["auto", "1024"])
@pytest.mark.parametrize("free", [7 * GIB, 6 * GIB, 1 * GIB, 0])  # the rest (6 GiB) + margin (1 GiB): no room
def test_no_room_beside_the_weights_is_a_reason(setting, free):
    budget, why = _expert_budget(setting, NEED, free)
    assert budget is None
    assert "without its experts" in why and "7,168 MiB" in why and "14,336 MiB" in why


def test_calibration_measures_the_cpu_experts_rate_and_fixed_cost(caches):
    """MOE_OFFLOAD_MIN_BATCH=auto's start-up measurement: a pinned copy, then one and several experts
    a call on the CPU (the simulator times no copy: its host-to-device figure is the stated default)."""
    from daemon.experts.offload import OffloadPolicy


    cache, _ = caches(2)
    h2d, cpu, fixed = cache.calibrate()
    assert h2d == 25e9 if SIM else 1e9 < h2d < 1e12
    assert 0 < cpu < float("inf") and 0 <= fixed < 1.0
    assert "+ " in OffloadPolicy(None, h2d, cpu, fixed).describe()


def test_auto_refits_the_cpu_cost_from_the_steps(caches, reference):
    """Seeded with a CPU far faster than any machine's, the cost model sends the first misses to the
    CPU; their measured time then replaces the seed (tokens x bytes over seconds, one call)."""
    from daemon.experts.offload import OffloadPolicy

    seed = OffloadPolicy(None, h2d_bytes_per_s=1e9, cpu_bytes_per_s=1e18)
    cache, model = caches(2, seed)
    np.testing.assert_allclose(moe_out(model, [[0, 1]]), reference([[0, 1]]), rtol=5e-2, atol=5e-3)
    assert cache.stats()["cpu_hybrid"] == 2
    fit = cache.offload
    assert fit.min_batch is None and fit.h2d_bytes_per_s == 1e9
    assert 0 < fit.cpu_bytes_per_s < 1e13 and fit.cpu_call_s == 0.0  # one call: through the origin
    spent_s = cache.stats()["cpu_ms"] / 1e3
    assert fit.cpu_bytes_per_s == pytest.approx(2 * cache.layout(0).expert_nbytes / spent_s, rel=1e-6)
